"""SciFact nDCG@10 on the milvus index engine (milvus-lite, embedded) against the default backend (Chroma + bm25s).

Usage: .venv/bin/python bench/scifact_milvus.py [--docs 1000] [--limit N]

pipelines.yaml's index and search pipelines with `store`/`sparse` replaced by one milvus resource.
Both backends search the same chunks and the same vectors: the default backend indexes the corpus through
the ingestion pipeline (``evaluate``), then its chunks, texts, metadata and vectors are copied into Milvus
with the index state (embedding twice costs hours on a small machine; ingestion through Milvus is what
tests/integration/test_milvus_store.py checks). What differs is the engine: exact search (milvus-lite has
no graph index) against Chroma's HNSW, and Milvus's BM25 (over ragline's terms: analyzer `ragline`, the
default) against bm25s.

``--docs N``: a sub-corpus of every document judged for the test queries plus the first others up to N
(0: the whole corpus). Every test query keeps all its relevant documents.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import time

from common import OUT, REPO, SCIFACT, save

from ragline.flows.contracts import Chunk
from ragline.flows.evaluation.retrieval import _run_and_score, eval_workspace, evaluate, in_workspace, load_beir
from ragline.flows.resources import clear_cache
from ragline.flows.spec.compile import load_project

PIPELINES = ["search_bm25", "search_dense", "search"]


def sub_corpus(docs: int) -> object:
    """A BEIR folder with the judged documents of the test split and the first others, ``docs`` in all."""
    if docs <= 0:
        return SCIFACT
    folder = OUT / f"scifact-sub-{docs}"
    judged = {row.split("\t")[1] for row in (SCIFACT / "qrels" / "test.tsv").read_text().splitlines()[1:]}
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    kept = []
    for line in (SCIFACT / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        if str(json.loads(line)["_id"]) in judged or len(kept) < docs - len(judged):
            kept.append(line)
    (folder / "corpus.jsonl").write_text("\n".join(kept) + "\n", encoding="utf-8")
    shutil.copy(SCIFACT / "queries.jsonl", folder / "queries.jsonl")
    shutil.copy(SCIFACT / "qrels" / "test.tsv", folder / "qrels" / "test.tsv")
    return folder


def milvus_project():
    """pipelines.yaml's index and search pipelines over one milvus resource: `store` becomes milvus, the
    `sparse` resource goes (the role binds to the one milvus resource), prompts beside it. Only the
    pipelines this measures are kept (the others need an LLM or train a model)."""
    import yaml

    spec = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    spec["resources"]["store"] = {"type": "milvus", "uri": ".ragline/milvus.db", "collection": "ragline"}
    del spec["resources"]["sparse"]
    spec["pipelines"] = {name: spec["pipelines"][name] for name in ["index", *PIPELINES]}
    for pipeline in spec["pipelines"].values():
        for step in pipeline["steps"]:
            if isinstance(step.get("uses"), list):
                step["uses"] = [name for name in step["uses"] if name != "sparse"]
    folder = OUT / "milvus-project"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipelines.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    if not (folder / "prompts").exists():
        (folder / "prompts").symlink_to(REPO / "prompts")
    return load_project(folder / "pipelines.yaml")


def copy_index(default, milvus) -> int:
    """The default backend's chunks and vectors into Milvus, in pages; the state is copied as a file."""
    store, target = default.resource("store"), milvus.resource("store")
    collection = store.existing_collection  # read-only: copying creates nothing in the source
    key = (collection.metadata or {}).get("ragline:embedder")
    model = (collection.metadata or {}).get("ragline:embedder_model", "")
    target.reset()
    copied, page = 0, 2000
    while True:
        got = collection.get(include=["embeddings", "documents", "metadatas"], limit=page, offset=copied)
        chunks = []
        for cid, vector, text, meta in zip(got["ids"], got["embeddings"], got["documents"], got["metadatas"]):
            meta = dict(meta)
            chunks.append(Chunk(chunk_id=cid, source_id=meta.pop("source_id"), title=meta.pop("title", ""),
                                ordinal=meta.pop("ordinal", 0), text=text, metadata=meta,
                                embedding=[float(x) for x in vector]))
        target.upsert(chunks)
        copied += len(chunks)
        if len(chunks) < page:
            break
    if key:
        target.record_embedder(key, model)
    target.sync(milvus.resource("state"))
    return copied


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=1000, help="sub-corpus size (0: all 5,183 documents)")
    parser.add_argument("--limit", type=int, default=None, help="first N test queries only")
    args = parser.parse_args()
    dataset = load_beir(sub_corpus(args.docs))
    project = load_project(REPO / "pipelines.yaml")
    rows = {}
    for pipeline in PIPELINES:
        rows[pipeline] = {"default": evaluate(project, dataset, pipeline, limit=args.limit)}
        print(f"default {pipeline:13} nDCG@10 {rows[pipeline]['default']['ndcg@10']:.4f}", flush=True)
    workspace = eval_workspace(project, dataset, "index")
    default = in_workspace(project, workspace)
    target = workspace.with_name(workspace.name + "-milvus")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(workspace, target, ignore=shutil.ignore_patterns("chroma*", "bm25*"))
    milvus = in_workspace(milvus_project(), target)
    started = time.perf_counter()
    copied = copy_index(default, milvus)
    print(f"copied {copied} chunks into milvus in {time.perf_counter() - started:.1f} s", flush=True)
    for pipeline in PIPELINES:
        rows[pipeline]["milvus"] = _run_and_score(milvus, dataset, pipeline, args.limit)
    clear_cache()
    print(f"\nSciFact test, {len(dataset.queries) if args.limit is None else args.limit} queries, "
          f"corpus {'full' if args.docs <= 0 else f'{args.docs} documents (all judged ones included)'}, "
          f"{copied} chunks\n")
    print("| pipeline | default nDCG@10 | milvus nDCG@10 | Δ | default R@100 | milvus R@100 | default ms/q | milvus ms/q |")
    print("|---|---|---|---|---|---|---|---|")
    for pipeline, row in rows.items():
        d, m = row["default"], row["milvus"]
        print(f"| {pipeline} | {d['ndcg@10']:.4f} | {m['ndcg@10']:.4f} | {m['ndcg@10'] - d['ndcg@10']:+.4f} | "
              f"{d['recall@100']:.4f} | {m['recall@100']:.4f} | {d['query_ms_mean']} | {m['query_ms_mean']} |")
    save("scifact_milvus", {"machine": platform.processor() or platform.machine(), "docs": args.docs,
                            "chunks": copied, "rows": {p: {k: {m: v for m, v in r.items() if m != "per_query"}
                                                           for k, r in row.items()} for p, row in rows.items()}})


if __name__ == "__main__":
    main()
