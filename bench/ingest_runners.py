"""Ingestion with the thread runner versus a local Dask cluster (`runner:` in pipelines.yaml).

Usage: .venv/bin/python bench/ingest_runners.py [--limit 1000] [--workers 2] [--threads-per-worker 1]
Indexes the first N SciFact abstracts with the repository's `index` pipeline (same resources,
stages and parameters) twice, as Prefect flow runs in this process: once with `runner: {type: thread}`
and once with `runner: {type: dask, n_workers: W}` (a local cluster of worker processes that the run
starts and stops, so its wall time includes starting the workers and loading the model in each).
Checks that both runs built the same index (Chroma ids, texts and metadata, BM25 documents, the state
record) and prints the wall time of each and their ratio; writes bench/out/ingest_runners.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml
from common import REPO, save, subset_corpus, publish

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.harness import snapshot


def write_project(folder: Path, corpus: Path, runner: dict, batch_size: int | None) -> Path:
    """The repository's `index` pipeline and its resources, over ``corpus``, with ``runner``."""
    source = yaml.safe_load((REPO / "pipelines.yaml").read_text(encoding="utf-8"))
    index = dict(source["pipelines"]["index"], runner=runner)
    index.pop("schedule", None)
    if batch_size:
        index["batch_size"] = batch_size
    index["steps"] = [dict(s, **({"with": dict(s.get("with", {}), paths=[str(corpus)])} if s["task"] == "load" else {}))
                      for s in index["steps"]]
    used = {name for s in index["steps"] for name in (s.get("uses") or [])}
    resources = {name: spec for name, spec in source["resources"].items() if name in used}
    folder.mkdir(parents=True)
    path = folder / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"settings": {"prompts_dir": str(REPO / "prompts")}, "resources": resources,
                                    "pipelines": {"index": index}}, sort_keys=False), encoding="utf-8")
    return path


def measure(path: Path) -> dict:
    clear_cache()  # each run opens its own stores (and, for the thread runner, loads the model) like a new process
    pipeline = load_project(path).pipeline("index")
    start = time.perf_counter()
    report = engine.run(pipeline)
    seconds = time.perf_counter() - start
    assert not report.failures, report.failures
    return {"seconds": round(seconds, 2), "documents": report.added, "chunks": report.chunks_written,
            "chunks_per_s": round(report.chunks_written / seconds, 2)}


def warm_up() -> None:
    from prefect import flow

    @flow(name="warm-up")
    def nothing() -> None:
        return None

    nothing()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=1000, help="SciFact documents (0: all 5,183)")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=0, help="documents per batch (default: the pipeline's)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the Dask workers
    runners = {"thread": {"type": "thread"},
               "dask": {"type": "dask", "n_workers": args.workers, "threads_per_worker": args.threads_per_worker}}
    with tempfile.TemporaryDirectory(prefix="ragline-bench-") as tmp:
        corpus = subset_corpus(args.limit, Path(tmp) / "data")
        warm_up()  # start Prefect's temporary server before any timing
        rows, snapshots = {}, {}
        for name, runner in runners.items():
            path = write_project(Path(tmp) / name, corpus, runner, args.batch_size)
            rows[name] = dict(measure(path), runner=runner)
            snapshots[name] = snapshot(path)
            print(name, rows[name], flush=True)
    same = snapshots["thread"] == snapshots["dask"]
    ratio = round(rows["dask"]["seconds"] / rows["thread"]["seconds"], 3)
    payload = {"docs": rows["thread"]["documents"], "limit": args.limit, "cpu_count": os.cpu_count(),
               "same_index": same, "chroma_entries": len(snapshots["thread"]["chroma"]),
               "dask_vs_thread_wall_time": ratio, "rows": rows}
    out = save("ingest_runners", payload)
    table = ["| runner | documents | chunks | wall time | chunks/s |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        table.append(f"| {name} | {r['documents']} | {r['chunks']} | {r['seconds']} s | {r['chunks_per_s']} |")
    table.append(f"\n{args.workers}-worker local Dask cluster / thread runner wall time: {ratio}x "
                 f"({os.cpu_count()} cores; the cluster's start-up and per-worker model loading included); "
                 f"same index: {same}.")
    print(f"written to {out}")
    publish("runners", table, readme=not args.no_readme)
    if not same:
        raise SystemExit("the two runners built different indexes")


if __name__ == "__main__":
    main()
