"""What the query log (``RAGLINE_QUERY_LOG=1``) costs a served query: ``QueryService.run``, the call
``POST /v1/query`` and the OpenAI route make, in-process on one event loop, with the log off and on
(two services over the same compiled project and indexes), on the `search` pipeline and on an
`ask` pipeline whose scripted LLM answers at once (the figure is ragline's own work).

Same run: every question goes to both services back to back, the order alternating, so drift of the
shared machine hits each alike. Per pipeline: median and p95 with the log off and on, the median of
the paired differences (same question, back to back), and the writer thread's own time per entry
(building the line: step outputs, index generation; writing it), which the query does not wait for.

Usage: .venv/bin/python bench/query_log_overhead.py [--queries 200] [--ask-queries 60] [--docs 300]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from common import indexed_workspace, percentile, save
from observability_overhead import ASK, reply
from tests.scripted_llm import ScriptedLLM


def services(project):
    from ragline.flows.serve.query_service import QueryService

    os.environ.pop("RAGLINE_QUERY_LOG", None)
    off = QueryService(project)
    os.environ["RAGLINE_QUERY_LOG"] = "1"
    on = QueryService(project)
    os.environ.pop("RAGLINE_QUERY_LOG")
    return off, on


async def measure(off, on, pipeline: str, questions: list[str], warm: int = 5) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i, question in enumerate(questions[:warm] + questions):
        pairs = [("off", off), ("on", on)] if i % 2 else [("on", on), ("off", off)]
        for name, service in pairs:
            query = {"text": question, "history": [], "filters": None}
            started = time.perf_counter()
            await service.run(service.pipeline(pipeline), query)
            if i >= warm:
                times[name].append(1000 * (time.perf_counter() - started))
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, float]:
    off, on = times["off"], times["on"]
    paired = [b - a for a, b in zip(off, on)]
    return {"off_median_ms": round(statistics.median(off), 2), "off_p95_ms": round(percentile(off, 95), 2),
            "on_median_ms": round(statistics.median(on), 2), "on_p95_ms": round(percentile(on, 95), 2),
            "paired_diff_median_ms": round(statistics.median(paired), 3),
            "ratio": round(statistics.median(on) / statistics.median(off), 3), "queries": len(on)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--ask-queries", type=int, default=60)
    parser.add_argument("--docs", type=int, default=300)
    args = parser.parse_args()
    for name in ("PREFECT_API_URL", "RAGLINE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        os.environ.pop(name, None)
    results = {}
    with ScriptedLLM(reply) as llm:
        os.environ.update(RAGLINE_LLM_BASE_URL=llm.base_url, RAGLINE_LLM_MODEL="scripted")
        with indexed_workspace(args.docs, ASK) as (_, project, questions):
            off, on = services(project)
            for pipeline, chosen in (("search", questions[:args.queries]),
                                     ("ask_bench", questions[args.queries:args.queries + args.ask_queries])):
                times = asyncio.run(measure(off, on, pipeline, chosen))
                on.query_log.flush(timeout_seconds=600)
                results[pipeline] = summarise(times)
            lines = sum(1 for _ in open(on.query_log.path, encoding="utf-8"))
            results["log"] = {"lines": lines, "bytes": on.query_log.path.stat().st_size}
            off.close()
            on.close()
    timed = time_writer(args.queries)
    results["writer"] = timed
    print(f"query log overhead (in-process QueryService.run, same run; {args.docs} SciFact docs)")
    for pipeline in ("search", "ask_bench"):
        r = results[pipeline]
        print(f"  {pipeline:9}  off {r['off_median_ms']:7.2f} ms (p95 {r['off_p95_ms']:7.2f})  on "
              f"{r['on_median_ms']:7.2f} ms (p95 {r['on_p95_ms']:7.2f})  paired diff {r['paired_diff_median_ms']:+.3f} "
              f"ms  ratio {r['ratio']}  ({r['queries']} queries)")
    print(f"  writer thread: {timed['ms_per_entry']} ms per entry (off the query's path); "
          f"{results['log']['lines']} lines, {results['log']['bytes']} bytes")
    print(f"saved {save('query_log_overhead', results)}")


def time_writer(entries: int) -> dict[str, float]:
    """The writer's own cost per entry (serialise, append, rotate), timed directly in a temp folder."""
    import tempfile
    from pathlib import Path

    from ragline.flows.serve.query_log import QueryLog

    with tempfile.TemporaryDirectory() as tmp:
        log = QueryLog(Path(tmp), max_bytes=100 * 1024 * 1024, retention_days=30, text=True)
        entry = {"answer_id": "0" * 32, "time": "2026-01-01T00:00:00.000Z", "pipeline": "ask", "status": "answered",
                 "question": "q" * 80, "retrieved": [{"chunk_id": "c" * 16, "source_id": "s" * 30, "doc_id": "d" * 8,
                                                      "score": 0.5}] * 5, "answer": {"text": "a" * 300}}
        log.flush()
        started = time.perf_counter()
        for _ in range(entries):
            log.record(dict(entry))
        queued = time.perf_counter() - started
        log.flush(timeout_seconds=600)
        total = time.perf_counter() - started
        log.close()
    return {"ms_per_entry": round(1000 * total / entries, 4), "enqueue_us_per_entry": round(1e6 * queued / entries, 2)}


if __name__ == "__main__":
    main()
