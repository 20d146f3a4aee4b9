"""What named collections cost at query time, and that adding one re-indexes nothing (issue 19 item 1).

SciFact's first ``--docs`` records are indexed twice: as one index (no `collections:`), and split in
three collections (part_a, part_b, part_c) of one template. The same queries run through the hybrid `search`
pipeline (dense + BM25, RRF) over the single index, over all three collections and over one. Then a
fourth collection is added to the file and part_a's ingestion runs again: every document is
unchanged (its fingerprint did not move), nothing is embedded.

Usage: .venv/bin/python bench/collections_fanout.py [--docs 300] [--queries 100] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from common import SCIFACT, save, summary_ms

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

RESOURCES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: scifact}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
"""
PIPELINES = """
pipelines:
  index:
    kind: ingestion
    batch_size: 512
    steps:
      - {id: load,  task: load, with: {paths: [all.jsonl]}}
      - {id: chunk, task: chunk, with: {size: 256, overlap: 32}}
      - {id: embed, task: embed}
      - {id: write, task: index, with: {gate_floor_pairs: 0}}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 50}}
      - {id: sparse, task: retrieve_sparse, with: {k: 50}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 10}}
"""
PARTS = ("part_a", "part_b", "part_c")


def collections_block(names) -> str:
    return "collections:\n" + "".join(f"  {n}: {{paths: [{n}.jsonl]}}\n" for n in names)


def split_corpus(folder: Path, docs: int) -> None:
    """all.jsonl: the first ``docs`` records; part_a/b/c/d.jsonl: them in thirds (d: one more record)."""
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as src:
        lines = [line for _, line in zip(range(docs + 1), src)]
    (folder / "all.jsonl").write_text("".join(lines[:docs]))
    third = docs // 3
    for i, name in enumerate(PARTS):
        (folder / f"{name}.jsonl").write_text("".join(lines[i * third:(i + 1) * third if i < 2 else docs]))
    (folder / "part_d.jsonl").write_text(lines[docs])


def questions(n: int) -> list[str]:
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as src:
        return [json.loads(line)["text"] for _, line in zip(range(n), src)]


def timed(pipeline, texts: list[str], collections: list[str] | None) -> dict[str, float]:
    for text in texts[:3]:  # warm: models loaded, stores opened
        engine.run(pipeline, {"query": {"text": text, "collections": collections}}, orchestrate=False)
    seconds = []
    for text in texts:
        started = time.perf_counter()
        engine.run(pipeline, {"query": {"text": text, "collections": collections}}, orchestrate=False)
        seconds.append(time.perf_counter() - started)
    return summary_ms(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--workdir", type=Path, help="keep the indexes here (a second run indexes nothing new)")
    args = parser.parse_args()
    texts = questions(args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        split_corpus(folder, args.docs)
        single = folder / "single.yaml"
        single.write_text(RESOURCES.replace("idx/", "single/") + PIPELINES)
        engine.run(load_project(single, tuned=False).pipeline("index"), orchestrate=False)
        named = folder / "named.yaml"
        named.write_text(RESOURCES + collections_block(PARTS) + PIPELINES)
        project = load_project(named, tuned=False)
        for name in PARTS:
            engine.run(project.pipeline(f"index@{name}"), orchestrate=False)
        results = {
            "one index (no collections)": timed(load_project(single, tuned=False).pipeline("search"), texts, None),
            "3 collections, all searched": timed(project.pipeline("search"), texts, None),
            "3 collections, one searched": timed(project.pipeline("search"), texts, ["part_a"]),
        }
        named.write_text(RESOURCES + collections_block((*PARTS, "part_d")) + PIPELINES)
        started = time.perf_counter()
        again = engine.run(load_project(named, tuned=False).pipeline("index@part_a"), orchestrate=False)
        results["index@part_a after adding collection part_d"] = {
            "seconds": round(time.perf_counter() - started, 2), "unchanged": again.unchanged, "added": again.added,
            "updated": again.updated}
    print(f"SciFact {args.docs} documents, {args.queries} queries, hybrid search top 10 ({platform.processor() or 'cpu'})")
    for name, figures in results.items():
        print(f"  {name}: {figures}")
    save("collections_fanout", {"docs": args.docs, "queries": args.queries, "results": results})


if __name__ == "__main__":
    main()
