"""What MCP adds to a search, and MCP under load (issue 36): the stock ``mcp`` client over streamable
HTTP against the API (uvicorn in its own process, bearer token, the shipped ``search`` pipeline over a
small SciFact index).

1. **Overhead**: one MCP session and one HTTP client; each SciFact query is sent as ``POST /v1/query``
   and as the ``search`` tool, alternating which goes first (AB, BA, ...) so drift hits both alike.
   The figure is the median of the per-query differences (tool call minus ``/v1/query``), beside the
   medians and p95 of each. Target: <= 5 ms.
2. **Load**: N concurrent MCP sessions (default 50), each calling ``search`` one call after another
   for S seconds (default 60). Every tool error, transport error or timeout counts as a failure.
   Target: 0 failures; p95 reported.

Usage: .venv/bin/python bench/mcp_surface.py [--queries 200] [--sessions 50] [--seconds 60] [--docs 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from api_overhead import TOKEN, free_port, start_server
from common import REPO, indexed_workspace, percentile, publish, save

TARGET_MS = 5.0
CALL_TIMEOUT = 120.0  # seconds: a call that waits longer counts as failed
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@asynccontextmanager
async def mcp_session(url: str) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(headers=HEADERS, timeout=httpx2.Timeout(30, read=CALL_TIMEOUT)) as http:
        async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as client:
                await client.initialize()
                yield client


async def tool_search(client: ClientSession, question: str) -> int:
    """One ``search`` call; the number of passages, or an exception for a tool error."""
    result = await client.call_tool("search", {"query": question, "k": 10})
    if result.is_error:
        raise RuntimeError("".join(getattr(part, "text", "") for part in result.content)[:200])
    return len(result.structured_content["passages"])


def stats(values_ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values_ms), 2), "p95_ms": round(percentile(values_ms, 95), 2)}


async def overhead(url: str, questions: list[str]) -> dict:
    """Per query: the tool call's client wall time minus ``/v1/query``'s, the two sent back to back."""
    plain, tool, differences = [], [], []
    async with httpx2.AsyncClient(base_url=url, headers=HEADERS, timeout=CALL_TIMEOUT) as http, \
            mcp_session(url) as client:

        async def over_rest(question: str) -> float:
            started = time.perf_counter()
            response = await http.post("/v1/query", json={"question": question, "pipeline": "search"})
            response.raise_for_status()
            return 1000 * (time.perf_counter() - started)

        async def over_mcp(question: str) -> float:
            started = time.perf_counter()
            await tool_search(client, question)
            return 1000 * (time.perf_counter() - started)

        for question in questions[:10]:  # warm models, caches, the session and both connections
            await over_rest(question), await over_mcp(question)
        for i, question in enumerate(questions[10:]):
            if i % 2 == 0:
                rest, mcp = await over_rest(question), await over_mcp(question)
            else:
                mcp, rest = await over_mcp(question), await over_rest(question)
            plain.append(rest), tool.append(mcp), differences.append(mcp - rest)
    return {"v1_query": stats(plain), "mcp_search": stats(tool),
            "overhead_median_ms": round(statistics.median(differences), 2),
            "overhead_p95_ms": round(percentile(differences, 95), 2),
            "difference_of_medians_ms": round(statistics.median(tool) - statistics.median(plain), 2)}


async def load(url: str, questions: list[str], sessions: int, seconds: float) -> dict:
    """``sessions`` MCP sessions calling ``search`` back to back until ``seconds`` have passed."""
    latencies: list[float] = []
    failures: list[str] = []
    opened = 0
    deadline = time.monotonic() + seconds

    async def one(index: int) -> None:
        nonlocal opened
        try:
            async with mcp_session(url) as client:
                opened += 1
                call = index
                while time.monotonic() < deadline:
                    question = questions[call % len(questions)]
                    call += sessions
                    started = time.perf_counter()
                    try:
                        with anyio.fail_after(CALL_TIMEOUT):
                            await tool_search(client, question)
                        latencies.append(time.perf_counter() - started)
                    except Exception as exc:  # noqa: BLE001 - every failure is counted, by kind
                        failures.append(type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - a session that could not open is a failure too
            failures.append(f"session: {type(exc).__name__}")

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(sessions):
            group.start_soon(one, index)
    wall = time.perf_counter() - started
    done = latencies or [float("nan")]
    return {"sessions": sessions, "sessions_opened": opened, "calls": len(latencies) + len(failures),
            "failures": len(failures), "failure_kinds": sorted(set(failures)), "wall_s": round(wall, 1),
            "throughput_per_s": round(len(latencies) / wall, 2), "p50_s": round(statistics.median(done), 3),
            "p95_s": round(percentile(done, 95), 3), "max_s": round(max(done), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=50, help="0: measure the overhead only")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs) as (pipelines_file, _, questions):
        port = free_port()
        server = start_server(pipelines_file, port)
        url = f"http://127.0.0.1:{port}"
        try:
            measured = anyio.run(overhead, url, questions[:args.queries + 10])
            loaded = anyio.run(load, url, questions, args.sessions, args.seconds) if args.sessions else None
        finally:
            server.terminate()
            server.wait(30)
    result = {"overhead": measured, "load": loaded, "queries": args.queries, "docs": args.docs,
              "pipeline": "search", "target_ms": TARGET_MS}
    path = save("mcp_surface", result)
    print(f"written to {path.relative_to(REPO)}")
    if loaded is None:  # --sessions 0: the overhead alone, printed and not published
        print(measured)
        return
    verdict = "within" if measured["overhead_median_ms"] <= TARGET_MS else "over"
    table = ["| path | median | p95 |", "|---|---|---|",
             f"| `POST /v1/query` | {measured['v1_query']['median_ms']:.2f} ms | {measured['v1_query']['p95_ms']:.2f} ms |",
             f"| MCP `search` tool (streamable HTTP, one session) | {measured['mcp_search']['median_ms']:.2f} ms "
             f"| {measured['mcp_search']['p95_ms']:.2f} ms |",
             f"| the tool call minus `/v1/query`, per query | **{measured['overhead_median_ms']:.2f} ms** "
             f"| {measured['overhead_p95_ms']:.2f} ms |",
             "", "| sessions | calls in " + f"{args.seconds:g} s | failures | throughput | p50 | p95 | max |",
             "|---|---|---|---|---|---|---|",
             f"| {loaded['sessions_opened']}/{loaded['sessions']} | {loaded['calls']} | **{loaded['failures']}** "
             f"| {loaded['throughput_per_s']:.1f}/s | {loaded['p50_s']:.2f} s | {loaded['p95_s']:.2f} s "
             f"| {loaded['max_s']:.2f} s |",
             f"\n{args.queries} SciFact queries over {args.docs} abstracts, the `search` pipeline (k 10), `/v1/query` "
             f"and the tool alternating; the overhead is {verdict} the {TARGET_MS:g} ms target. Then "
             f"{args.sessions} concurrent MCP sessions (the stock client) calling `search` back to back for "
             f"{args.seconds:g} s; the API runs 32 queries at once, the rest wait their turn."
             + (f" Failures: {', '.join(loaded['failure_kinds'])}." if loaded["failures"] else "")]
    publish("mcp", table, readme=not args.no_readme)
    if loaded["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
