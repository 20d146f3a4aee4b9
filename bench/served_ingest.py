"""One changed document under ``ragline serve``, end to end (issue 22): edit a file of a watched
corpus, trigger the ``index`` deployment over Prefect's REST API, wait for the run's result.

What a team's scheduled re-index costs when little changed: the runner's pick-up, the flow-run
process, Prefect's orchestration and the engine's incremental run, which lists what changed from the
change journal that serve's folder watcher keeps (flows/sources/journal.py). The corpus and pipeline
are bench/scale.py's (SciFact abstracts as markdown files, the real loader, chunker, Chroma, BM25
and state, the hash stand-in embedder, so no model load is timed). Measured under two serves in one
invocation, the same edits in each: flow runs started warm (forked from serve's forkserver,
flows/serve/supervise/warm.py: the default) and cold (``--cold-runs``: a fresh interpreter per run, Prefect's
way); the baseline is the same one-change run in-process (``engine.run``), measured in the same
invocation.

Usage: .venv/bin/python bench/served_ingest.py [--docs 5000] [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import REPO, publish, save
from deployment_trigger import run_deployment, seconds_between, start_serve
from scale import PIPELINES, abstracts, age, document, write_corpus

def trigger(client: httpx.Client, deployment_id: str) -> dict:
    """One run of the index deployment: its times and its report."""
    started = time.perf_counter()
    run = run_deployment(client, deployment_id, {})
    report = json.loads(Path(run["state"]["data"]["storage_key"]).read_text())
    return {"total": time.perf_counter() - started, "report": report,
            "pickup": seconds_between(run["expected_start_time"], run["start_time"]),
            "run": seconds_between(run["start_time"], run["end_time"])}


def edit(docs: Path, i: int, note: str, source: list) -> Path:
    path = docs / "f000" / f"d{i:06d}.md"
    path.write_text(document(i, source, f" {note}"))
    age(path, 1800)
    return path


def served_runs(project: Path, docs: Path, runs: int, warm: bool, first: int) -> list[dict]:
    """Under one serve: a first run (it lists the corpus in full and vouches for the journal), then
    ``runs`` runs that each follow one edited document."""
    from ragline.flows.serve.supervise.service import start_prefect_server
    from ragline.flows.sources.journal import Journal, journal_file

    source = abstracts()
    journal = Journal(journal_file(project.parent, "index", str(docs)))
    with tempfile.TemporaryDirectory() as home:
        server = start_prefect_server(Path(home) / "prefect", auth=False)  # a throwaway harness server, plain HTTP
        serve = start_serve(project, server.api_url, 2.0, Path(home) / "serve.log", warm,
                            env={"PYTHONPATH": str(REPO)})  # the stand-in embedder is in tests/
        try:
            with httpx.Client(base_url=server.api_url, timeout=60) as client:
                deployment_id = client.get("/deployments/name/ragline/index").json()["id"]
                deadline = time.monotonic() + 120
                while (watch := journal.watch()) is None or not watch.live(time.time()):
                    if time.monotonic() > deadline:
                        raise RuntimeError("serve's folder watcher did not start")
                    time.sleep(0.2)
                trigger(client, deployment_id)  # listed in full: vouches for the journal
                measured = []
                for i in range(first, first + runs):
                    changed = str(edit(docs, i, f"Edited {'warm' if warm else 'cold'}.", source).resolve())
                    while changed not in journal.changes():
                        time.sleep(0.05)
                    measured.append(trigger(client, deployment_id))
                    if measured[-1]["report"].get("updated") != 1:
                        raise RuntimeError(f"expected one updated document: {measured[-1]['report']}")
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
            server.stop()
    return measured


def in_process(project: Path, docs: Path, runs: int, first: int) -> list[float]:
    """The same one-change run in this process's engine (no Prefect), listed in full."""
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    source, times = abstracts(), []
    for i in range(first, first + runs):
        edit(docs, i, "Edited in process.", source)
        started = time.perf_counter()
        engine.run(load_project(project).pipeline("index"), orchestrate=False)
        times.append(time.perf_counter() - started)
    return times


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    with tempfile.TemporaryDirectory(prefix="served-ingest-") as folder:
        work = Path(folder)
        project, docs = work / "pipelines.yaml", work / "docs"
        project.write_text(PIPELINES)
        (work / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
        write_corpus(docs, args.docs)
        started = time.perf_counter()
        engine.run(load_project(project).pipeline("index"), orchestrate=False)
        full = time.perf_counter() - started
        result = {"docs": args.docs, "runs": args.runs, "full_ingest_s": round(full, 1),
                  "load_average": os.getloadavg()[0]}
        for n, mode in enumerate(("cold", "warm")):
            runs = served_runs(project, docs, args.runs, warm=mode == "warm", first=100 * n)
            result[mode] = {key: median([r[key] for r in runs]) for key in ("total", "pickup", "run")}
            print(mode, json.dumps(result[mode]), flush=True)
        result["in_process"] = median(in_process(project, docs, args.runs, first=300))
    path = save("served_ingest", result)
    rows = {"total": "trigger → result (create_flow_run, poll, read the JSON report)",
            "pickup": "of which: waiting for the runner (expected start → start)",
            "run": "of which: the flow run (start → end)"}
    table = ["| one changed document, median | runs start warm (default) | runs start cold (`--cold-runs`) |",
             "|---|---|---|"]
    table += [f"| {label} | {result['warm'][k]:.2f} s | {result['cold'][k]:.2f} s |" for k, label in rows.items()]
    table.append(f"| the same one-change run in-process (`engine.run`, listed in full, baseline) | "
                 f"{result['in_process']:.2f} s | |")
    table.append(f"\n{args.docs:,} documents (`bench/scale.py`'s corpus and pipeline, hash stand-in embedder), "
                 f"{args.runs} runs a serve, each after one edited document, its folder watched by serve "
                 f"(the run lists what changed); load average {result['load_average']:.1f} at the start.")
    print(f"written to {path.relative_to(REPO)}")
    publish("served_ingest", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
