"""Issue 16.11: a `kill -9` of `ragline serve` during an ingestion blocked ingestion for good (the
flow-run process orphaned and hung; the run stayed RUNNING in Prefect, holding the deployment's
concurrency slot, so /v1/ingest answered 409 and every scheduled run was cancelled). Against a real
Prefect server, with serve and its flow runs as real processes."""
from __future__ import annotations

import os
import signal
import textwrap
import time

import httpx
import psutil
import pytest

from tests.integration.serving import (
    AUTH,
    FINAL,
    _create_flow_run,
    _deployment,
    _start,
    _stop,
    _wait_status,
)

pytestmark = pytest.mark.integration

PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: crash}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  crash_index:
    kind: ingestion
    schedule: {cron: "0 4 * * *"}
    steps:
      - {id: load,  task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed}
      - {id: write, task: index}
"""


def _flow_run(prefect_api: str, run_id: str) -> dict:
    return httpx.get(f"{prefect_api}/flow_runs/{run_id}", timeout=30).json()


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_serve_takes_its_flow_runs_along_and_the_next_serve_crashes_their_runs(prefect_api, tmp_path):
    from ragline.flows.spec.compile import load_project

    project = tmp_path / "pipelines.yaml"
    project.write_text(textwrap.dedent(PIPELINES))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "zebrafish.md").write_text("# Zebrafish\n\nZebrafish regenerate their fins.\n")
    serve, _ = _start(project, prefect_api, tmp_path / "serve-1.log")
    try:
        deployment_id = _deployment(prefect_api, "crash_index")["id"]
        # A writer outside Prefect holds the index: the deployment's run starts and waits for it.
        with load_project(project).resource("state").lease("manual rebuild"):
            run_id = _create_flow_run(prefect_api, deployment_id, {})
            run = _until(lambda: (r := _flow_run(prefect_api, run_id))["state"]["type"] == "RUNNING" and r,
                         180, "the run started")
            # the run's process, forked by serve's forkserver (flows/serve/supervise/warm.py), which serve started
            host, _, pid = run["infrastructure_pid"].rpartition(":")
            flow_run = psutil.Process(int(pid))
            forkserver = flow_run.parent()
            assert host == os.uname().nodename and forkserver.parent().pid == serve.pid
            assert "multiprocessing.forkserver" in " ".join(forkserver.cmdline())
            os.kill(serve.pid, signal.SIGKILL)
            serve.wait()
            _until(lambda: not _running(flow_run) and not _running(forkserver), 10,
                   "the flow-run process and the forkserver died with serve")
        assert _flow_run(prefect_api, run_id)["state"]["type"] == "RUNNING"  # nobody could report it

        serve, url = _start(project, prefect_api, tmp_path / "serve-2.log")
        crashed = _flow_run(prefect_api, run_id)
        assert crashed["state"]["type"] == "CRASHED" and "flow-run process" in crashed["state"]["message"]
        assert f"({run_id}) marked Crashed" in (tmp_path / "serve-2.log").read_text()
        # Ingestion is not blocked: the API accepts a run and the deployment's limit lets it run.
        accepted = httpx.post(f"{url}/v1/ingest", json={"pipeline": "crash_index"}, headers=AUTH, timeout=30)
        assert accepted.status_code == 202, accepted.text
        status = _wait_status(url, accepted.json()["run_id"], FINAL, timeout=300)
        assert status["state"] == "COMPLETED" and status["summary"].startswith("added 1"), status
    finally:
        _stop(serve)
