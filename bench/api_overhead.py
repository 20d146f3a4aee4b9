"""What the HTTP API adds to a query: ``POST /v1/query`` (uvicorn in its own process, bearer token,
JSON out) against calling the same pipeline directly (``engine.run(..., orchestrate=False)`` here).

The shipped ``search`` pipeline (dense and BM25 beside each other, then RRF) over a small SciFact
index. Direct and HTTP queries alternate (AB, BA, ...) so machine drift hits both alike. Two figures:
the difference of the medians (whole query, client's clock), and per request the client's wall
time minus the run's own ``latency_ms`` reported by the server (HTTP, auth, JSON, the thread hop:
less noisy, since it does not compare two processes' retrieval times). ``GET /healthz`` gives the
bare HTTP round trip. Target: <= 15 ms median overhead.

Usage: .venv/bin/python bench/api_overhead.py [--queries 200] [--docs 300]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import REPO, indexed_workspace, percentile, publish, save
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

TOKEN = "bench-token"
TARGET_MS = 15.0
SERVER = """
import sys, uvicorn
from ragline.flows.serve.app import create_app
uvicorn.run(create_app(sys.argv[1], token=sys.argv[2], max_concurrent_runs=int(sys.argv[4])), host="127.0.0.1",
            port=int(sys.argv[3]), log_level="warning", access_log=False)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(project: Path, port: int, env: dict[str, str] | None = None, runs: int = 32,
                 code: str = SERVER) -> subprocess.Popen:
    """The API on ``project`` in its own process (``runs`` queries at once); returns once it answers."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", code, str(project), TOKEN, str(port), str(runs)], env=env,
                            cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the API server did not start")


def stats(values_ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values_ms), 2), "p95_ms": round(percentile(values_ms, 95), 2)}


def measure(project_path: Path, questions: list[str], port: int) -> dict:
    pipeline = load_project(project_path).pipeline("search")
    direct, http, own, floor = [], [], [], []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as client:

        def over_http(question: str) -> None:
            started = time.perf_counter()
            response = client.post("/v1/query", json={"question": question, "pipeline": "search"})
            wall = 1000 * (time.perf_counter() - started)
            response.raise_for_status()
            http.append(wall)
            own.append(wall - response.json()["latency_ms"])

        def in_process(question: str) -> None:
            started = time.perf_counter()
            engine.run(pipeline, {"query": question}, orchestrate=False)
            direct.append(1000 * (time.perf_counter() - started))

        for question in questions[:10]:  # warm both processes' models, caches and connections
            in_process(question)
            over_http(question)
        direct.clear(), http.clear(), own.clear()
        for i, question in enumerate(questions):
            for run in ((in_process, over_http) if i % 2 == 0 else (over_http, in_process)):
                run(question)
            started = time.perf_counter()
            client.get("/healthz")
            floor.append(1000 * (time.perf_counter() - started))
    return {"direct": stats(direct), "http": stats(http), "api_own_time": stats(own),
            "healthz_round_trip": stats(floor),
            "overhead_median_ms": round(statistics.median(http) - statistics.median(direct), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs) as (pipelines_file, project, questions):
        questions = questions[:args.queries + 10]
        port = free_port()
        server = start_server(pipelines_file, port)
        try:
            result = measure(pipelines_file, questions, port)
        finally:
            server.terminate()
            server.wait(30)
    result.update(queries=len(questions) - 10, docs=args.docs, pipeline="search", target_ms=TARGET_MS)
    path = save("api_overhead", result)
    print(f"{result['queries']} SciFact queries over {args.docs} abstracts, `search`, direct and HTTP alternating")
    for key in ("direct", "http", "api_own_time", "healthz_round_trip"):
        print(f"  {key:<20} median {result[key]['median_ms']:7.2f} ms   p95 {result[key]['p95_ms']:7.2f} ms")
    own = result["api_own_time"]["median_ms"]
    print(f"  overhead (difference of medians) {result['overhead_median_ms']:.2f} ms; API's own time per request "
          f"{own:.2f} ms median: {'within' if own <= TARGET_MS else 'OVER'} the {TARGET_MS:g} ms target")
    print(f"  written to {path.relative_to(REPO)}")
    rows = {"direct": "`engine.run` in-process", "http": "`POST /v1/query` (uvicorn, own process)",
            "api_own_time": "API's own time (client wall minus the run's latency)", "healthz_round_trip": "`GET /healthz`"}
    table = ["| path | median | p95 |", "|---|---|---|"]
    table += [f"| {label} | {result[k]['median_ms']:.2f} ms | {result[k]['p95_ms']:.2f} ms |" for k, label in rows.items()]
    table.append(f"\n{result['queries']} SciFact queries over {args.docs} abstracts, `search`, direct and HTTP "
                 f"alternating; target for the API's own time: {TARGET_MS:g} ms median.")
    publish("api", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
