"""Helpers of the `ragline serve` integration modules: the served project, starting and stopping
`ragline serve` in a subprocess, and its deployments and runs over the Prefect REST API."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.helpers import pipelines
from tests.helpers.data import REPO, scifact_records, write_jsonl
from tests.helpers.net import free_port

TOKEN = "serve-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

PIPELINES = ("resources:\n" + pipelines.EMBEDDER + pipelines.index_resources()
             + pipelines.index_resources("notes_", "notes") + "\npipelines:\n"
             + pipelines.ingestion("index", "[docs]", head="    schedule: {interval_seconds: 30}\n")
             + pipelines.ingestion("notes", "[notes]", "notes_",
                                   head='    schedule: {cron: "0 3 * * *", timezone: Europe/Berlin}\n')
             + pipelines.served_search(k=10, top_k=5))


def served_project(root: Path) -> Path:
    """The served project in ``root``: SciFact records and a note in docs/, notes/ (one empty)."""
    write_jsonl(root / "docs" / "corpus.jsonl", scifact_records(12))
    (root / "docs" / "zebrafish.md").write_text("# Zebrafish\n\nZebrafish regenerate their fins and heart.\n")
    (root / "notes").mkdir()
    (root / "notes" / "alpha.md").write_text("# Alpha\n\nAlpha notes about telomerase in stem cells.\n")
    (root / "notes" / "empty.md").write_text("")  # reported as a failure, the run goes on
    path = root / "pipelines.yaml"
    path.write_text(textwrap.dedent(PIPELINES))
    return path


SERVE = ("import sys; from ragline.flows.serve.supervise.service import serve; "
         "sys.exit(serve(sys.argv[1], port=int(sys.argv[2]), token=sys.argv[3], api=sys.argv[4] == '1'))")


def _start(project: Path, prefect_api: str, log: Path, api: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PREFECT_API_URL=prefect_api, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(log.parent / "prefect-client"), PYTHONPATH=str(REPO))
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-c", SERVE, str(project), str(port), TOKEN, "1" if api else "0"],
                                   cwd=project.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ragline serve exited with {process.returncode}: {log.read_text()[-3000:]}")
        if "ragline serve: Prefect API" in log.read_text(errors="replace"):
            return process, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    _stop(process)
    raise TimeoutError(f"ragline serve did not start: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def serving(project: Path, prefect_api: str) -> Iterator[str]:
    """`ragline serve` on ``project`` (its log beside it, serve.log) for the life of the block: its API's URL."""
    process, url = _start(project, prefect_api, project.parent / "serve.log")
    try:
        yield url
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _prefect_get(url: str, attempts: int = 6) -> httpx.Response:
    """GET from the Prefect API; no answer within 30 s or a 5xx (SQLite busy under the scheduler on a
    loaded 2-core CI machine) is asked again, as Prefect's own client does; the last answer returned."""
    for attempt in range(attempts):
        try:
            response = httpx.get(url, timeout=30)
        except httpx.TimeoutException:
            if attempt == attempts - 1:
                raise
            continue
        if response.status_code < 500 or attempt == attempts - 1:
            return response
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def _deployment(prefect_api: str, pipeline: str) -> dict:
    response = _prefect_get(f"{prefect_api}/deployments/name/ragline/{pipeline}")
    response.raise_for_status()
    return response.json()


def _create_flow_run(prefect_api: str, deployment_id: str, body: dict) -> str:
    """POST create_flow_run; a 5xx or no answer within 30 s (SQLite busy under the scheduler on a
    loaded 2-core CI machine) is retried, as Prefect's own client does, under one idempotency key
    (a retried request that did create its run gets that run, not a second one); any other answer
    fails with its body."""
    url = f"{prefect_api}/deployments/{deployment_id}/create_flow_run"
    body = {"idempotency_key": uuid.uuid4().hex, **body}
    for attempt in range(6):
        try:
            created = httpx.post(url, json=body, timeout=30)
        except httpx.TimeoutException:
            if attempt == 5:
                raise
            continue
        if created.status_code < 500:
            break
        time.sleep(1 + attempt)
    assert created.status_code in (200, 201), f"{created.status_code}: {created.text}"
    return created.json()["id"]


def _wait_flow_run(prefect_api: str, run_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    run: dict = {"state": "not read yet"}
    while time.monotonic() < deadline:
        try:  # a starved Prefect server may answer one poll late or with a 5xx: the deadline decides
            response = httpx.get(f"{prefect_api}/flow_runs/{run_id}", timeout=30)
        except httpx.TimeoutException:
            continue
        if response.status_code >= 500:
            time.sleep(1)
            continue
        run = response.json()
        if run["state"]["type"] in FINAL:
            return run
        time.sleep(0.5)
    raise TimeoutError(f"flow run {run_id} did not finish: {run['state']}")


def _wait_status(served: str, run_id: str, until: set[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    status: dict = {"state": "not read yet"}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{served}/v1/runs/{run_id}", headers=AUTH, timeout=30)
        if answer.status_code == 503 and answer.json()["error"]["code"] == "prefect_unavailable":
            time.sleep(1)  # a Prefect server starved by the run: the API says so within its deadline
            continue
        status = answer.json()
        if status["state"] in until:
            return status
        time.sleep(0.3)
    raise TimeoutError(f"run {run_id} never reached {until}: {status}")
