"""Is ONNX int8 good enough to be the CPU default for an embedder? torch and onnx_int8 in the same run
(issue 38.2), for the packaged embedder (all-MiniLM-L6-v2, the only one MODELS.md ships):

- SciFact nDCG@10, dense and hybrid (the full corpus, indexed once per backend; --skip-scifact leaves it out);
- answer accuracy of the extractive ask (`ask_extractive`, no LLM): right, wrong-but-answered and
  refused, on the own QA set, the held-out company set and RGB en_fact (test split; --skip-rgb);
- the top-10 agreement of the two backends on every judged SciFact test query (300) ranked over the
  abstracts judged for them (~340; cheap, so it runs with --skip-scifact too);
- ingestion time (the own and company sets, and SciFact when run) and one query's encode latency.

The rule (docs/results.md, "ONNX int8 as the CPU default"): |Δ nDCG@10| <= 0.005 for dense and hybrid,
and the same right / wrong / refused counts on every QA set. The verdict is printed per model.

Usage: .venv/bin/python bench/onnx_default.py [--skip-scifact] [--skip-rgb]
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import time

from answer_quality import COMPANY, OWN, company_questions, document_set, own_questions, rgb_sets
from common import OUT, REPO, SCIFACT, save

import numpy as np

from ragline.flows.evaluation.retrieval import evaluate, load_beir
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.flows.spec.compile import load_project

BACKENDS = ("torch", "onnx_int8")
MAX_NDCG_DELTA = 0.005
ANSWER_PIPELINE = "ask_extractive"
MODEL = "all-MiniLM-L6-v2"


def query_latency_ms(model: str, backend: str, repeats: int = 50) -> float:
    """Median time to encode one short query with the backend's model (its own path, not the lean encoder)."""
    embedder = Embedder(EmbedderSpec(type="sentence_transformer", model=model, backend=backend))
    embedder.encode_documents(["warm-up"])
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        embedder.encode_documents([f"does vitamin D supplementation reduce fracture risk {i}"])
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def judged_scifact() -> tuple[list[str], list[str]]:
    """The 300 test queries and the texts of the abstracts judged for them."""
    with open(SCIFACT / "qrels" / "test.tsv", newline="", encoding="utf-8") as handle:
        judged = {row[1] for row in list(csv.reader(handle, delimiter="\t"))[1:]}
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        docs = [f"{d['title']} {d['text']}" for d in map(json.loads, handle) if d["_id"] in judged]
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
        queries = [q["text"] for q in map(json.loads, handle)][:300]
    return queries, docs


def top10_agreement(model: str) -> dict:
    """Share of queries whose top-10 (in order, and as a set) and top-1 are the same with either backend
    embedding both the queries and the documents, and the mean share of the top-10 both hold."""
    queries, docs = judged_scifact()
    tops = {}
    for backend in BACKENDS:
        embedder = Embedder(EmbedderSpec(type="sentence_transformer", model=model, backend=backend))
        scores = embedder.encode_documents(queries) @ embedder.encode_documents(docs).T
        tops[backend] = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    pairs = list(zip(tops["torch"], tops["onnx_int8"]))
    return {"queries": len(queries), "docs": len(docs),
            "same_order": round(float(np.mean([list(a) == list(b) for a, b in pairs])), 3),
            "same_set": round(float(np.mean([set(a) == set(b) for a, b in pairs])), 3),
            "overlap": round(float(np.mean([len(set(a) & set(b)) / 10 for a, b in pairs])), 3),
            "same_top1": round(float(np.mean([a[0] == b[0] for a, b in pairs])), 3)}


def counts(figures: dict) -> dict:
    """Right, wrong and refused as question counts (what the rule compares)."""
    rows = figures["rows"]
    return {"right": sum(r["right"] and not r["refused"] for r in rows),
            "wrong": sum(not r["right"] and not r["refused"] for r in rows),
            "refused": sum(r["refused"] for r in rows), "questions": len(rows),
            "outcomes": {r["question"]: outcome(r) for r in rows}}


def outcome(row: dict) -> str:
    return "refused" if row["refused"] else "right" if row["right"] else "wrong"


def answer_sets(backend: str, skip_rgb: bool) -> dict:
    """Per QA set: the counts and the indexing seconds of the document sets."""
    workdir = OUT / "onnx_default" / backend
    results = {}
    for name, docs, questions in (("own", OWN / "docs", own_questions()), ("company", COMPANY, company_questions())):
        started = time.perf_counter()
        figures = document_set(name, docs, questions, [ANSWER_PIPELINE], workdir, backend=backend)[ANSWER_PIPELINE]
        results[name] = {**counts(figures), "seconds": round(time.perf_counter() - started, 1)}
    if not skip_rgb:
        for corpus, by_pipeline in rgb_sets([ANSWER_PIPELINE], workdir, "test", backend=backend).items():
            results[f"rgb_{corpus}"] = counts(by_pipeline[ANSWER_PIPELINE])
    return results


def scifact(model: str, backend: str) -> dict:
    project = load_project(REPO / "pipelines.yaml", tuned=False).with_resource("embedder", model=model, backend=backend)
    dataset = load_beir(SCIFACT)
    figures = {}
    for pipeline in ("search_dense", "search"):
        result = evaluate(project, dataset, pipeline)
        figures[pipeline] = {"ndcg@10": result["ndcg@10"], "index_seconds": result["index_seconds"]}
    return figures


def verdict(by_backend: dict) -> tuple[bool, list[str]]:
    """Whether onnx_int8 holds against torch, with the reasons it does not."""
    torch, onnx = by_backend["torch"], by_backend["onnx_int8"]
    reasons = []
    for pipeline, figures in torch.get("scifact", {}).items():
        delta = onnx["scifact"][pipeline]["ndcg@10"] - figures["ndcg@10"]
        if abs(delta) > MAX_NDCG_DELTA:
            reasons.append(f"SciFact {pipeline} nDCG@10 moved {delta:+.4f}")
    for name, figures in torch["answers"].items():
        theirs = onnx["answers"][name]
        changed = [k for k in ("right", "wrong", "refused") if figures[k] != theirs[k]]
        if changed:
            flipped = [f"{q!r} {was} -> {theirs['outcomes'][q]}" for q, was in figures["outcomes"].items()
                       if theirs["outcomes"].get(q) != was]
            reasons.append(f"{name}: " + ", ".join(f"{k} {figures[k]} -> {theirs[k]}" for k in changed)
                           + f" ({'; '.join(flipped)})")
    return not reasons, reasons


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-scifact", action="store_true")
    parser.add_argument("--skip-rgb", action="store_true")
    args = parser.parse_args()
    report = {"machine": platform.processor() or platform.machine(), "models": {}}
    for model in (MODEL,):  # the QA sets index with pipelines.yaml's embedder: this model
        by_backend = {}
        for backend in BACKENDS:
            figures = {"query_ms": query_latency_ms(model, backend), "answers": answer_sets(backend, args.skip_rgb)}
            if not args.skip_scifact:
                figures["scifact"] = scifact(model, backend)
            by_backend[backend] = figures
            shown = {k: v for k, v in figures.items() if k != "answers"}
            shown["answers"] = {n: {k: v for k, v in f.items() if k != "outcomes"} for n, f in figures["answers"].items()}
            print(f"{model} {backend}: {shown}", flush=True)
        agreement = top10_agreement(model)
        print(f"{model}: SciFact top-10 agreement {agreement}", flush=True)
        holds, reasons = verdict(by_backend)
        report["models"][model] = {**by_backend, "top10": agreement, "holds": holds, "reasons": reasons}
        print(f"{model}: onnx_int8 {'HOLDS' if holds else 'does NOT hold'} as the CPU default"
              + ("" if holds else ": " + "; ".join(reasons)), flush=True)
    save("onnx_default", report)


if __name__ == "__main__":
    main()
