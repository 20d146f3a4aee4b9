"""`ragline serve` against a real Prefect server (all services, scheduler included): deployments,
REST-triggered query runs with JSON results, a schedule firing by itself, POST /v1/ingest with its
409, and a clean stop on SIGTERM / Ctrl-C. The served process is a subprocess, as in production."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.data import REPO
from tests.integration.serving import (AUTH, FINAL, PIPELINES, _create_flow_run, _deployment, _start, _stop, _wait_flow_run,
                                        _wait_status, served_project)

pytestmark = pytest.mark.integration


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prefect_api(own_prefect_api):
    """A server of this module's own: the dashboard test reads the Event Feed, which keeps every event
    the server got (events cannot be deleted), so another module's query events would pass it."""
    return own_prefect_api


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return served_project(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def served(project, prefect_api):
    """`ragline serve` on the project (the `index` pipeline's data indexed beforehand)."""
    from tests.helpers.harness import run_index

    run_index(project)  # in-process, no Prefect: the query tests need passages
    stale = project.parent / ".ragline" / "results" / "stale-result.json"  # a result 40 days old: pruned
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}")
    os.utime(stale, (time.time() - 40 * 86400,) * 2)
    log = project.parent / "serve.log"
    process, url = _start(project, prefect_api, log)
    try:
        yield url
    finally:
        _stop(process)


# ----------------------------------------------------------------------------- tests
def test_serve_creates_one_deployment_per_pipeline(served, prefect_api, project):
    from ragline.flows.run.steps import digest_of

    index, notes, search = (_deployment(prefect_api, name) for name in ("index", "notes", "search"))
    for name, deployment in (("index", index), ("notes", notes), ("search", search)):
        assert deployment["name"] == name
        assert deployment["parameters"] == {"pipeline": name, "file": str(project.resolve()),
                                            "digest": digest_of(project)}  # the copy serve pinned
        assert deployment["paused"] is False
        assert deployment["entrypoint"] == "ragline.flows.run.entrypoints.run_pipeline"
    [interval] = index["schedules"]
    assert interval["schedule"]["interval"] == 30 and interval["active"] and interval["slug"] == "every 30 s"
    [cron] = notes["schedules"]
    assert cron["schedule"]["cron"] == "0 3 * * *" and cron["schedule"]["timezone"] == "Europe/Berlin"
    assert cron["slug"] == "0 3 * * * (Europe/Berlin)"  # the name the dashboard shows
    for ingestion in (index, notes):  # one run at a time; a run due meanwhile is cancelled, not queued
        assert ingestion["global_concurrency_limit"]["limit"] == 1
        assert ingestion["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert search["schedules"] == [] and search["global_concurrency_limit"] is None


def test_results_older_than_30_days_are_pruned_at_start(served, project):
    assert not (project.parent / ".ragline" / "results" / "stale-result.json").exists()
    assert "removed 1 result file(s) older than 30 days" in (project.parent / "serve.log").read_text()


def test_query_deployment_triggered_over_rest_returns_json(served, prefect_api, project):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deployment_id = _deployment(prefect_api, "search")["id"]
    body = {"parameters": {"inputs": {"query": {"text": "zebrafish fin regeneration"}}}}
    run = _wait_flow_run(prefect_api, _create_flow_run(prefect_api, deployment_id, body))
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"] == "search"
    # The REST API holds a reference: a plain JSON file on the serving host.
    data = run["state"]["data"]
    assert data["serializer"]["type"] == "json"
    assert Path(data["storage_key"]).parent == project.parent / ".ragline" / "results"
    passages = json.loads(Path(data["storage_key"]).read_text())
    assert passages and any("Zebrafish" in p["text"] for p in passages)
    # Prefect's client reads the same value.
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        assert client.read_flow_run(run["id"]).state.result() == passages
    # ragline's API returns it, and names neither the pipelines file nor the data dir.
    status = httpx.get(f"{served}/v1/runs/{run['id']}", headers=AUTH, timeout=30).json()
    assert (status["pipeline"], status["kind"], status["state"]) == ("search", "query", "COMPLETED")
    assert status["result"] == passages and status["started"] and status["ended"]
    text = json.dumps(status)
    assert str(project) not in text and str(project.parent / "idx") not in text and ".ragline" not in text


def test_interval_schedule_fires_by_itself(served, prefect_api):
    deployment_id = _deployment(prefect_api, "index")["id"]
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        body = {"deployments": {"id": {"any_": [deployment_id]}}, "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
        runs = httpx.post(f"{prefect_api}/flow_runs/filter", json=body, timeout=30).json()
        if runs:
            assert "auto-scheduled" in runs[0]["tags"]
            status = httpx.get(f"{served}/v1/runs/{runs[0]['id']}", headers=AUTH, timeout=30).json()
            assert status["state"] == "COMPLETED" and status["summary"].startswith("added ")
            assert status["result"]["failed"] == 0
            metrics = httpx.get(f"{served}/metrics", headers=AUTH, timeout=30).text  # the run noted its success
            assert 'ragline_ingestion_last_success_timestamp_seconds{pipeline="index",trigger="scheduled"}' in metrics
            return
        time.sleep(2)
    pytest.fail("no scheduled run of 'index' completed")


def test_ingest_over_the_api_is_a_job_with_a_409_while_it_runs(served, prefect_api, project):
    from ragline.flows.spec.compile import load_project

    for bad, code in (({"pipeline": "search"}, 400), ({"pipeline": "nope"}, 404)):
        assert httpx.post(f"{served}/v1/ingest", json=bad, headers=AUTH, timeout=30).status_code == code
    assert httpx.post(f"{served}/v1/ingest", json={"pipeline": "notes"}, timeout=30).status_code == 401
    deployment_id = _deployment(prefect_api, "notes")["id"]

    def ingest() -> httpx.Response:
        return httpx.post(f"{served}/v1/ingest", json={"pipeline": "notes"}, headers=AUTH, timeout=30)

    def trigger() -> str:  # straight on Prefect's API, as a schedule or another client would
        return _create_flow_run(prefect_api, deployment_id, {})

    # A writer outside Prefect holds the index: the API refuses, naming it; a deployment run waits for it.
    with load_project(project).resource("notes_state").lease("manual rebuild"):
        busy = ingest()
        assert busy.status_code == 409 and "manual rebuild" in busy.json()["error"]["message"]
        waiting = trigger()
        status = _wait_status(served, waiting, {"RUNNING"})
        assert status["progress"] is not None and "batches_written" in status["progress"]
        # A second run of the deployment is cancelled by its concurrency limit, not queued.
        extra = _wait_flow_run(prefect_api, trigger())
        assert extra["state"]["type"] == "CANCELLED" and "concurrency" in extra["state"]["message"].lower()
        busy = ingest()
        assert busy.status_code == 409 and waiting in busy.json()["error"]["message"]
    status = _wait_status(served, waiting, FINAL)
    assert status["state"] == "COMPLETED", status
    assert status["summary"].startswith("added 1, updated 0, deleted 0, unchanged 0, failed 1")
    [failure] = status["failures"]
    assert failure["source_id"] == "notes/empty.md" and failure["stage"] == "load"  # below its root (issue 15.4)
    assert status["result"]["added"] == 1 and status["message"] is None
    assert str(project) not in json.dumps(status) and str(project.parent) not in json.dumps(status)

    first = ingest()
    assert first.status_code == 202, first.text
    run_id = first.json()["run_id"]
    assert first.json()["pipeline"] == "notes" and first.json()["state"] == "SCHEDULED"
    second = ingest()
    assert second.status_code == 409 and run_id in second.json()["error"]["message"]
    status = _wait_status(served, run_id, FINAL)
    assert status["state"] == "COMPLETED" and status["summary"].startswith("added 0, updated 0, deleted 0, unchanged 1")
    assert httpx.get(f"{served}/v1/runs/{'0' * 32}", headers=AUTH, timeout=30).status_code == 404

    # GET /v1/runs lists them newest first, filtered by pipeline and state, without results.
    listed = httpx.get(f"{served}/v1/runs", params={"pipeline": "notes", "state": "completed", "limit": 2},
                       headers=AUTH, timeout=30)
    assert listed.status_code == 200, listed.text
    runs = listed.json()["runs"]
    assert [r["id"] for r in runs] == [run_id, waiting] and all(r["pipeline"] == "notes" for r in runs)
    assert runs[0]["state"] == "COMPLETED" and "result" not in runs[0]
    everything = httpx.get(f"{served}/v1/runs", params={"pipeline": "notes"}, headers=AUTH, timeout=30).json()["runs"]
    assert [r["id"] for r in everything][:3] == [run_id, extra["id"], waiting]  # none scheduled for later
    later = httpx.get(f"{served}/v1/runs", params={"pipeline": "notes", "state": "scheduled"}, headers=AUTH,
                      timeout=30).json()["runs"]
    assert later and all(r["state"] == "SCHEDULED" for r in later)  # the schedule's next runs
    cancelled = httpx.get(f"{served}/v1/runs", params={"pipeline": "notes", "state": "cancelled"}, headers=AUTH,
                          timeout=30).json()["runs"]
    assert [r["id"] for r in cancelled] == [extra["id"]]
    assert httpx.get(f"{served}/v1/runs", params={"state": "DONE"}, headers=AUTH, timeout=30).status_code == 400
    assert httpx.get(f"{served}/v1/runs", params={"pipeline": "nope"}, headers=AUTH, timeout=30).status_code == 400
    assert httpx.get(f"{served}/v1/runs", timeout=30).status_code == 401


PROBE = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: probe}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  PROBE_index:
    kind: ingestion
    schedule: {cron: "0 4 * * *"}
    steps:
      - {id: load,  task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed}
      - {id: write, task: index}
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
def test_stops_cleanly_on_a_signal(prefect_api, tmp_path, sig, code):
    name = f"probe_{sig.name.lower()}"  # its own deployment: the served project's are left alone
    project = tmp_path / "pipelines.yaml"
    project.write_text(textwrap.dedent(PROBE).replace("PROBE", name))
    log = tmp_path / "serve.log"
    process, url = _start(project, prefect_api, log, api=sig == signal.SIGTERM)
    assert _deployment(prefect_api, f"{name}_index")["paused"] is False
    if sig == signal.SIGTERM:
        assert httpx.get(f"{url}/v1/runs/{'0' * 32}", headers=AUTH, timeout=30).status_code == 404
    started = time.monotonic()
    process.send_signal(sig)
    try:
        assert process.wait(20) == code
    finally:
        _stop(process)
    elapsed = time.monotonic() - started
    output = log.read_text(errors="replace")
    assert elapsed < 10, f"took {elapsed:.1f} s to stop"
    assert "Traceback" not in output, output[-3000:]
    assert "ragline serve: stopped" in output
    assert _deployment(prefect_api, f"{name}_index")["paused"] is True  # pause_on_shutdown: no Late pile-up


def test_a_second_file_never_takes_over_the_first_files_deployments(served, prefect_api, project, tmp_path):
    """Two pipelines files, one Prefect server: the same pipeline names would update the first file's
    deployments in place (both runners would then run the second file). Refused, naming both files;
    with its own deployment_prefix the second file serves beside the first."""
    other = tmp_path / "pipelines.yaml"
    other.write_text(textwrap.dedent(PIPELINES))
    with pytest.raises(RuntimeError, match="exited with 2") as refused:
        _start(other, prefect_api, tmp_path / "refused.log")
    message = str(refused.value)
    assert f"'ragline/index' serves {project.resolve()}, not {other.resolve()}" in message
    assert "deployment_prefix" in message
    assert _deployment(prefect_api, "index")["parameters"]["file"] == str(project.resolve())  # untouched

    other.write_text("settings: {deployment_prefix: other-}\n" + textwrap.dedent(PIPELINES))
    process, _ = _start(other, prefect_api, tmp_path / "prefixed.log", api=False)
    try:
        assert _deployment(prefect_api, "other-index")["parameters"]["file"] == str(other.resolve())
        assert _deployment(prefect_api, "index")["parameters"]["file"] == str(project.resolve())
    finally:
        _stop(process)


def test_redactor_hides_the_file_and_the_data_dir(project):
    from ragline.flows.serve.ingestion_runs import Redactor
    from ragline.flows.spec.compile import load_project

    loaded = load_project(project)
    redact = Redactor(loaded)
    base = project.parent
    message = (f"the index at {base / 'idx'} is being written; see {project} and {base / '.ragline' / 'results'}/x; "
               f"skipped {base / 'docs' / 'a.md'} and /etc/passwd")
    hidden = redact(message)
    assert str(project) not in hidden and str(base / "idx") not in hidden and "/etc/passwd" not in hidden
    assert str(base / "docs" / "a.md") in hidden  # a configured source stays readable


# ----------------------------------------------------------------------------- the dashboard
CHROMIUM = os.environ.get("RAGLINE_CHROMIUM", "/usr/bin/chromium")
DASHBOARD_PNG = REPO / "docs" / "img" / "dashboard.png"
NEW_DOCUMENT = "# Axolotl\n\nThe axolotl regrows whole limbs, its spinal cord and parts of its brain.\n"


def _post_json(url: str, body: dict) -> list | dict | None:
    """POST to Prefect's API; None when it does not answer in time (SQLite busy on a loaded machine)."""
    try:
        response = httpx.post(url, json=body, timeout=30)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def _stored_event(prefect_api: str, name: str, timeout: float = 120) -> dict:
    """The newest event called ``name`` once Prefect's server has stored it (events arrive over a
    websocket, batched: the dashboard shows only what is stored when it asks)."""
    body = {"filter": {"event": {"name": [name]}}, "limit": 1}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page = _post_json(f"{prefect_api}/events/filter", body)
        if page and page["events"]:
            return page["events"][0]
        time.sleep(1)
    pytest.fail(f"Prefect's server stored no {name!r} event within {timeout:.0f} s")


def _scheduled_run_that_ingested(prefect_api: str, served: str, pipeline: str, since: float,
                                 timeout: float = 300) -> dict:
    """The first completed run the schedule started after `since` (a Unix time) that added a
    document: its task runs are then every step of the pipeline, not only load and the plan."""
    deployment_id = _deployment(prefect_api, pipeline)["id"]
    after = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since - 60))  # a run may start before its load step
    body = {"deployments": {"id": {"any_": [deployment_id]}},
            "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}, "tags": {"all_": ["auto-scheduled"]},
                          "start_time": {"after_": after}},
            "sort": "START_TIME_DESC", "limit": 5}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run in _post_json(f"{prefect_api}/flow_runs/filter", body) or []:
            status = httpx.get(f"{served}/v1/runs/{run['id']}", headers=AUTH, timeout=60).json()
            if (status.get("result") or {}).get("added", 0) >= 1:
                return run
        time.sleep(2)
    pytest.fail(f"no scheduled run of {pipeline!r} ingested the new document within {timeout:.0f} s")


def _visible_text(page, path: str, *expected: str, timeout: float = 90) -> str:
    """Open a dashboard page (a single-page app that fills itself in) and wait for every text."""
    page.goto(path)
    deadline = time.monotonic() + timeout
    while True:
        text = page.inner_text("body")
        if all(e in text for e in expected) or time.monotonic() > deadline:
            return text
        page.wait_for_timeout(500)


def test_the_dashboard_shows_scheduled_runs_their_task_runs_the_schedule_and_query_events(served, prefect_api, project):
    """Prefect's own dashboard (served by the same server) in headless Chromium, as a user opens it:
    a run the 30 s schedule started by itself, with a task run per step, the schedule, the query event."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    # Something new to ingest: the next scheduled run of `index` loads, converts, chunks, embeds and writes it.
    since = time.time()
    (project.parent / "docs" / "axolotl.md").write_text(NEW_DOCUMENT)
    # The API's first query loads the embedder in the serving process: minutes on a loaded 2-core machine.
    answered = httpx.post(f"{served}/v1/query", headers=AUTH, timeout=300,
                          json={"question": "zebrafish fin regeneration", "pipeline": "search"})
    assert answered.status_code == 200, answered.text
    deployment = _deployment(prefect_api, "index")
    root = prefect_api.removesuffix("/api")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)

            # the deployment page lists its schedule (by slug) and the next run it has scheduled
            shown = ("Schedules", deployment["schedules"][0]["slug"], "Scheduled for")
            schedule = _visible_text(page, f"{root}/deployments/deployment/{deployment['id']}", *shown)
            assert all(s in schedule for s in shown), schedule[:3000]

            # the Event Feed, filtered to query events as a user filters it (unfiltered, the 30 s
            # schedule's task-run events push the query's off the first page): the pipeline it ran
            _stored_event(prefect_api, "ragline.query.completed")
            feed = _visible_text(page, f"{root}/events?events=ragline.query.completed", "ragline.query.completed",
                                 "ragline.pipeline.search")
            assert "ragline.query.completed" in feed and "ragline.pipeline.search" in feed, feed[:3000]

            run = _scheduled_run_that_ingested(prefect_api, served, "index", since)
            runs = _visible_text(page, f"{root}/runs", "ragline", "index", "auto-scheduled", "Completed")
            assert all(s in runs for s in ("ragline", "index", "auto-scheduled", "Completed")), runs[:3000]

            # the run's page, Task Runs tab: one task run per step (and batch), all completed
            _visible_text(page, f"{root}/runs/flow-run/{run['id']}", "Task Runs", "auto-scheduled")
            page.get_by_text("Task Runs", exact=True).first.click()
            steps = ("load", "write.plan", "write.pending[page 1]", "load.read[batch 0]", "convert[batch 0]",
                     "chunk[batch 0]", "embed[batch 0]", "write[batch 0]", "write.finalize")
            deadline = time.monotonic() + 90
            while not all(page.get_by_text(s, exact=True).count() for s in steps) and time.monotonic() < deadline:
                page.wait_for_timeout(500)
            task_runs = page.inner_text("body")
            assert all(step in task_runs for step in steps), task_runs[:3000]
            assert "9 Task runs" in task_runs and "(9 Completed)" in task_runs, task_runs[:3000]
            if os.environ.get("RAGLINE_SCREENSHOTS") == "1":  # the README's picture
                DASHBOARD_PNG.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(DASHBOARD_PNG))
        finally:
            browser.close()


def test_a_store_damaged_under_serve_is_repaired_by_one_ingest_run(served, project):
    """Issue 40.1 through the served path: the notes' chunk rows deleted from their state while serve
    runs (their vectors stay in the managed Chroma server); one `/v1/ingest` run, a real deployment
    run as a schedule starts it, re-embeds the note and counts it as repaired, not as unchanged."""
    import sqlite3

    with sqlite3.connect(project.parent / "idx" / "notes_state.sqlite") as db:
        db.execute("DELETE FROM chunks")
    started = httpx.post(f"{served}/v1/ingest", json={"pipeline": "notes"}, headers=AUTH, timeout=30)
    assert started.status_code == 202, started.text
    status = _wait_status(served, started.json()["run_id"], FINAL)
    assert status["state"] == "COMPLETED", status
    assert "unchanged 0" in status["summary"] and "1 sources repaired" in status["summary"], status["summary"]
    with sqlite3.connect(project.parent / "idx" / "notes_state.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0] > 0
    again = httpx.post(f"{served}/v1/ingest", json={"pipeline": "notes"}, headers=AUTH, timeout=30)
    status = _wait_status(served, again.json()["run_id"], FINAL)
    assert status["summary"].startswith("added 0, updated 0, deleted 0, unchanged 1"), status["summary"]
