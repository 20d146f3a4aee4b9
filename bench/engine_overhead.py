"""Per-query cost of the in-process (direct) executor: steps one after another in the caller's thread
(the engine before v2) versus independent branches run concurrently on the shared step pool (now).

Two pipelines: the shipped `search` (dense and BM25 beside each other, then RRF) on a small SciFact
index, and an ask_fusion-shaped DAG whose two rewrite branches wait like LLM calls. Runs alternate
(ABAB) so machine drift hits both executors alike. The engine's own time is the wall time minus the
DAG's critical path of stage times (minus their sum, for the sequential executor).

Usage: .venv/bin/python bench/engine_overhead.py [--queries 100] [--docs 300] [--no-readme]
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import Future

from common import indexed_workspace, publish, save, summary_ms

from ragline.flows.run import engine
from ragline.flows.spec.compile import CompiledPipeline
from ragline.flows.contracts import Query
from ragline.flows.spec.registry import stage
from ragline.flows.run.steps import execute

LLM_LIKE_SECONDS = 0.05


@stage("bench_llm_rewrite", produces="query", kind="query")
def _llm_rewrite(query: Query, ctx) -> Query:
    """Waits like a short LLM call, then adds a search variant."""
    time.sleep(LLM_LIKE_SECONDS)
    return query.model_copy(update={"variants": query.variants + [f"{query.text} ({ctx.step_id})"]})


FUSION_SHAPED = """
  fusion_shaped:
    kind: query
    steps:
      - {id: hyde,   task: bench_llm_rewrite}
      - {id: multi,  task: bench_llm_rewrite, after: []}
      - {id: dense,  task: retrieve_dense, after: [hyde], with: {k: 50}}
      - {id: sparse, task: retrieve_sparse, after: [multi], with: {k: 50}}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60}}
"""


class SequentialExecutor:
    """The engine before v2: each step runs in the caller's thread, in order, when submitted."""

    def submit(self, step, call, inputs, after, label) -> Future:
        future: Future = Future()
        resolved = {port: [r.result() if isinstance(r, Future) else r for r in rs] for port, rs in inputs.items()}
        try:
            future.set_result(engine.run_with_policy(step, lambda: execute(call, resolved)))
        except Exception as exc:  # noqa: BLE001 - surfaced by result()
            future.set_exception(exc)
        return future

    @staticmethod
    def result(future: Future):
        return future.result()


def critical_path(pipeline: CompiledPipeline, seconds: dict[str, float]) -> float:
    finish: dict[str, float] = {}
    for step in pipeline.steps:  # topological order
        finish[step.id] = seconds.get(step.id, 0.0) + max((finish[u] for u in step.upstream), default=0.0)
    return max(finish.values())


def measure(pipeline: CompiledPipeline, questions: list[str]) -> dict:
    runs: dict[str, dict[str, list[float]]] = {m: {"wall": [], "engine": []} for m in ("sequential", "concurrent")}
    executors = {"sequential": SequentialExecutor, "concurrent": engine.DirectExecutor}
    for question in questions:
        for mode, executor in executors.items():
            trace: list[tuple[str, float]] = []
            started = time.perf_counter()
            engine.execute_pipeline(pipeline, {"query": question}, executor(), engine.DriverHooks(trace=trace))
            wall = time.perf_counter() - started
            seconds = dict(trace)
            busy = sum(seconds.values()) if mode == "sequential" else critical_path(pipeline, seconds)
            runs[mode]["wall"].append(wall)
            runs[mode]["engine"].append(wall - busy)
    return {mode: {"wall": summary_ms(v["wall"]), "engine": summary_ms(v["engine"])} for mode, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs, FUSION_SHAPED) as (_, project, questions):
        questions = questions[:args.queries]
        results = {}
        for name in ("search", "fusion_shaped"):
            pipeline = project.pipeline(name)
            engine.run(pipeline, {"query": questions[0]}, orchestrate=False)  # warm models
            results[name] = measure(pipeline, questions)
    save("engine_overhead", {"queries": args.queries, "docs": args.docs, "results": results})
    lines = ["| pipeline | executor | whole query median / p95 | engine's own time median / p95 |",
             "|---|---|---|---|"]
    for name, modes in results.items():
        for mode, figures in modes.items():
            wall, own = figures["wall"], figures["engine"]
            lines.append(f"| {name} | {mode} | {wall['median_ms']:.1f} / {wall['p95_ms']:.1f} ms "
                         f"| {own['median_ms']:.2f} / {own['p95_ms']:.2f} ms |")
    speedups = {name: m["sequential"]["wall"]["median_ms"] / m["concurrent"]["wall"]["median_ms"]
                for name, m in results.items()}
    lines.append("")
    lines.append(f"{args.queries} SciFact queries over {args.docs} abstracts, alternating executors. Concurrent vs "
                 f"sequential whole-query speed-up: " + ", ".join(f"{n} {s:.2f}x" for n, s in speedups.items()) +
                 f" (the fusion-shaped DAG's rewrites wait {1000 * LLM_LIKE_SECONDS:.0f} ms each, like LLM calls).")
    publish("engine", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
