"""Concurrent clients against ``POST /v1/query``: throughput, latency and errors under load.

The API (uvicorn, its own process, loopback only, the shipped pipelines over a small SciFact index)
answers N concurrent clients (default 50), each sending its queries one after another: first the
``search`` pipeline (retrieval only), then ``ask`` (retrieval, then the CPU vLLM server generates;
all LLM calls of the process share the endpoint through ``FairSlots``, oldest query first). Every
non-200 answer, dropped connection or client timeout counts as a failure. The vLLM server is the
one at ``RAGLINE_LLM_BASE_URL`` if it answers, else the packaged one is started (and stopped).

Usage: .venv/bin/python bench/api_load.py [--clients 50] [--search-per-client 4] [--ask-per-client 1]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx

from api_overhead import TOKEN, free_port, start_server
from common import REPO, index_more, indexed_workspace, percentile, publish, save

# The API as `ragline api` runs it: the embedded store served by its managed Chroma server, so the
# ingestion another process runs during the load is what the API's dense side searches next.
SERVED = """
import contextlib, sys, uvicorn
from ragline.flows.serve.app import create_app
from ragline.flows.ops.store_servers import serve_stores
app = create_app(sys.argv[1], token=sys.argv[2], max_concurrent_runs=int(sys.argv[4]))
with contextlib.ExitStack() as stack:
    serve_stores(app.state.service.project, stack, lambda line: print(line, file=sys.stderr))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning", access_log=False)
"""

CLIENT_TIMEOUT = 900.0  # seconds: a query that waits longer counts as failed
# `ask` with a smaller context and a short answer: on this CPU, prefill runs ~110 tokens/s and
# decoding a few tokens/s, so the shipped `ask` (up to 1,000 context tokens, 128 answer tokens) would
# make 50 queries a ~20-minute model benchmark; the API's behaviour under load is what is measured.
ASK_LOAD = """
  ask_load:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 10}}
      - {id: insert, task: insert, with: {max_tokens: 300, max_documents: 2}}
      - {id: answer, task: generate, with: {max_tokens: 32}}
      - {id: check,  task: verify, with: {min_grounding: 0.6, fact_check: false}}
"""


async def client(http: httpx.AsyncClient, pipeline: str, questions: list[str], out: list[dict]) -> None:
    for question in questions:
        started = time.perf_counter()
        try:
            response = await http.post("/v1/query", json={"question": question, "pipeline": pipeline})
            ok, detail = response.status_code == 200, f"HTTP {response.status_code}"
            if ok and pipeline != "search":
                ok = bool(response.json()["answer"]["text"])
        except httpx.HTTPError as exc:
            ok, detail = False, type(exc).__name__
        out.append({"seconds": time.perf_counter() - started, "ok": ok, "detail": detail})


async def phase(port: int, pipeline: str, clients: int, per_client: int, questions: list[str]) -> dict:
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, limits=limits,
                                 timeout=CLIENT_TIMEOUT) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http, pipeline, [questions[(c * per_client + i) % len(questions)]
                                                       for i in range(per_client)], results)
                               for c in range(clients)))
        wall = time.perf_counter() - started
    seconds = [r["seconds"] for r in results if r["ok"]] or [float("nan")]
    failures = [r["detail"] for r in results if not r["ok"]]
    return {"pipeline": pipeline, "clients": clients, "requests": len(results), "failures": len(failures),
            "failure_kinds": sorted(set(failures)), "wall_s": round(wall, 1),
            "throughput_per_s": round(len(results) / wall, 2),
            "p50_s": round(statistics.median(seconds), 2), "p95_s": round(percentile(seconds, 95), 2),
            "max_s": round(max(seconds), 2)}


def found_by_dense(port: int, titles: list[str]) -> int:
    """How many added abstracts the API's `search_dense` ranks first for their own title."""
    hits = 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=CLIENT_TIMEOUT) as http:
        for title in titles:
            response = http.post("/v1/query", json={"question": title, "pipeline": "search_dense"})
            response.raise_for_status()
            items = response.json()["passages"]
            passages = items[0]["passages"] if items and "passages" in items[0] else items
            hits += bool(passages) and passages[0]["title"] == title
    return hits


async def search_while_ingesting(port: int, args, questions: list[str], pipelines_file) -> tuple[dict, list[str]]:
    load = asyncio.ensure_future(phase(port, "search", args.clients, args.search_per_client, questions))
    titles = await asyncio.to_thread(index_more, pipelines_file, args.docs, args.added) if args.added else []
    return await load, titles


def llm_endpoint(stack: list) -> str:
    from ragline.flows.ops.llm_server import ready, start_vllm

    url = os.environ.get("RAGLINE_LLM_BASE_URL", "")
    if url and ready(url, None):
        return url
    server = start_vllm()
    stack.append(server)
    return server.base_url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--search-per-client", type=int, default=4)
    parser.add_argument("--ask-per-client", type=int, default=1)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--added", type=int, default=50,
                        help="abstracts another process indexes during the search phase (0: none)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    started: list = []
    llm_url = llm_endpoint(started) if args.ask_per_client else "http://127.0.0.1:9/v1"
    try:
        with indexed_workspace(args.docs, ASK_LOAD) as (pipelines_file, _, questions):
            port = free_port()
            server = start_server(pipelines_file, port, env={"RAGLINE_LLM_BASE_URL": llm_url}, runs=32,
                                  code=SERVED)
            try:
                search, titles = asyncio.run(search_while_ingesting(port, args, questions, pipelines_file))
                fresh = found_by_dense(port, titles)
                phases = [search]
                if args.ask_per_client:
                    phases.append(asyncio.run(phase(port, "ask_load", args.clients, args.ask_per_client, questions)))
            finally:
                server.terminate()
                server.wait(30)
    finally:
        for vllm in started:
            vllm.stop()
    result = {"phases": phases, "docs": args.docs, "llm": "SmolLM2-135M on CPU vLLM (bf16, eager)",
              "max_concurrent_runs": 32, "llm_max_concurrency_per_lane": 4,
              "added_during_search": len(titles), "added_found_first_by_dense": fresh}
    path = save("api_load", result)
    table = ["| pipeline | clients | requests | failures | throughput | p50 | p95 | max |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| `{p['pipeline']}` | {p['clients']} | {p['requests']} | {p['failures']} | {p['throughput_per_s']:.2f}/s "
              f"| {p['p50_s']:.2f} s | {p['p95_s']:.2f} s | {p['max_s']:.2f} s |" for p in phases]
    llm = ("LLM calls 4 at a time per lane, oldest query first; SmolLM2-135M on the CPU vLLM server of this 2-core "
           "machine." if args.ask_per_client else "no LLM (search only); the machine was shared with other jobs.")
    table.append(f"\n{args.clients} concurrent clients over loopback, each sending its queries one after another "
                 f"(`search` ×{args.search_per_client}" + (f", then `ask_load` ×{args.ask_per_client}: `ask` with 300 "
                 f"context tokens and 32 answer tokens" if args.ask_per_client else "") + f"); {args.docs} SciFact "
                 f"abstracts, {len(titles)} more indexed by a terminal `ragline index` during the search phase, after "
                 f"which the API's `search_dense` ranked {fresh} of them first for their own titles (the store served "
                 f"by its managed Chroma server, as `ragline api` runs it); the API runs 32 queries at once (the rest "
                 f"wait their turn); {llm}")
    print(f"written to {path.relative_to(REPO)}")
    publish("load" if args.ask_per_client else "load_search", table, readme=not args.no_readme)
    if any(p["failures"] for p in phases):
        sys.exit(1)


if __name__ == "__main__":
    main()
