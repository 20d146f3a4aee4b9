"""Query expansion decided without labels: `ragline tune` turning `expand_prf` (RM3) and `expand_terms`
(related terms from the corpus's co-occurrences) on or off, against the default hybrid `search`.

Usage: .venv/bin/python bench/expansion_tuning.py [--others 800] [--no-rgb] [--no-readme] [--table-only]

Per collection (SciFact test over a sub-corpus: every judged abstract plus the first ``--others``;
RGB's passages, built as in bench/tuning.py), on one index in a private workspace:
1. each technique alone, forced on, with the stage's settings: BM25 + RM3 and the hybrid with RM3 on
   its BM25 side (feedback from the fused top 10), BM25 + related terms and the hybrid with them at
   the old defaults (20 terms, weight 0.2: picked on SciFact test) and at the new ones (the best of
   the tuner's grid on SciFact's pseudo-queries: no labels);
2. the shipped `tune` job's tuner on 300 pseudo-queries (inverse cloze + keywords) over `search`,
   `x_terms` and `x_prf` (the expansion steps there are `enabled: false`; the tuner turns them on only
   for a significant gain on the pseudo-queries), then those pipelines with the overlay it wrote.
Every row: nDCG@10 and Recall@100 on the real queries, and the paired 95 % bootstrap interval
(2,000 resamples over queries, seed 0) of its difference to the default `search`.
Query2doc (`rewrite` mode hyde with `keyword: true`) and `expand_terms` mode llm need the LLM for
every query: not measured here (no vLLM on this CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import time

from common import OUT, REPO, SCIFACT, publish, save
from techniques import sub_corpus
from tuning import interval, per_query, rgb_as_beir

from ragline.flows.evaluation.retrieval import eval_workspace, load_beir, score, to_run
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

WORK = OUT / "expansion_tuning"
OLD_TERMS = {"terms": 20, "weight": 0.2}
EXTRA = """
  x_bm25_prf:
    kind: query
    steps:
      - {id: first,  task: retrieve_sparse, with: {k: 10}}
      - {id: top,    task: fuse, with: {top_k: 10}}
      - {id: prf,    task: expand_prf, with: {enabled: false, dense: false}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, with: {top_k: 100}}
  x_prf:
    kind: query
    steps:
      - {id: first_dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: first_sparse, task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: top,    task: fuse, after: [first_dense, first_sparse], with: {top_k: 10}}
      - {id: prf,    task: expand_prf, with: {enabled: false, dense: false}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [prf]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  x_bm25_terms:
    kind: query
    steps:
      - {id: terms,  task: expand_terms, with: {enabled: false}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, with: {top_k: 100}}
  x_terms:
    kind: query
    steps:
      - {id: terms,  task: expand_terms, with: {enabled: false}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [terms]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  x_tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries, with: {n: 300, seed: 0, strategies: [inverse_cloze, keywords]}}
      - {id: tune,  task: tune_retrieval, with: {pipelines: [search, x_terms, x_prf]}}
"""


def project_for(name: str):
    folder = WORK / name
    folder.mkdir(parents=True, exist_ok=True)
    shipped = (REPO / "pipelines.yaml").read_text()
    (folder / "pipelines.yaml").write_text(shipped.replace("\npipelines:\n", "\npipelines:\n" + EXTRA, 1))
    if not (folder / "prompts").exists():
        (folder / "prompts").symlink_to(REPO / "prompts")
    return folder / "pipelines.yaml"


def run_rows(project, dataset, rows: list[tuple[str, str, dict]]) -> list[dict]:
    """Each (label, pipeline, step overrides) run on every query, with its per-query figures."""
    project.resource("sparse").sync(project.resource("state"))  # BM25 as this project sets it
    out = []
    for label, pipeline, overrides in rows:
        compiled = project.pipeline(pipeline).with_overrides(overrides) if overrides else project.pipeline(pipeline)
        started = time.perf_counter()
        run_ = {q: to_run(engine.run(compiled, {"query": text}, orchestrate=False))
                for q, text in dataset.queries.items()}
        ms = 1000 * (time.perf_counter() - started) / len(dataset.queries)
        figures = score(run_, dataset.qrels)
        out.append({"label": label, "pipeline": pipeline, "overrides": overrides, **figures,
                    "per_query": per_query(run_, dataset.qrels), "query_ms": round(ms, 1)})
        print(f"  {label:60} nDCG@10 {figures['ndcg@10']:.4f}  R@100 {figures['recall@100']:.4f}  {ms:.0f} ms",
              flush=True)
    return out


def measure(name: str, dataset, new_terms: dict | None, earlier: dict | None = None) -> dict:
    """Index, the forced rows, the tuner, the tuned rows, the paired intervals against `search`.
    ``earlier``: a previous run's result, whose forced rows are kept (only the default row, the
    tuner and the tuned rows run again)."""
    file = project_for(name)
    plain = load_project(file, tuned=False)
    workspace = eval_workspace(plain, dataset, "index")
    plain = plain.relocated(workspace)
    started = time.perf_counter()
    report = engine.run(plain.pipeline("index").with_overrides({"load": {"paths": [str(dataset.corpus.resolve())]}}),
                        orchestrate=False)
    print(f"{name}: index {report.summary()} in {time.perf_counter() - started:.0f} s", flush=True)
    (workspace / "pipelines.tuned.yaml").unlink(missing_ok=True)  # an earlier run's choice must not leak in
    forced = [
        ("BM25 alone", "search_bm25", {}),
        ("BM25 + RM3 (10 docs, 10 terms, λ 0.5)", "x_bm25_prf", {"prf": {"enabled": True}}),
        ("hybrid, BM25 side RM3 (feedback: fused top 10)", "x_prf", {"prf": {"enabled": True}}),
        (f"BM25 + related terms, old defaults ({OLD_TERMS['terms']}, {OLD_TERMS['weight']:g})", "x_bm25_terms",
         {"terms": {"enabled": True, **OLD_TERMS}}),
        (f"hybrid + related terms, old defaults ({OLD_TERMS['terms']}, {OLD_TERMS['weight']:g})", "x_terms",
         {"terms": {"enabled": True, **OLD_TERMS}}),
    ]
    kept = {r["label"]: r for r in (earlier or {}).get("rows", [])}
    rows = run_rows(plain, dataset, [("hybrid RRF (default `search`)", "search", {})])
    rows += [kept[label] for label, _, _ in forced if label in kept]
    rows += run_rows(plain, dataset, [row for row in forced if row[0] not in kept])
    started = time.perf_counter()
    tuning = engine.run(plain.pipeline("x_tune"), orchestrate=False)
    wall = time.perf_counter() - started
    print(f"{name}: tune {wall:.0f} s: {tuning.chosen.name}", flush=True)
    for stage, entry in tuning.expansions.items():
        print(f"  {stage}: {entry['reason']}; per strategy {entry.get('by_strategy')}", flush=True)
    terms_entry = tuning.expansions.get("expand_terms", {})
    pseudo_best = terms_entry.get("candidates", [{}])[0].get("fields")
    if new_terms is None:
        new_terms = {k: pseudo_best[k] for k in ("terms", "weight")} if pseudo_best else dict(OLD_TERMS)
    tuned = load_project(file, tuned=True).relocated(workspace)
    rows += run_rows(tuned, dataset, [
        ("tuned `search` (fusion and BM25 only)", "search", {}),
        ("tuned, with `expand_terms` as the tuner set it", "x_terms", {}),
        ("tuned, with `expand_prf` as the tuner set it", "x_prf", {}),
    ])
    fresh = [(f"BM25 + related terms, new defaults ({new_terms['terms']}, {new_terms['weight']:g})", "x_bm25_terms",
              {"terms": {"enabled": True, **new_terms}}),
             (f"hybrid + related terms, new defaults ({new_terms['terms']}, {new_terms['weight']:g})", "x_terms",
              {"terms": {"enabled": True, **new_terms}})]
    rows += [kept[label] for label, _, _ in fresh if label in kept]
    rows += run_rows(plain, dataset, [row for row in fresh if row[0] not in kept])
    base = rows[0]["per_query"]
    for row in rows:
        if "per_query" in row:  # kept rows carry their intervals against the same default
            row["versus_default"] = {m: interval([a - b for a, b in zip(row["per_query"][m], base[m])])
                                     for m in ("ndcg@10", "recall@100")}
            del row["per_query"]
    documents = sum(1 for line in open(dataset.corpus, encoding="utf-8") if line.strip())
    return {"documents": documents, "queries": len(dataset.queries), "rows": rows, "new_terms": new_terms,
            "pseudo_best_terms": pseudo_best, "tune_seconds": round(wall, 1), "tune_timings": tuning.timings,
            "chosen": tuning.chosen.name,
            "fusion_reason": tuning.reason,
            "expansions": {s: {k: v for k, v in e.items() if k != "candidates"} | {
                "candidates": e.get("candidates", [])[:5]} for s, e in tuning.expansions.items()},
            "overlay_changes": tuned.overlay.changes if tuned.overlay is not None else []}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--others", type=int, default=800, help="SciFact: the judged abstracts plus the first N "
                                                                "others (0: all 5,183)")
    parser.add_argument("--no-rgb", action="store_true")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep the last run's forced rows; run the default, "
                                                             "the tuner and the tuned rows again")
    args = parser.parse_args()
    if args.table_only:
        result = json.loads((OUT / "expansion_tuning.json").read_text())
    else:
        earlier = json.loads((OUT / "expansion_tuning.json").read_text()) if args.reuse else {}
        scifact = measure("scifact", sub_corpus(args.others), None, earlier.get("scifact"))
        result = {"machine": platform.processor() or platform.machine(), "scifact": scifact}
        save("expansion_tuning", result)
        if not args.no_rgb:
            result["rgb"] = measure("rgb", load_beir(rgb_as_beir(OUT / "rgb-beir"), "test"), scifact["new_terms"],
                                    earlier.get("rgb"))
        save("expansion_tuning", result)
    publish("expansion_tuning", table(result), readme=not args.no_readme)


def table(result: dict) -> list[str]:
    lines = []
    for name, title in (("scifact", "SciFact test"), ("rgb", "RGB-built collection")):
        r = result.get(name)
        if r is None:
            continue
        lines += ["", f"{title}: {r['queries']} queries over {r['documents']:,} documents; Δ: paired 95 % "
                      f"bootstrap interval against the default (* when it excludes 0):", "",
                  "| retrieval | nDCG@10 | Δ nDCG@10 | Recall@100 | Δ Recall@100 | ms/query |", "|---|---|---|---|---|---|"]
        for row in r["rows"]:
            cells = []
            for m in ("ndcg@10", "recall@100"):
                v = row["versus_default"][m]
                star = "*" if v["low"] > 0 or v["high"] < 0 else ""
                cells.append(f"{row[m]:.3f} | {v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]{star}")
            lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {row['query_ms']:.0f} |")
        lines += ["", f"Tuner ({r['tune_seconds']:.0f} s, 300 pseudo-queries): fusion {r['chosen']}."]
        for stage, e in r["expansions"].items():
            strategies = ", ".join(f"{s} {g:+.3f}" for s, g in (e.get("by_strategy") or {}).items())
            lines.append(f"`{stage}`: {_plain(e['reason'])}" + (f" (gain by pseudo-query kind: {strategies})"
                                                                  if strategies else "") + ".")
    return lines[1:]


def _plain(reason: str) -> str:
    return re.sub(r"\s+", " ", reason)


if __name__ == "__main__":
    main()
