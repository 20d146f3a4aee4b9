"""Issue 39 items 1, 2 and 7 against `ragline serve --start-prefect` as an operator runs it, over
the real Prefect REST API:

- the Prefect API it starts refuses a client without the secret kept 0600 beside its database (401),
  while serve's runner, its flow-run processes and its HTTP API all reach it;
- a job pipeline that declares no schedule has no deployment (nothing to start on that API);
- a query event names neither the principal nor the documents returned;
- a query deployment run with an unknown top-level parameter ends Failed, naming it (not CRASHED)."""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.helpers import pipelines
from tests.helpers.data import REPO
from tests.helpers.net import free_port
from tests.integration.serving import FINAL

pytestmark = pytest.mark.integration

TOKEN = "prefect-security-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PRIVATE = "OKAPI-HR-4412"

PIPELINES = ("resources:\n" + pipelines.EMBEDDER + pipelines.index_resources() + "\npipelines:\n"
             + pipelines.ingestion("index", '[docs, {path: hr, access: [{prefix: "", groups: [hr]}]}]')
             + pipelines.served_search(k=5, top_k=3) + pipelines.pipeline(
                 "tune", "id: pairs, task: pseudo_queries, uses: {state: state}", "id: tune,  task: tune_retrieval",
                 kind="job"))


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`ragline serve --start-prefect` in its own process; its HTTP API, its Prefect API and the home
    that holds the Prefect server's database and secret."""
    root = tmp_path_factory.mktemp("prefect-security")
    (root / "docs").mkdir()
    (root / "docs" / "fins.md").write_text("# Fins\n\nZebrafish regenerate their fins and heart.\n")
    (root / "hr").mkdir()
    (root / "hr" / "salaries.md").write_text(f"# Salaries\n\nThe {PRIVATE} salary band of the okapi team.\n")
    (root / "pipelines.yaml").write_text(textwrap.dedent(PIPELINES))
    home = root / "ragline-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "RAGLINE_SERVE_JOBS"}
    env.update(RAGLINE_HOME=str(home), PREFECT_HOME=str(root / "prefect-client"), RAGLINE_API_TOKEN=TOKEN,
               PREFECT_PROFILES_PATH=str(root / "profiles.toml"), PYTHONPATH=str(REPO),
               OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    port, log = free_port(), root / "serve.log"
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-c", "import sys; from ragline.flows.cli import main; "
                                    "sys.exit(main())", "serve", "--start-prefect", "--port", str(port)],
                                   cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        prefect = _wait_started(process, log)
        yield {"api": f"http://127.0.0.1:{port}", "prefect": prefect, "home": home / "prefect", "log": log}
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_started(process: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if process.poll() is not None:
            raise RuntimeError(f"ragline serve exited with {process.returncode}: {text[-3000:]}")
        if "ragline serve: Prefect API" in text:
            return re.search(r"Prefect server on (http://\S+/api)", text).group(1)
        time.sleep(0.5)
    raise TimeoutError(f"ragline serve did not start: {log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def prefect(serve) -> httpx.Client:
    """A client of the Prefect API with the secret, as `PREFECT_API_AUTH_STRING` makes Prefect's own."""
    secret = (serve["home"] / "api-auth").read_text().strip()
    basic = base64.b64encode(secret.encode()).decode()
    with httpx.Client(base_url=serve["prefect"], headers={"Authorization": f"Basic {basic}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def indexed(serve):
    """The index written by a deployment run that `POST /v1/ingest` started: serve's HTTP API, its
    runner and the run's own process all reached the authenticated Prefect API."""
    started = httpx.post(f"{serve['api']}/v1/ingest", json={"pipeline": "index"}, headers=AUTH, timeout=120)
    assert started.status_code == 202, started.text
    status = _wait(lambda: httpx.get(f"{serve['api']}/v1/runs/{started.json()['run_id']}", headers=AUTH,
                                     timeout=60).json(), lambda s: s["state"] in FINAL)
    assert status["state"] == "COMPLETED", status
    return status


def _wait(read, done, timeout: float = 300, pause: float = 1.0):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(pause)
    raise TimeoutError(f"still {value}")


def test_the_prefect_api_refuses_a_client_without_the_secret(serve):
    anonymous = httpx.Client(base_url=serve["prefect"], timeout=60)
    guessed = {"Authorization": "Basic " + base64.b64encode(b"ragline:guess").decode()}
    for method, path, body in [("POST", f"/deployments/{uuid.uuid4()}/create_flow_run", {}),
                               ("POST", "/events/filter", {}), ("POST", "/flow_runs/filter", {}),
                               ("GET", "/deployments/name/ragline/search", None)]:
        for headers in ({}, guessed):
            answer = anonymous.request(method, path, json=body, headers=headers)
            assert answer.status_code == 401, (method, path, answer.status_code, answer.text)
    assert anonymous.get("/health").status_code == 200  # Prefect keeps the health probe open
    secret = serve["home"] / "api-auth"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert "api-auth" in serve["log"].read_text()  # serve says where the secret is
    basic = base64.b64encode(secret.read_text().strip().encode()).decode()
    search = anonymous.get("/deployments/name/ragline/search", headers={"Authorization": f"Basic {basic}"})
    assert search.status_code == 200, search.text


def test_a_job_without_a_schedule_has_no_deployment(serve, prefect):
    assert prefect.get("/deployments/name/ragline/tune").status_code == 404
    assert "job pipeline(s) tune not deployed" in serve["log"].read_text()


def test_query_events_name_no_documents_and_no_principal(serve, prefect, indexed):
    answer = httpx.post(f"{serve['api']}/v1/query", json={"question": f"{PRIVATE} salary band", "pipeline": "search"},
                        headers=AUTH, timeout=120)
    assert answer.status_code == 200 and PRIVATE in answer.text, answer.text  # the operator reads hr/
    body = {"filter": {"event": {"name": ["ragline.query.completed"]}}, "limit": 50}
    events = _wait(lambda: prefect.post("/events/filter", json=body).json()["events"], bool)
    payload = events[0]["payload"]
    assert "returned" not in payload and "principal" not in payload, payload
    assert payload["returned_count"] >= 1
    assert "salaries" not in json.dumps(events) and "legacy-token" not in json.dumps(events)


def test_an_unknown_top_level_parameter_fails_the_run_naming_it(serve, prefect, indexed):
    search = prefect.get("/deployments/name/ragline/search").json()["id"]
    runs = {}
    for name, parameters in {"evil": {"inputs": {"query": "fins"}, "evil": 1},
                             "plain": {"inputs": {"query": "zebrafish fins"}}}.items():
        body = {"parameters": parameters, "idempotency_key": uuid.uuid4().hex}
        # Prefect answers 503 while its SQLite database is busy (a loaded machine); the same
        # idempotency key makes the retry safe, as Prefect's own client retries a 503.
        created = _wait(lambda: prefect.post(f"/deployments/{search}/create_flow_run", json=body),
                        lambda answer: answer.status_code != 503, timeout=120, pause=2.0)
        assert created.status_code in (200, 201), created.text
        runs[name] = created.json()["id"]
    final = {name: _wait(lambda: prefect.get(f"/flow_runs/{run}").json(), lambda r: r["state"]["type"] in FINAL)
             for name, run in runs.items()}
    assert final["plain"]["state"]["type"] == "COMPLETED", final["plain"]["state"]
    state = final["evil"]["state"]
    assert state["type"] == "FAILED", state
    assert "refuses parameter 'evil'" in state["message"], state["message"]
