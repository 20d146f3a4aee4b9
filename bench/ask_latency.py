"""Latency of the default `ask` pipeline against a real vLLM server: per stage (median, p95), for
**distinct** questions (each asked once: a cold prompt, as a user's question is) and, labelled
apart, for the same questions **repeated** (vLLM's prefix cache serves most of the prefill), plus
the engine's own time outside the stages (Prefect's cost per run: bench/engine_overhead.py).

Usage: .venv/bin/python bench/ask_latency.py [--questions 20] [--docs 300] [--pipeline ask]
Needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh, or RAGLINE_LLM_BASE_URL). Indexes the
first ``--docs`` SciFact abstracts in a temporary workspace and asks SciFact's own queries, so no
two prompts share their references.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from common import indexed_workspace, publish, save, summary_ms

from ragline.flows.run import engine


def ask(pipeline, question: str, orchestrate: bool) -> tuple[float, list[tuple[str, float]]]:
    trace: list[tuple[str, float]] = []
    start = time.perf_counter()
    engine.run(pipeline, {"query": question}, orchestrate=orchestrate, trace=trace)
    return time.perf_counter() - start, trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=20, help="distinct questions, each asked once cold")
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--pipeline", default="ask")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs) as (_, project, questions):
        pipeline = project.pipeline(args.pipeline)
        engine.run(pipeline, {"query": "warm-up: what is measured?"}, orchestrate=False)  # models, connections
        fresh, repeated = questions[:args.questions], questions[:args.questions]
        cold = [ask(pipeline, q, orchestrate=False) for q in fresh]  # every prompt new to the server
        cached = [ask(pipeline, q, orchestrate=False) for q in repeated]  # the same prompts again
    stages = {label: _per_step(runs) for label, runs in (("distinct", cold), ("repeated", cached))}
    totals = {"distinct": summary_ms([t for t, _ in cold]), "repeated": summary_ms([t for t, _ in cached])}
    own = {label: statistics.median(t - sum(s for _, s in trace) for t, trace in runs)
           for label, runs in (("distinct", cold), ("repeated", cached))}
    result = {"pipeline": args.pipeline, "questions": args.questions, "docs": args.docs, "stages": stages,
              "total": totals, "outside_stages_median_ms": {k: round(1000 * v, 1) for k, v in own.items()}}
    table = ["| step | distinct questions: median | p95 | repeated (prefix-cached): median | p95 |",
             "|---|---|---|---|---|"]
    for step, row in stages["distinct"].items():
        again = stages["repeated"].get(step, {"median_ms": 0, "p95_ms": 0})
        table.append(f"| {step} | {row['median_ms']:.0f} ms | {row['p95_ms']:.0f} ms | "
                     f"{again['median_ms']:.0f} ms | {again['p95_ms']:.0f} ms |")
    table.append(f"| **whole query, in-process** | {totals['distinct']['median_ms']:.0f} ms | "
                 f"{totals['distinct']['p95_ms']:.0f} ms | {totals['repeated']['median_ms']:.0f} ms | "
                 f"{totals['repeated']['p95_ms']:.0f} ms |")
    table += ["", f"{args.questions} distinct SciFact queries over {args.docs} abstracts, each asked once (a cold "
                  f"prompt), then the same {args.questions} again (labelled repeated: vLLM's prefix cache serves "
                  f"their prefill). The engine's own time outside the stages: {1000 * own['distinct']:.1f} ms "
                  f"per query. The rest is model time: embedding, BM25, Chroma and the LLM calls; the "
                  f"answer step is almost all prefill on a cold prompt (the repeated column is the same "
                  f"generation with the prefill cached)."]
    save("ask_latency", result)
    publish("latency", table, readme=not args.no_readme)


def _per_step(runs: list[tuple[float, list[tuple[str, float]]]]) -> dict[str, dict[str, float]]:
    steps: dict[str, list[float]] = defaultdict(list)
    for _, trace in runs:
        for step, seconds in trace:
            steps[step].append(seconds)
    return {step: summary_ms(values) for step, values in steps.items()}


if __name__ == "__main__":
    main()
