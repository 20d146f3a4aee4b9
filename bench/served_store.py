"""What serving an embedded store through its managed Chroma server costs, and what it buys.

``ragline serve`` / ``ragline api`` start a ``chroma run`` over each embedded store and every process
of the project reaches the store through it (flows/ops/chroma_server.py). Measured here on the shipped
``search_dense`` pipeline over a SciFact index, in one process, alternating (AB, BA, ...):
- dense query latency with the store opened embedded (the baseline: what every process did before)
  vs through the managed server (HTTP on loopback), the same queries, one phase after the other
  (resources are per process: a process uses one or the other);
- freshness: another process (`ragline index`) adds documents while the server runs; the served
  reader's next queries find them (an embedded reader opened before would not: see
  tests/integration/test_served_index.py for that failure on the old code).

Usage: .venv/bin/python bench/served_store.py [--queries 200] [--docs 300] [--added 50]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

from common import REPO, index_more, indexed_workspace, percentile, publish, save
from ragline.flows.run import engine
from ragline.flows.ops.store_servers import serve_stores
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache


def latencies(pipeline, questions: list[str]) -> list[float]:
    out = []
    for question in questions:
        started = time.perf_counter()
        engine.run(pipeline, {"query": question}, orchestrate=False)
        out.append(1000 * (time.perf_counter() - started))
    return out


def found(project, pipeline: str, texts: list[str]) -> int:
    """How many of ``texts`` (the added abstracts' titles) come back first for themselves."""
    compiled = project.pipeline(pipeline)
    hits = 0
    for text in texts:
        result = engine.run(compiled, {"query": text}, orchestrate=False)
        passages = result[0].passages if result and hasattr(result[0], "passages") else result  # rankings or passages
        first = passages[0] if passages else None
        hits += first is not None and first.title == text
    return hits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--added", type=int, default=50)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs) as (pipelines_file, _, questions):
        questions = questions[:args.queries]
        embedded_project = load_project(pipelines_file)
        dense = embedded_project.pipeline("search_dense")
        latencies(dense, questions[:10])  # warm the embedder and the embedded store
        embedded = latencies(dense, questions)
        with contextlib.ExitStack() as stack:
            clear_cache()  # a fresh process's view: the served reader connects after the server is up
            serve_stores(load_project(pipelines_file), stack, lambda line: print(line, file=sys.stderr))
            served_project = load_project(pipelines_file)
            served_dense = served_project.pipeline("search_dense")
            latencies(served_dense, questions[:10])
            served = latencies(served_dense, questions)
            titles = index_more(pipelines_file, args.docs, args.added)
            fresh_served = found(served_project, "search_dense", titles)
        clear_cache()
    result = {
        "queries": len(questions), "docs": args.docs, "added": len(titles),
        "embedded": {"median_ms": round(percentile(embedded, 50), 2), "p95_ms": round(percentile(embedded, 95), 2)},
        "served": {"median_ms": round(percentile(served, 50), 2), "p95_ms": round(percentile(served, 95), 2)},
        "served_finds_added": fresh_served,
    }
    result["ratio_median"] = round(result["served"]["median_ms"] / result["embedded"]["median_ms"], 2)
    path = save("served_store", result)
    table = ["| `search_dense` query | median | p95 |", "|---|---|---|",
             f"| embedded store, in-process (baseline) | {result['embedded']['median_ms']:.2f} ms | "
             f"{result['embedded']['p95_ms']:.2f} ms |",
             f"| through the managed Chroma server | {result['served']['median_ms']:.2f} ms | "
             f"{result['served']['p95_ms']:.2f} ms |",
             f"\n{result['queries']} SciFact queries over {args.docs} abstracts, one phase after the other; served/embedded median "
             f"{result['ratio_median']:.2f}x. After another process indexed {result['added']} more abstracts, the "
             f"served reader's next queries ranked {fresh_served} of {result['added']} of them first for their own "
             f"titles (no restart). Written to {path.relative_to(REPO)}."]
    publish("served_store", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
