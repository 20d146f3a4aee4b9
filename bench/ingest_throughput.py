"""Ingestion throughput: the whole index pipeline versus the model's raw `encode` over the same chunks.

Usage: .venv/bin/python bench/ingest_throughput.py [--docs 1000] [--backends torch,onnx_int8]
Prints, per embedding backend: raw encode passages/s, pipeline chunks/s (a real Prefect flow run:
load, convert, chunk, embed, write to Chroma and the state, rebuild BM25), their ratio, and the
time of a re-run on the unchanged corpus as a share of the full run. All measured in one process.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import REPO, save, subset_corpus, publish

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.tasks.ingest.chunk import chunk
from ragline.tasks.ingest.convert import convert
from ragline.tasks.ingest.load import load


def pipeline_chunks(project, corpus: Path) -> list[str]:
    """The texts the pipeline will embed, produced by the same stages with the same params."""
    index = project.pipeline("index")
    params = {s.stage.name: s.params for s in index.steps}
    ctx = StepContext(pipeline="bench", step_id="bench", base_dir=str(project.base_dir))
    given = params["load"]  # validated again: ``paths`` entries are roots, not strings (model_copy would keep str)
    docs = load.fn(params=type(given).model_validate({**given.model_dump(), "paths": [str(corpus)]}), ctx=ctx)
    docs = convert.fn(documents=docs, params=params["convert"], ctx=ctx)
    return [c.text for c in chunk.fn(documents=docs, params=params["chunk"], ctx=ctx,
                                     embedder=project.resource("embedder"))]


def measure(backend: str, corpus: Path, workdir: Path, orchestrate: bool) -> dict:
    project = load_project(REPO / "pipelines.yaml").with_resource("embedder", backend=backend).relocated(
        workdir / backend)
    embedder = project.resource("embedder")
    embedder.encode_documents(["warm-up: load the model (and build the ONNX export) before timing"])
    texts = pipeline_chunks(project, corpus)
    start = time.perf_counter()
    embedder.encode_documents(texts)
    raw_seconds = time.perf_counter() - start
    index = project.pipeline("index").with_overrides({"load": {"paths": [str(corpus)]}})
    start = time.perf_counter()
    report = engine.run(index, orchestrate=orchestrate)
    full_seconds = time.perf_counter() - start
    assert report.chunks_written == len(texts), (report.chunks_written, len(texts))
    start = time.perf_counter()
    rerun = engine.run(index, orchestrate=orchestrate)
    rerun_seconds = time.perf_counter() - start
    assert rerun.unchanged == report.added and rerun.chunks_written == 0
    raw_rate, pipeline_rate = len(texts) / raw_seconds, len(texts) / full_seconds
    return {"backend": backend, "documents": report.added, "chunks": len(texts),
            "raw_encode_seconds": round(raw_seconds, 2), "raw_passages_per_s": round(raw_rate, 2),
            "pipeline_seconds": round(full_seconds, 2), "pipeline_chunks_per_s": round(pipeline_rate, 2),
            "pipeline_vs_raw": round(pipeline_rate / raw_rate, 3),
            "rerun_seconds": round(rerun_seconds, 3), "rerun_share_of_full": round(rerun_seconds / full_seconds, 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=1000, help="SciFact documents (0: all 5,183)")
    parser.add_argument("--backends", default="torch,onnx_int8")
    parser.add_argument("--no-prefect", action="store_true", help="run the pipeline without Prefect")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ragline-bench-") as tmp:
        corpus = subset_corpus(args.docs, Path(tmp) / "data")
        if not args.no_prefect:  # start Prefect's temporary server before any timing
            engine.run(load_project(REPO / "pipelines.yaml").pipeline("search_bm25"), {"query": "warm-up"})
        rows = []
        for backend in args.backends.split(","):
            row = measure(backend, corpus, Path(tmp), orchestrate=not args.no_prefect)
            rows.append(row)
            print(row, flush=True)
    torch_row = next((r for r in rows if r["backend"] == "torch"), rows[0])
    for r in rows:
        r["speedup_vs_torch_pipeline"] = round(torch_row["pipeline_seconds"] / r["pipeline_seconds"], 2)
    save("ingest_throughput", {"docs": args.docs, "prefect": not args.no_prefect, "rows": rows})
    table = ["| embeddings | chunks | raw encode (chunks/s) | pipeline (chunks/s) | pipeline / raw | "
             "re-run unchanged | re-run / full run | pipeline speed-up vs torch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['backend']} | {r['chunks']} | {r['raw_passages_per_s']} | {r['pipeline_chunks_per_s']} | "
                     f"**{100 * r['pipeline_vs_raw']:.1f} %** | {r['rerun_seconds']} s | "
                     f"**{100 * r['rerun_share_of_full']:.2f} %** | {r['speedup_vs_torch_pipeline']}x |")
    publish("throughput", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
