"""Time from trigger to result for a query flow run started through its Prefect deployment.

What a client that uses Prefect's REST API waits for: ``POST /api/deployments/{id}/create_flow_run``
with the question as parameters, polling ``GET /api/flow_runs/{id}`` until it is final, then reading
the persisted JSON result. ``ragline serve`` (no HTTP API) is the runner, against a real Prefect
server with its scheduler; the shipped ``search`` pipeline over a small SciFact index. The split
shows where the time goes: waiting for the runner to pick the run up (its poll interval), the run
itself in its own process (the models load each time), and the baseline of the same query
in-process, measured in the same run. Both ways serve starts a run's process are measured: warm
(forked from serve's forkserver, which imported Prefect, the stages and the libraries once: the
default) and cold (a fresh interpreter that imports them, Prefect's way: ``--cold-runs``).

Usage: .venv/bin/python bench/deployment_trigger.py [--runs 10] [--docs 300] [--poll-seconds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from common import REPO, indexed_workspace, percentile, publish, save
from ragline.flows.run import engine

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SERVE = ("import sys; from ragline.flows.serve.supervise.service import serve; "
         "sys.exit(serve(sys.argv[1], api=False, poll_seconds=float(sys.argv[2]), warm_runs=sys.argv[3] == 'warm'))")


def start_serve(project: Path, api_url: str, poll_seconds: float, log: Path, warm: bool,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api_url, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(project), str(poll_seconds),
                                 "warm" if warm else "cold"], cwd=project.parent,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ragline serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if "ragline serve: Prefect API" in log.read_text(errors="replace"):
            return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("ragline serve did not start")


def seconds_between(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def run_deployment(client: httpx.Client, deployment_id: str, parameters: dict) -> dict:
    """Create a flow run of the deployment and wait for it to end; its final record (COMPLETED only)."""
    for attempt in range(6):  # a loaded machine's Prefect server answers 503 now and then (its database busy)
        created = client.post(f"/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters})
        if created.status_code != 503:
            break
        time.sleep(0.5 * 2 ** attempt)
    created.raise_for_status()
    run_id = created.json()["id"]
    while (run := client.get(f"/flow_runs/{run_id}").json())["state"]["type"] not in FINAL:
        time.sleep(0.05)
    if run["state"]["type"] != "COMPLETED":
        raise RuntimeError(f"flow run {run_id}: {run['state']}")
    return run


def trigger_and_wait(client: httpx.Client, deployment_id: str, question: str) -> dict[str, float]:
    started = time.perf_counter()
    run = run_deployment(client, deployment_id, {"inputs": {"query": {"text": question}}})
    passages = json.loads(Path(run["state"]["data"]["storage_key"]).read_text())
    total = time.perf_counter() - started
    assert passages, "a query run with no passages"
    return {"total": total, "pickup": seconds_between(run["expected_start_time"], run["start_time"]),
            "run": seconds_between(run["start_time"], run["end_time"])}


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(1000 * statistics.median(values), 1), "p95_ms": round(1000 * percentile(values, 95), 1)}


def measure(project_path: Path, project, questions: list[str], poll_seconds: float, warm: bool) -> dict:
    """Flow runs triggered through the deployment, under a serve whose runs start warm (forked from
    its forkserver, flows/serve/supervise/warm.py) or cold (a fresh interpreter each, Prefect's way)."""
    from ragline.flows.serve.supervise.service import start_prefect_server

    pipeline = project.pipeline("search")
    with tempfile.TemporaryDirectory() as home:
        server = start_prefect_server(Path(home) / "prefect", auth=False)  # a throwaway harness server, plain HTTP
        serve = start_serve(project_path, server.api_url, poll_seconds, Path(home) / "serve.log", warm)
        try:
            with httpx.Client(base_url=server.api_url, timeout=60) as client:
                deployment_id = client.get("/deployments/name/ragline/search").json()["id"]
                trigger_and_wait(client, deployment_id, questions[0])  # warm the runner and the server
                triggered = [trigger_and_wait(client, deployment_id, q) for q in questions]
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
            server.stop()
    direct = []
    for question in questions:
        started = time.perf_counter()
        engine.run(pipeline, {"query": question}, orchestrate=False)
        direct.append(time.perf_counter() - started)
    return {key: ms([t[key] for t in triggered]) for key in ("total", "pickup", "run")} | {"in_process": ms(direct)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--poll-seconds", type=float, default=2.0, help="the runner's poll interval (serve's default)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with indexed_workspace(args.docs) as (pipelines_file, project, questions):
        engine.run(project.pipeline("search"), {"query": questions[0]}, orchestrate=False)  # load the models
        asked = questions[1:args.runs + 1]
        result = {}
        for mode in ("cold", "warm"):
            result[mode] = measure(pipelines_file, project, asked, args.poll_seconds, warm=mode == "warm")
            print(mode, json.dumps(result[mode]), flush=True)
    result.update(runs=args.runs, docs=args.docs, poll_seconds=args.poll_seconds, pipeline="search",
                  ratio=round(result["warm"]["total"]["median_ms"] / result["warm"]["in_process"]["median_ms"], 1),
                  warm_vs_cold_run=round(result["warm"]["run"]["median_ms"] / result["cold"]["run"]["median_ms"], 2))
    path = save("deployment_trigger", result)
    rows = {"total": "trigger → result (create_flow_run, poll, read the JSON result)",
            "pickup": "of which: waiting for the runner (expected start → start)",
            "run": "of which: the flow run (start → end; its process loads the models)",
            "in_process": "the same query in-process (`engine.run`, baseline)"}
    table = ["| what | runs start warm (default) median / p95 | runs start cold (`--cold-runs`) median / p95 |",
             "|---|---|---|"]
    table += [f"| {label} | " + " | ".join(f"{result[m][k]['median_ms'] / 1000:.2f} s / {result[m][k]['p95_ms'] / 1000:.2f} s"
                                           for m in ("warm", "cold")) + " |" for k, label in rows.items()]
    table.append(f"\n{args.runs} SciFact queries, `search` over {args.docs} abstracts, runner polling every "
                 f"{args.poll_seconds:g} s, the same queries under each serve (cold first). Warm: each flow run "
                 f"forks from serve's forkserver, which imported Prefect's engine, the stages and the libraries "
                 f"once; its run takes {result['warm_vs_cold_run']:g}x the cold one's. A deployment-triggered "
                 f"query still takes {result['ratio']:g}x the in-process one: use `POST /v1/query` for "
                 "interactive use, the deployment for audited or scheduled queries.")
    print(f"written to {path.relative_to(REPO)}")
    publish("trigger", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
