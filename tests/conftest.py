"""Shared fixtures: real SciFact data from ../shared/data, project folders, a shared embedder."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

import ragline.flows  # noqa: F401 - offline defaults before any heavy import

# A command whose local LLM endpoint is down starts the packaged vLLM (issue 24.3): never in a test
# unless it asks for it (tests/fake_vllm.py, RAGLINE_VLLM_DEPLOY, RAGLINE_START_LLM unset for its child).
os.environ.setdefault("RAGLINE_START_LLM", "0")

REPO = Path(__file__).resolve().parents[1]
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


def index_and_search_yaml(batch_size: int = 256, chunk_size: int = 128) -> str:
    return INDEX_AND_SEARCH.replace("BATCH_SIZE", str(batch_size)).replace("CHUNK_SIZE", str(chunk_size))


def scifact_records(n: int, offset: int = 0) -> list[dict]:
    """The first n SciFact corpus records (read from shared data, never copied into the repo)."""
    if not SCIFACT.exists():
        pytest.skip(f"SciFact data not found at {SCIFACT}")
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


@pytest.fixture
def make_project(tmp_path):
    """Write a pipelines.yaml (and optional prompts) into tmp_path; returns its path."""

    def make(yaml_text: str, prompts: dict[str, str] | None = None, name: str = "pipelines.yaml") -> Path:
        (tmp_path / "prompts").mkdir(exist_ok=True)
        for prompt, body in (prompts or {}).items():
            (tmp_path / "prompts" / f"{prompt}.j2").write_text(body)
        path = tmp_path / name
        path.write_text(textwrap.dedent(yaml_text))
        return path

    return make


@pytest.fixture
def index_project(make_project):
    """A project with the standard index/search pipelines over tmp_path/docs."""

    def make(batch_size: int = 256, chunk_size: int = 128) -> Path:
        return make_project(index_and_search_yaml(batch_size, chunk_size))

    return make


from tests.llm_conftest import vllm_server  # noqa: E402,F401 - session fixture: a real vLLM server


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory) -> Path:
    """A real but tiny, randomly initialised BERT cross-encoder with the MiniLM tokenizer, saved as
    a local model folder: no cross-encoder ships its weights offline (see MODELS.md)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ragline.flows.resources.embedder import resolve_model_path

    folder = tmp_path_factory.mktemp("cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
