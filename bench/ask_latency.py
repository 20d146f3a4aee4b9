"""Per-stage latency of the default `ask` pipeline (median, p95) against a real vLLM server, and how
much of a query's wall time is orchestration (Prefect) rather than stage (model) time.

Usage: .venv/bin/python bench/ask_latency.py [--runs 10] [--pipeline ask]
Needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh, or RAGLINE_LLM_BASE_URL) and an index
(runs the `index` pipeline on the bundled sample first).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from common import REPO, save, summary_ms, publish

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

QUESTIONS = ["How does ragline keep the index up to date when documents change?",
             "What does reciprocal rank fusion add for each chunk?",
             "Where can I watch pipeline runs?",
             "What happens to a document that cannot be read?",
             "Which retrievers does the default search pipeline run?"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--pipeline", default="ask")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    project = load_project(REPO / "pipelines.yaml")
    engine.run(project.pipeline("index"))  # also starts Prefect's server before any timing
    pipeline = project.pipeline(args.pipeline)
    engine.run(pipeline, {"query": QUESTIONS[0]}, orchestrate=False)  # warm models and connections
    stages: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = {"prefect": [], "direct": []}
    stage_sums: dict[str, list[float]] = {"prefect": [], "direct": []}
    for i in range(args.runs):
        question = QUESTIONS[i % len(QUESTIONS)]
        for mode, orchestrate in (("prefect", True), ("direct", False)):
            trace: list[tuple[str, float]] = []
            start = time.perf_counter()
            engine.run(pipeline, {"query": question}, orchestrate=orchestrate, trace=trace)
            totals[mode].append(time.perf_counter() - start)
            stage_sums[mode].append(sum(s for _, s in trace))
            if mode == "direct":
                for step, seconds in trace:
                    stages[step].append(seconds)
    rows = {step: summary_ms(values) for step, values in stages.items()}
    overhead = {mode: statistics.median(t - s for t, s in zip(totals[mode], stage_sums[mode])) for mode in totals}
    result = {"pipeline": args.pipeline, "runs": args.runs, "stages": rows,
              "total": {mode: summary_ms(v) for mode, v in totals.items()},
              "outside_stages_median_ms": {m: round(1000 * v, 1) for m, v in overhead.items()}}
    table = ["| step | median | p95 |", "|---|---|---|"]
    table += [f"| {step} | {r['median_ms']:.0f} ms | {r['p95_ms']:.0f} ms |" for step, r in rows.items()]
    for mode in ("direct", "prefect"):
        total = result["total"][mode]
        table.append(f"| **whole query, {mode}** | {total['median_ms']:.0f} ms | {total['p95_ms']:.0f} ms |")
    prefect, direct = statistics.median(totals["prefect"]), statistics.median(totals["direct"])
    result["orchestration_ms"] = round(1000 * (prefect - direct), 1)
    table.append("")
    table.append(f"Orchestration: a Prefect flow run adds {1000 * (prefect - direct):.0f} ms per query "
                 f"({100 * (prefect - direct) / prefect:.1f} % of its wall time) over the in-process run; "
                 f"in-process, the engine's own time outside the stages is {1000 * overhead['direct']:.1f} ms. "
                 f"The rest is model time (embedding, BM25, Chroma, and the LLM calls).")
    save("ask_latency", result)
    publish("latency", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
