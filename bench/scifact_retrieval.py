"""nDCG@10 and friends on BEIR SciFact for BM25, dense and hybrid, with torch and ONNX int8 embeddings.

Usage: .venv/bin/python bench/scifact_retrieval.py [--backends torch,onnx_int8] [--no-readme]
Indexes the full corpus once per embedding backend (incremental: a second run reuses it).
"""
from __future__ import annotations

import argparse
import json
import platform

from common import OUT, REPO, SCIFACT, save, publish

from ragline.flows.spec.compile import load_project
from ragline.flows.evaluation.retrieval import evaluate, load_beir
from ragline.flows.run.progress import IngestProgress

PIPELINES = [("search_bm25", "BM25 (bm25s, stemmed)"), ("search_dense", "dense (all-MiniLM-L6-v2)"),
             ("search", "hybrid RRF (BM25 + dense)")]
PUBLISHED = {"search_bm25": "0.665 (BM25, BEIR)", "search_dense": "0.645 (MTEB)", "search": "0.688 (BM25+CE, BEIR)"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="torch,onnx_int8")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    args = parser.parse_args()
    if args.table_only:
        rows = json.loads((OUT / "scifact_retrieval.json").read_text())["rows"]
        args.backends = ""
    else:
        rows = []
    dataset = load_beir(SCIFACT) if args.backends else None
    for backend in filter(None, args.backends.split(",")):
        project = load_project(REPO / "pipelines.yaml").with_resource("embedder", backend=backend)
        for pipeline, label in PIPELINES:
            if backend != "torch" and pipeline == "search_bm25":
                continue  # BM25 does not depend on the embedding backend
            progress = IngestProgress(f"indexing scifact ({backend})")
            result = evaluate(project, dataset, pipeline, progress=progress)
            progress.close()
            result.update(backend=backend, label=label)
            rows.append(result)
            print(f"{backend:10} {pipeline:13} nDCG@10 {result['ndcg@10']:.4f}  R@100 {result['recall@100']:.4f}  "
                  f"MRR@10 {result['mrr@10']:.4f}  index {result['index_seconds']} s  "
                  f"query {result['query_ms_mean']} ms", flush=True)
    if not args.table_only:
        save("scifact_retrieval", {"machine": platform.processor() or platform.machine(), "rows": rows})
    table = ["| pipeline | embeddings | nDCG@10 | Recall@100 | MRR@10 | MAP@10 | P@10 | published nDCG@10 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        embeddings = "—" if r["pipeline"] == "search_bm25" else r["backend"]
        table.append(f"| {r['label']} | {embeddings} | **{r['ndcg@10']:.3f}** | {r['recall@100']:.3f} | "
                     f"{r['mrr@10']:.3f} | {r['map@10']:.3f} | {r['p@10']:.3f} | {PUBLISHED[r['pipeline']]} |")
    publish("scifact", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
