"""Chroma HNSW on real SciFact embeddings: recall@10 against exact search, add rate, query latency
with and without metadata filters, for Chroma's defaults and for ragline's settings.

Usage: .venv/bin/python bench/chroma_hnsw.py   (after bench/scifact_retrieval.py built the index)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, SCIFACT, save, summary_ms, publish

from ragline.flows.spec.compile import load_project
from ragline.flows.evaluation.retrieval import eval_workspace, load_beir
from ragline.flows.resources.stores.state import StoreMissing

CONFIGS = {
    "chroma default (M 16, ef_c 100, ef_s 100)": None,
    "ragline default (M 32, ef_c 200, ef_s 200)": {"max_neighbors": 32, "ef_construction": 200, "ef_search": 200},
    "M 32, ef_c 200, ef_s 100": {"max_neighbors": 32, "ef_construction": 200, "ef_search": 100},
    "M 32, ef_c 200, ef_s 400": {"max_neighbors": 32, "ef_construction": 200, "ef_search": 400},
}


def corpus_vectors(project, dataset):
    project = project.relocated(eval_workspace(project, dataset, "index"))
    try:  # read-only: a missing index is reported, not created empty
        got = project.resource("store").existing_collection.get(include=["embeddings", "metadatas"])
    except StoreMissing:
        got = {"ids": []}
    if not got["ids"]:
        raise SystemExit("no SciFact index yet: run bench/scifact_retrieval.py first")
    return got["ids"], np.asarray(got["embeddings"], dtype=np.float32), got["metadatas"]


def run_config(name, config, ids, vectors, metas, queries, exact, folder: Path) -> dict:
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=str(folder / name.split(" ")[0]), settings=Settings(anonymized_telemetry=False))
    configuration = {"hnsw": {"space": "cosine", **(config or {})}}
    col = client.create_collection("bench", embedding_function=None, configuration=configuration)
    start = time.perf_counter()
    for i in range(0, len(ids), 5000):
        col.add(ids=ids[i:i + 5000], embeddings=vectors[i:i + 5000], metadatas=metas[i:i + 5000])
    add_rate = len(ids) / (time.perf_counter() - start)
    index_of = {cid: i for i, cid in enumerate(ids)}
    recalls, plain, filtered = [], [], []
    for q, truth in zip(queries, exact):
        start = time.perf_counter()
        got = col.query(query_embeddings=q[None, :], n_results=10, include=[])["ids"][0]
        plain.append(time.perf_counter() - start)
        recalls.append(len({index_of[g] for g in got} & set(truth)) / 10)
        start = time.perf_counter()
        col.query(query_embeddings=q[None, :], n_results=10, where={"chunk": 0}, include=[])
        filtered.append(time.perf_counter() - start)
    return {"config": name, "recall@10": round(float(np.mean(recalls)), 4), "add_per_s": round(add_rate),
            "query": summary_ms(plain), "filtered_query": summary_ms(filtered)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    project = load_project(REPO / "pipelines.yaml")
    dataset = load_beir(SCIFACT)
    ids, vectors, metas = corpus_vectors(project, dataset)
    queries = project.resource("embedder").encode_queries(list(dataset.queries.values()))
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :10]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragline-hnsw-") as tmp:
        for i, (name, config) in enumerate(CONFIGS.items()):
            row = run_config(name, config, ids, vectors, metas, queries, exact, Path(tmp) / str(i))
            rows.append(row)
            print(row, flush=True)
    save("chroma_hnsw", {"vectors": len(ids), "queries": len(queries), "rows": rows})
    table = [f"{len(ids)} SciFact chunk vectors (384-d), {len(queries)} test queries, k = 10; "
             "filter: `{\"chunk\": 0}` (about half the vectors).", "",
             "| HNSW settings | recall@10 vs exact | add (vectors/s) | query median / p95 | filtered query median / p95 |",
             "|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['config']} | **{r['recall@10']:.4f}** | {r['add_per_s']} | "
                     f"{r['query']['median_ms']} / {r['query']['p95_ms']} ms | "
                     f"{r['filtered_query']['median_ms']} / {r['filtered_query']['p95_ms']} ms |")
    publish("hnsw", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
