"""Issue 39 item 3: ``GET /v1/runs`` and ``/v1/runs/{id}`` show a job run (tune, adapt, summarize)
only to the ``admin`` scope, and its result only to a credential that reads every document (a
summarize run's result holds community summaries, their member documents and the server's paths).
Real uvicorn, the real Prefect API of this worker, and a real flow run of a job pipeline whose
persisted JSON result is what a summarize run stores."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import httpx
import pytest

from ragline.flows.serve.auth.keys import KeyStore, keys_file
from tests.helpers.api_harness import TOKEN, running
from tests.helpers.collection_specs import PIPELINES, RESOURCES

SECRET = "HELIOTROPE layoff plan, salary 123456 euros"
MEMBERS = ["docs/hr/salaries.md", "docs/hr/layoffs.md"]

JOB = """
  summarize:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("job-runs") / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + PIPELINES + JOB))
    return path


@pytest.fixture(scope="module")
def job_run(project, prefect_server) -> str:
    """A completed flow run of the file's job pipeline, its JSON result persisted as serve persists it."""
    from prefect import flow

    from ragline.flows.serve.layout import results_dir
    from ragline.flows.spec.compile import load_project

    folder = results_dir(load_project(project))
    folder.mkdir(parents=True, exist_ok=True)
    summaries = str(project.parent / "idx" / "summaries.json")

    @flow(name="ragline", flow_run_name="{pipeline}", persist_result=True, result_serializer="json",
          result_storage=folder)
    def ragline(pipeline: str, file: str) -> dict:
        return {"communities": [{"summary": SECRET, "members": MEMBERS}], "path": summaries}

    state = ragline("summarize", str(project.resolve()), return_state=True)
    assert state.is_completed(), state
    return str(state.state_details.flow_run_id)


@pytest.fixture(scope="module")
def served(project, job_run):
    from ragline.flows.serve.supervise.service import api_app

    store = KeyStore(keys_file(project.parent))
    keys = {"query-hr": store.create("query-hr", ["query"], ["*"], groups=["hr"])[1],
            "ingest": store.create("ingest", ["ingest"], ["*"], groups=["hr"])[1],
            "admin-hr": store.create("admin-hr", ["admin"], ["*"], groups=["hr"])[1],
            "operator": TOKEN}
    with running(api_app(project, token=TOKEN)) as url:
        yield url, keys


def _get(url: str, key: str) -> httpx.Response:
    return httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.mark.parametrize("who", ["query-hr", "ingest"])
def test_a_job_run_does_not_exist_for_a_credential_without_admin(served, job_run, who):
    url, keys = served
    one = _get(f"{url}/v1/runs/{job_run}", keys[who])
    assert one.status_code == 404, one.text
    assert SECRET not in one.text and "salaries" not in one.text
    listed = _get(f"{url}/v1/runs", keys[who])
    assert listed.status_code == 200 and job_run not in listed.text, listed.text
    named = _get(f"{url}/v1/runs?pipeline=summarize", keys[who])
    assert named.status_code == 403 and "admin scope" in named.json()["error"]["message"], named.text


def test_an_admin_that_may_not_read_every_document_sees_the_run_not_its_result(served, job_run):
    url, keys = served
    one = _get(f"{url}/v1/runs/{job_run}", keys["admin-hr"])
    assert one.status_code == 200, one.text
    status = one.json()
    assert status["state"] == "COMPLETED" and status["kind"] == "job" and status["result"] is None
    assert "result withheld" in status["message"]
    assert SECRET not in one.text and not any(m in one.text for m in MEMBERS) and "summaries.json" not in one.text
    assert job_run in _get(f"{url}/v1/runs", keys["admin-hr"]).text


def test_the_operator_reads_the_job_runs_result(served, job_run):
    url, keys = served
    status = _get(f"{url}/v1/runs/{job_run}", keys["operator"]).json()
    assert status["result"]["communities"][0]["summary"] == SECRET, json.dumps(status)
