"""What a served deployment may be asked to do over Prefect's REST API (issue 16 items 5 and 15,
issue 15 item 6): parameters that change what it runs are refused inside the run; an edit of
pipelines.yaml while serving changes neither the API nor the runs (pinned, shown in /readyz); the
trigger snippet of docs/serving.md polls to COMPLETED; schedules are named after what they do; a running
ingestion reports its phase and the documents it planned. A real Prefect server (scheduler
included) and `ragline serve` in a subprocess, as in production."""
from __future__ import annotations

import json
import re
import subprocess
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import pipelines
from tests.helpers.data import REPO
from tests.integration.serving import (
    AUTH,
    FINAL,
    TOKEN,
    _create_flow_run,
    _deployment,
    _start,
    _stop,
    _wait_flow_run,
)

pytestmark = pytest.mark.integration

SECRET = "CAPYBARA-SECRET-7731"
PRIVATE = "OKAPI-HR-4412"  # in private/, readable by the hr group only

PIPELINES = ("resources:\n" + pipelines.EMBEDDER + pipelines.index_resources()
             + pipelines.index_resources("bulk_", "bulk") + "\npipelines:\n"
             + pipelines.ingestion("index", '[docs, {path: private, access: [{prefix: "", groups: [hr]}]}]',
                                   head='    schedule: {cron: "0 3 * * *", timezone: Europe/Berlin}\n')
             + pipelines.ingestion("bulk", "[bulk]", "bulk_", head="    batch_size: 2\n")
             + pipelines.served_search(k=10, top_k=5))

TOPICS = ["Zebrafish regenerate their fins and heart.", "Axolotls regrow whole limbs.",
          "Planarians rebuild a body from a fragment.", "Starfish regrow lost arms.",
          "Salamanders regenerate their tails.", "Deer regrow antlers every year."]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("params")
    (root / "docs").mkdir()
    for number, text in enumerate(TOPICS):
        (root / "docs" / f"topic{number}.md").write_text(f"# Topic {number}\n\n{text} Regeneration notes.\n")
    (root / "private").mkdir()
    (root / "private" / "salary.md").write_text(f"# Salary\n\nThe {PRIVATE} salary band of the okapi team.\n")
    (root / "bulk").mkdir()
    for number in range(60):
        (root / "bulk" / f"note{number:02d}.md").write_text(f"# Note {number}\n\nBulk note number {number}.\n")
    outside = root.parent / f"{root.name}-outside"  # not under any configured root
    outside.mkdir()
    (outside / "passwd.md").write_text(f"# Secret\n\nroot:x:0:0:{SECRET}:/root:/bin/bash\n")
    (outside / "evil.yaml").write_text(textwrap.dedent(PIPELINES).replace("paths: [docs, ", f"paths: [{outside}, "))
    path = root / "pipelines.yaml"
    path.write_text(textwrap.dedent(PIPELINES))
    return path


@pytest.fixture(scope="module")
def served(project, prefect_api):
    log = project.parent / "serve.log"
    process, url = _start(project, prefect_api, log)
    try:
        yield url
    finally:
        _stop(process)


def _trigger_all(prefect_api: str, deployment_id: str, bodies: list[dict], together: bool = True) -> list[dict]:
    """Create the runs (at once, or each after the previous one ended: an ingestion deployment
    cancels a run that comes while another is active) and wait for them."""
    if not together:
        return [_trigger_all(prefect_api, deployment_id, [body])[0] for body in bodies]
    ids = [_create_flow_run(prefect_api, deployment_id, body) for body in bodies]
    return [_wait_flow_run(prefect_api, run_id, timeout=300) for run_id in ids]


def _set_parameters(prefect_api: str, deployment_id: str, parameters: dict, timeout: float = 120) -> None:
    """Store a deployment's parameters and read them back: a starved Prefect server can answer a PATCH
    with an error or time out (an unrestored deployment then failed this module's later runs)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.patch(f"{prefect_api}/deployments/{deployment_id}", json={"parameters": parameters}, timeout=30)
            stored = httpx.get(f"{prefect_api}/deployments/{deployment_id}", timeout=30).json()["parameters"]
            if stored == parameters:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"deployment {deployment_id}'s parameters could not be set"
        time.sleep(1)


def _query(served: str, question: str) -> dict:
    response = httpx.post(f"{served}/v1/query", headers=AUTH, timeout=300,
                          json={"question": question, "pipeline": "search"})
    assert response.status_code == 200, response.text
    return response.json()


# ----------------------------------------------------------------------------- issue 16 item 5
def test_a_deployment_runs_only_what_it_was_created_for(served, prefect_api, project):
    outside = project.parent.parent / f"{project.parent.name}-outside"
    index = _deployment(prefect_api, "index")
    # What it was created for still runs: the index deployment with no parameters indexes docs/.
    [plain] = _trigger_all(prefect_api, index["id"], [{}])
    assert plain["state"]["type"] == "COMPLETED", plain["state"]

    hostile = {
        "overrides": {"parameters": {"pipeline": "index", "overrides": {"load": {"paths": [str(outside)]},
                                                                       "write": {"delete_missing": False}}}},
        "file": {"parameters": {"file": str(outside / "evil.yaml")}},
        "data_dir": {"parameters": {"data_dir": str(outside)}},
        "resources": {"parameters": {"resources": {"embedder": {"model": "http://evil.example/model"}}}},
        "pipeline": {"parameters": {"pipeline": "bulk"}},
        "digest": {"parameters": {"digest": "0123456789abcdef"}},
    }
    runs = _trigger_all(prefect_api, index["id"], list(hostile.values()), together=False)
    for name, run in zip(hostile, runs):
        assert run["state"]["type"] == "FAILED", (name, run["state"])
        assert f"refuses parameter '{name}'" in run["state"]["message"], (name, run["state"]["message"])

    # Changing the deployment's stored parameters (anyone on the Prefect API can) does not help:
    # the run compares with what `ragline serve` created the deployment with.
    patched = dict(index["parameters"], overrides={"load": {"paths": [str(outside)]}})
    _set_parameters(prefect_api, index["id"], patched)
    try:
        [run] = _trigger_all(prefect_api, index["id"], [{}])
        assert run["state"]["type"] == "FAILED" and "refuses parameter 'overrides'" in run["state"]["message"]
    finally:
        _set_parameters(prefect_api, index["id"], index["parameters"])

    # An ingestion deployment takes no inputs.
    [run] = _trigger_all(prefect_api, index["id"], [{"parameters": {"inputs": {"query": "x"}}}])
    assert run["state"]["type"] == "FAILED" and "refuses parameter 'inputs'" in run["state"]["message"]

    # Nothing outside docs/ reached the index.
    passages = _query(served, f"root {SECRET} passwd")["passages"]
    assert passages and not any(SECRET in json.dumps(p) or "-outside" in json.dumps(p) for p in passages), passages


def test_a_query_deployment_takes_the_question_history_and_filters_checked(served, prefect_api):
    search = _deployment(prefect_api, "search")["id"]
    refused = {
        "'inputs.query.variants'": {"inputs": {"query": {"text": "fins", "variants": ["ignore the question"]}}},
        "'inputs.query.text'": {"inputs": {"query": {"text": "x" * 10_001}}},
        "'inputs.query.filters'": {"inputs": {"query": {"text": "fins", "filters": {"$where": "1"}}}},
        "'inputs.query.history.0.role'": {"inputs": {"query": {"text": "fins",
                                                               "history": [{"role": "root", "content": "x"}]}}},
        "'inputs.extra'": {"inputs": {"query": "fins", "extra": 1}},
        "'overrides'": {"inputs": {"query": "fins"}, "overrides": {"fuse": {"top_k": 50}}},
    }
    runs = _trigger_all(prefect_api, search, [{"parameters": body} for body in refused.values()])
    for name, run in zip(refused, runs):
        assert run["state"]["type"] == "FAILED", (name, run["state"])
        assert f"refuses parameter {name}" in run["state"]["message"], (name, run["state"]["message"])
    allowed = {"inputs": {"query": {"text": "zebrafish fins", "history": [{"role": "user", "content": "hi"}],
                                    "filters": {"format": "markdown"}}}}
    [run] = _trigger_all(prefect_api, search, [{"parameters": allowed}])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    passages = json.loads(Path(run["state"]["data"]["storage_key"]).read_text())
    assert passages and "Zebrafish" in passages[0]["text"]


def test_runs_outside_a_deployment_keep_their_overrides(served, prefect_api, project):
    """The CLI's flow runs (no deployment) still take overrides: the check is per deployment."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    pipeline = load_project(project).pipeline("search").with_overrides({"fuse": {"top_k": 2}})
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        passages = engine.run(pipeline, {"query": "regeneration"})
    assert len(passages) == 2


# ----------------------------------------------------------------------------- issue 15 item 6
def test_the_documented_trigger_snippet_waits_for_the_result(served, prefect_api):
    page = (REPO / "docs" / "serving.md").read_text()
    [snippet] = [block for block in re.findall(r"```bash\n(.*?)```", page, re.S) if "create_flow_run" in block]
    script = snippet.replace("http://127.0.0.1:4200/api", prefect_api).replace("http://127.0.0.1:8080", served)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300,
                          env={"TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    state, storage_key, *result = done.stdout.splitlines()
    assert state == "COMPLETED", done.stdout
    assert Path(storage_key).is_file()
    assert isinstance(json.loads("\n".join(result)), list)


def test_schedules_are_named_after_what_they_do(served, prefect_api, project):
    from ragline.flows.spec.compile import load_project
    from ragline.flows.serve.supervise.service import deployment_options

    [cron] = _deployment(prefect_api, "index")["schedules"]  # as the real server stored it
    assert cron["slug"] == "0 3 * * * (Europe/Berlin)" and cron["schedule"]["cron"] == "0 3 * * *"
    spec = textwrap.dedent(PIPELINES).replace('schedule: {cron: "0 3 * * *", timezone: Europe/Berlin}',
                                              'schedule: {cron: "0 * * * *", interval_seconds: 3600}')
    other = project.parent / "both.yaml"
    other.write_text(spec)
    slugs = [s.slug for s in deployment_options(load_project(other))["index"]["schedules"]]
    assert slugs == ["0 * * * * (UTC)", "every 3600 s"]  # unique within the deployment


def test_a_running_ingestion_reports_its_phase_and_planned_documents(served, prefect_api, project):
    from ragline.flows.spec.compile import load_project

    seen: list[dict] = []

    def poll(run_id: str, until) -> dict:
        deadline, status = time.monotonic() + 300, {}
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"{served}/v1/runs/{run_id}", headers=AUTH, timeout=30).json()
            except httpx.TimeoutException:  # a Prefect server stalled by a loaded CI machine: ask again
                continue
            if status.get("error", {}).get("code") == "prefect_unavailable":  # the API said so in time: ask again
                time.sleep(1)
                continue
            if status.get("progress"):
                seen.append(status["progress"])
            if until(status):
                return status
            time.sleep(0.2)
        raise TimeoutError(f"{run_id}: {status}")

    with load_project(project).resource("bulk_state").lease("manual rebuild"):  # the run waits for it
        run_id = _create_flow_run(prefect_api, _deployment(prefect_api, "bulk")["id"], {})
        poll(run_id, lambda s: (s.get("progress") or {}).get("phase") == "waiting")
    final = poll(run_id, lambda s: s["state"] in FINAL)
    assert final["state"] == "COMPLETED" and final["result"]["added"] == 60, final
    planned = [p for p in seen if p.get("documents_planned") is not None]
    assert planned and all(p["documents_planned"] == 60 for p in planned), seen
    phases = {p.get("phase") for p in seen}
    assert phases & {"converting", "chunking", "embedding", "writing"}, phases
    assert any(0 < (p.get("documents_done") or 0) < 60 for p in seen), seen


# ----------------------------------------------------------------------------- issue 16 item 15
def test_an_edit_while_serving_changes_neither_the_api_nor_the_runs_until_restart(served, prefect_api, project):
    """Last in the module: it edits the served file. Pinned: the API and a deployment run both keep
    the configuration the server started with (top_k 5), and /readyz says the file on disk differs."""
    from ragline.flows.run.steps import digest_of

    started = digest_of(project)
    config = httpx.get(f"{served}/readyz", headers=AUTH, timeout=60).json()["checks"]["config"]
    assert config["detail"] == {"digest": started, "policy": "pinned", "file_digest": started,
                                "changed_on_disk": False}
    project.write_text(project.read_text().replace("with: {top_k: 5}", "with: {top_k: 1}"))
    edited = digest_of(project)

    assert len(_query(served, "regeneration")["passages"]) == 5
    body = {"parameters": {"inputs": {"query": {"text": "regeneration"}}}}
    [run] = _trigger_all(prefect_api, _deployment(prefect_api, "search")["id"], [body])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert len(json.loads(Path(run["state"]["data"]["storage_key"]).read_text())) == 5
    config = httpx.get(f"{served}/readyz", headers=AUTH, timeout=60).json()["checks"]["config"]
    assert config["status"] == "up" and config["detail"]["digest"] == started
    assert config["detail"]["file_digest"] == edited and config["detail"]["changed_on_disk"] is True
    assert "restart" in config["detail"]["note"]
    assert (project.parent / ".ragline" / "served" / f"{started}.yaml").is_file()


# ----------------------------------------------------------------------------- issue 19 item 3
def test_a_triggered_query_reads_public_documents_only(served, prefect_api):
    """A run triggered through Prefect has no principal: it never reads a restricted document, and
    its parameters cannot say otherwise. The API with no principal wired (access None) still does."""
    [indexed] = _trigger_all(prefect_api, _deployment(prefect_api, "index")["id"], [{}])
    assert indexed["state"]["type"] == "COMPLETED", indexed["state"]
    search = _deployment(prefect_api, "search")["id"]
    question = f"{PRIVATE} okapi salary band"
    [refused] = _trigger_all(prefect_api, search, [{"parameters": {"inputs": {"query": {"text": question,
                                                                                       "access": None}}}}])
    assert refused["state"]["type"] == "FAILED"
    assert "refuses parameter 'inputs.query.access'" in refused["state"]["message"], refused["state"]["message"]
    [run] = _trigger_all(prefect_api, search, [{"parameters": {"inputs": {"query": question}}}])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    passages = json.loads(Path(run["state"]["data"]["storage_key"]).read_text())
    assert passages and not any(PRIVATE in p["text"] for p in passages), passages
    assert any(PRIVATE in p["text"] for p in _query(served, question)["passages"])
