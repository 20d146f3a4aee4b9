"""The served-index project (SciFact records and notes, one index, a schedule) and how its tests ask
the served API and the index what they hold: shared by the Chroma and Milvus served-index tests."""
from __future__ import annotations

import textwrap
from pathlib import Path

import httpx

from tests.helpers.data import scifact_records, write_jsonl
from tests.integration.serving import AUTH, FINAL, _wait_status


PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: main}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}

pipelines:
  index:
    kind: ingestion
    schedule: {cron: "0 4 * * *"}
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 128, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  dense:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 1000}}
  bm25:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 1000}}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 10}}
      - {id: sparse, task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 5}}
"""


ZEBRAFISH = "# Zebrafish\n\nZebrafish regenerate their fins and their heart after injury.\n"


AXOLOTL = "# Zebrafish\n\nAxolotl salamanders regrow whole limbs, a trick zebrafish cannot match.\n"


OKAPI = "# Okapi\n\nThe okapi is a forest giraffid of the Congo with striped legs.\n"


def write_project(root: Path, pipelines: str) -> Path:
    """This module's corpus (12 SciFact records and zebrafish.md) under ``root``, with ``pipelines``."""
    write_jsonl(root / "docs" / "corpus.jsonl", scifact_records(12))
    (root / "docs" / "zebrafish.md").write_text(ZEBRAFISH)
    path = root / "pipelines.yaml"
    path.write_text(textwrap.dedent(pipelines))
    return path


def query(served: str, pipeline: str, question: str) -> list[dict]:
    response = httpx.post(f"{served}/v1/query", json={"pipeline": pipeline, "question": question},
                          headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    items = response.json()["passages"]  # a lone retriever gives one ranking per search text
    return [p for item in items for p in (item["passages"] if "passages" in item else [item])]


def sources(passages: list[dict]) -> set[str]:
    return {p["source_id"] for p in passages}


def documents(project: Path) -> set[str]:
    """The source ids the index state holds (what both retrievers must agree on)."""
    import sqlite3

    with sqlite3.connect(f"file:{project.parent / 'idx' / 'state.sqlite'}?mode=ro", uri=True) as conn:
        return {row[0] for row in conn.execute("SELECT source_id FROM sources")}


def ingest(served: str) -> dict:
    started = httpx.post(f"{served}/v1/ingest", json={"pipeline": "index"}, headers=AUTH, timeout=30)
    assert started.status_code == 202, started.text
    status = _wait_status(served, started.json()["run_id"], FINAL, timeout=600)
    assert status["state"] == "COMPLETED", status
    return status


def the(name: str, found: set[str]) -> str | None:
    return next((s for s in found if s.endswith(name)), None)
