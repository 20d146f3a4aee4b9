"""SciFact data from the shared data folder, and the project templates several test modules use."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("RAGLINE_DATA_DIR", REPO.parent / "shared" / "data"))
SCIFACT = DATA / "scifact"

BASE_RESOURCES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
"""

INDEX_AND_SEARCH = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    batch_size: BATCH_SIZE
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: CHUNK_SIZE, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


def shipped_pipeline(name: str) -> str:
    """One pipeline of the repository's pipelines.yaml, as its lines (indented for ``pipelines:``), to
    append to a test project's pipelines: the shipped definition, not a copy that drifts from it."""
    lines = (REPO / "pipelines.yaml").read_text(encoding="utf-8").splitlines(keepends=True)
    start = lines.index(f"  {name}:\n")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i].startswith("   ")),
               len(lines))
    return "".join(lines[start:end])


def index_and_search_yaml(batch_size: int = 256, chunk_size: int = 128) -> str:
    return INDEX_AND_SEARCH.replace("BATCH_SIZE", str(batch_size)).replace("CHUNK_SIZE", str(chunk_size))


# The default backend's resource lines, and the milvus one that replaces them: one resource, both roles
# (the only milvus resource, it is bound to `store` and to `sparse`).
CHROMA_LINES = """  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
"""
MILVUS_LINES = """  store:    {type: milvus, uri: idx/milvus.db, collection: test}
"""


def milvus_yaml(batch_size: int = 3) -> str:
    """``index_and_search_yaml`` with only its resource lines changed to one embedded milvus resource."""
    text = textwrap.dedent(index_and_search_yaml(batch_size=batch_size))
    assert CHROMA_LINES in text
    return text.replace(CHROMA_LINES, MILVUS_LINES)


# A hybrid query pipeline whose BM25 side reads an opt-in keyword expansion (off until tuned): the
# tuning tests (tests/tasks/test_tune_*.py) append it to index_and_search_yaml()'s pipelines.
SEARCH_TERMS = """  search_terms:
    kind: query
    steps:
      - {id: terms,  task: expand_terms, with: {enabled: false}}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [terms]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


def require_scifact() -> None:
    """Skip a test without SciFact, unless every data test is required (``RAGLINE_REQUIRE_DATA=1``,
    as .ci/run sets): there a clone without the shared data fails instead of passing by skipping."""
    if SCIFACT.exists():
        return
    message = f"SciFact data not found at {SCIFACT} (set RAGLINE_DATA_DIR to the shared data folder)"
    if os.environ.get("RAGLINE_REQUIRE_DATA") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def scifact_records(n: int, offset: int = 0) -> list[dict]:
    """The first n SciFact corpus records (read from shared data, never copied into the repo)."""
    require_scifact()
    out = []
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            if i >= offset + n:
                break
            if i >= offset:
                out.append(json.loads(line))
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
