"""Retrieval-side techniques on BEIR SciFact test, each alone against the default hybrid `search`:
pseudo-relevance feedback (RM3, `expand_prf`) for BM25, as a second dense query and in the hybrid,
query expansion with related terms from the corpus's co-occurrences (`expand_terms` mode corpus)
for BM25 and in the hybrid, and context expansion (`expand_context`, small-to-big).

Usage: .venv/bin/python bench/techniques.py [--no-readme] [--table-only] [--index-only] [--limit N]

The shipped pipelines.yaml plus the configurations below go into bench/out/techniques/pipelines.yaml;
the corpus is indexed once in that folder's evaluation workspace (what `ragline eval` uses) and every
configuration searches the same index. Context expansion cannot move document-level nDCG or recall
(it changes the text of hits, not their order): its row reports how much of each relevant abstract
the top-10 passages hold, before and after, and the time it adds. Query2doc (`rewrite` mode hyde with
`keyword: true`) and `expand_terms` mode llm need an LLM writing for every query and are not measured here.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time

from common import OUT, REPO, SCIFACT, publish, save

from ragline.flows.evaluation.retrieval import (BeirDataset, document_id, eval_workspace, evaluate, in_workspace,
                                               load_beir)
from ragline.flows.run import engine
from ragline.flows.run.progress import IngestProgress
from ragline.flows.spec.compile import load_project

WORK = OUT / "techniques"
TERMS = "{id: terms, task: expand_terms, with: {mode: corpus, docs: 10, terms: NT, weight: W}}"
TERM_SETTINGS = {"": (20, 0.2), "_5": (5, 0.3), "_w05": (5, 0.5)}  # pipeline suffix -> terms, weight (first: default)
PRF = "{id: prf, task: expand_prf, with: {docs: 10, terms: 10, query_weight: QW, dense: DENSE}}"
CONFIGS = """
  t_bm25_rm3:
    kind: query
    steps:
      - {id: first,  task: retrieve_sparse, with: {k: 10}}
      - {id: top,    task: fuse, with: {top_k: 10}}
      - PRF_BM25
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, with: {top_k: 100}}
  t_dense_prf:
    kind: query
    steps:
      - {id: first, task: retrieve_dense, with: {k: 10}}
      - {id: top,   task: fuse, with: {top_k: 10}}
      - PRF_DENSE
      - {id: dense, task: retrieve_dense, with: {k: 100}}
      - {id: fuse,  task: fuse, with: {top_k: 100}}
  t_hybrid_rm3:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: first,  task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: top,    task: fuse, after: [dense, first], with: {top_k: 10}}
      - PRF_BM25
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 100}}
  t_hybrid_prf:
    kind: query
    steps:
      - {id: first_dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: first_sparse, task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: top,    task: fuse, after: [first_dense, first_sparse], with: {top_k: 10}}
      - PRF_DENSE
      - {id: dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [prf]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 100}}
  t_bm25_terms:
    kind: query
    steps:
      - TERMS
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, with: {top_k: 100}}
  t_hybrid_terms:
    kind: query
    steps:
      - TERMS
      - {id: dense,  task: retrieve_dense,  with: {k: 100}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [terms]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  t_context:
    kind: query
    steps:
      - {id: dense,   task: retrieve_dense,  with: {k: 100}}
      - {id: sparse,  task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: fuse,    task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
      - {id: context, task: expand_context, with: {neighbours: 1, max_tokens: 512, top_k: 10}}
"""
ROWS = [  # pipeline, label, technique
    ("search", "hybrid RRF (default `search`)", "—"),
    ("search_bm25", "BM25 alone", "—"),
    ("t_bm25_rm3", "BM25 + RM3 (10 docs, 10 terms, λ 0.5)", "PRF"),
    ("t_bm25_rm3_07", "BM25 + RM3 (λ 0.7)", "PRF"),
    ("search_dense", "dense alone", "—"),
    ("t_dense_prf", "dense + PRF second dense query", "PRF"),
    ("t_hybrid_rm3", "hybrid, BM25 side RM3 (PRF from the fused top 10)", "PRF"),
    ("t_hybrid_prf", "hybrid, RM3 BM25 + PRF dense query", "PRF"),
    ("t_bm25_terms", "BM25 + related terms (LCA co-occurrence: 10 docs, 20 terms, weight 0.2)", "expansion"),
    ("t_bm25_terms_5", "BM25 + related terms (5 terms, weight 0.3)", "expansion"),
    ("t_bm25_terms_w05", "BM25 + related terms (5 terms, weight 0.5)", "expansion"),
    ("t_hybrid_terms", "hybrid, BM25 side + related terms (20 terms, weight 0.2)", "expansion"),
    ("t_context", "hybrid + context expansion (±1 chunk, 512 tokens)", "small-to-big"),
]


def pipelines_text() -> str:
    configs = CONFIGS.replace("PRF_BM25", PRF.replace("QW", "0.5").replace("DENSE", "false")) \
        .replace("PRF_DENSE", PRF.replace("QW", "0.5").replace("DENSE", "true"))
    variant = configs.split("  t_dense_prf:")[0].replace("t_bm25_rm3:", "t_bm25_rm3_07:").replace(
        "query_weight: 0.5", "query_weight: 0.7")
    terms = configs[configs.index("  t_bm25_terms:"):configs.index("  t_hybrid_terms:")]
    variant += "".join(terms.replace("t_bm25_terms:", f"t_bm25_terms{suffix}:").replace(
        "TERMS", TERMS.replace("NT", str(n)).replace("W", str(w))) for suffix, (n, w) in TERM_SETTINGS.items()
        if suffix)
    configs = configs.replace("TERMS", TERMS.replace("NT", "20").replace("W", "0.2"))
    shipped = (REPO / "pipelines.yaml").read_text()
    return shipped.replace("\npipelines:\n", "\npipelines:\n" + configs + variant, 1)


def sub_corpus(others: int) -> BeirDataset:
    """SciFact test with every judged abstract plus the first ``others`` of the rest (0: the whole
    corpus): on a shared 2-core machine the full corpus takes most of an hour to embed."""
    dataset = load_beir(SCIFACT)
    if others <= 0:
        return dataset
    judged = {doc for docs in dataset.qrels.values() for doc in docs}
    folder = WORK / f"corpus-{others}"
    folder.mkdir(parents=True, exist_ok=True)
    kept = 0
    with open(dataset.corpus, encoding="utf-8") as src, open(folder / "corpus.jsonl", "w", encoding="utf-8") as dst:
        for line in src:
            judged_doc = str(json.loads(line)["_id"]) in judged
            if judged_doc or kept < others:
                kept += not judged_doc
                dst.write(line)
    return BeirDataset(dataset.name, folder / "corpus.jsonl", dataset.queries, dataset.qrels)


def workspace_project():
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "pipelines.yaml").write_text(pipelines_text())
    if not (WORK / "prompts").exists():
        (WORK / "prompts").symlink_to(REPO / "prompts")
    return load_project(WORK / "pipelines.yaml")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 20]


def context_coverage(project, dataset, limit: int | None) -> dict:
    """Per relevant abstract found in the top 10: the share of its sentences its best passage holds,
    without and with context expansion; and the time the stage adds per query."""
    abstracts = {}
    with open(dataset.corpus, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            abstracts[str(record["_id"])] = sentences(record["text"])
    local = in_workspace(project, eval_workspace(project, dataset, "index"))
    pipeline = local.pipeline("t_context")
    before, after, grown, tokens_before, tokens_after, added = [], [], [], [], [], []
    for qid, text in list(dataset.queries.items())[:limit]:
        started = time.perf_counter()
        plain = engine.run(local.pipeline("search"), {"query": text}, orchestrate=False)[:10]
        middle = time.perf_counter()
        expanded = engine.run(pipeline, {"query": text}, orchestrate=False)[:10]
        added.append((time.perf_counter() - middle) - (middle - started))
        for passages, shares, lengths in ((plain, before, tokens_before), (expanded, after, tokens_after)):
            lengths.extend(len(p.text.split()) for p in passages)
            for doc in dataset.qrels[qid]:
                best = next((p for p in passages if document_id(p) == doc), None)
                if best is not None and abstracts.get(doc):
                    shares.append(sum(s in best.text for s in abstracts[doc]) / len(abstracts[doc]))
        grown.extend("context_chunks" in p.metadata for p in expanded)
    return {"coverage_before": round(statistics.mean(before), 4), "coverage_after": round(statistics.mean(after), 4),
            "hits_found": len(before), "expanded_share": round(sum(grown) / max(1, len(grown)), 4),
            "words_before": round(statistics.mean(tokens_before), 1),
            "words_after": round(statistics.mean(tokens_after), 1),
            "added_ms_median": round(1000 * statistics.median(added), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    parser.add_argument("--index-only", action="store_true", help="build the shared index and stop")
    parser.add_argument("--limit", type=int, default=None, help="first N test queries (default: all 300)")
    parser.add_argument("--others", type=int, default=0, help="index the judged abstracts plus the first N "
                                                              "others only (default 0: the whole corpus)")
    args = parser.parse_args()
    if args.table_only:
        result = json.loads((OUT / "techniques.json").read_text())
    else:
        project = workspace_project()
        dataset = sub_corpus(args.others)
        progress = IngestProgress("indexing scifact")
        rows = [{**evaluate(project, dataset, "search", progress=progress, limit=args.limit),
                 "label": ROWS[0][1], "technique": ROWS[0][2]}]
        progress.close()
        if args.index_only:
            return
        for pipeline, label, technique in ROWS[1:]:
            result = evaluate(project, dataset, pipeline, limit=args.limit)
            rows.append({**result, "label": label, "technique": technique})
            print(f"{pipeline:16} nDCG@10 {result['ndcg@10']:.4f}  R@100 {result['recall@100']:.4f}  "
                  f"query {result['query_ms_mean']} ms", flush=True)
        corpus = sum(1 for _ in open(dataset.corpus, encoding="utf-8"))
        result = {"machine": platform.processor() or platform.machine(), "rows": rows, "corpus": corpus,
                  "context": context_coverage(project, dataset, args.limit)}
        save("techniques", result)
    publish("techniques", table(result), readme=not args.no_readme)


def table(result: dict) -> list[str]:
    base = result["rows"][0]
    lines = [f"SciFact test, 300 queries, over {result.get('corpus', 5183):,} abstracts"
             + (" (every judged abstract plus the first others of the corpus: a sub-corpus, so the figures are "
                "higher than the full corpus's; compare the rows with each other)" if result.get("corpus", 5183) < 5183
                else "") + ":", "",
             "| retrieval | technique | nDCG@10 | Δ vs default | Recall@100 | Δ vs default | ms/query |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['label']} | {r['technique']} | **{r['ndcg@10']:.3f}** | "
                     f"{r['ndcg@10'] - base['ndcg@10']:+.3f} | {r['recall@100']:.3f} | "
                     f"{r['recall@100'] - base['recall@100']:+.3f} | {r['query_ms_mean']:.0f} |")
    c = result["context"]
    lines += ["", f"Context expansion (±1 chunk, 512 tokens) on the same queries: {c['expanded_share']:.0%} of the "
                  f"top-10 hits grew; a relevant abstract's best top-10 passage holds {c['coverage_before']:.0%} of "
                  f"its sentences before and {c['coverage_after']:.0%} after ({c['hits_found']} relevant hits); "
                  f"words per top-10 passage {c['words_before']:.0f} → {c['words_after']:.0f}; "
                  f"{c['added_ms_median']:.0f} ms added per query (median). The first row's ms/query includes "
                  f"loading the models (it runs first); the others run warm."]
    return lines


if __name__ == "__main__":
    main()
