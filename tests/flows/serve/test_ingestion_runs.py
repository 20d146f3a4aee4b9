"""flows/serve/ingestion_runs.py: an ingestion run's failure details (document ids, reasons) go only to those
who may ingest; the busy check sees a run at every point of its start; a silent Prefect API is a 503."""
import asyncio
import contextlib
import datetime
import socket
import textwrap
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from ragline.flows.contracts import Failure, IndexReport
from ragline.flows.serve.auth.principals import Principal, collections_of
from ragline.flows.serve.query_service import ApiError
from ragline.flows.serve import ingestion_runs as runs_module
from ragline.flows.serve.ingestion_runs import RunStatus, _Runs, without_failure_details
from ragline.flows.serve.routers.runs import _listed_pipelines, _listed_states
from ragline.flows.spec.compile import load_project
from tests.helpers.collection_specs import PIPELINES, RESOURCES


def _failed_run(message: str | None = None) -> RunStatus:
    report = IndexReport(added=1, failed=2, failures=[Failure(source_id="hr/salaries-2026.pdf", stage="convert", reason="bad PDF"),
                                                       Failure(source_id="hr/layoffs.md", stage="chunk", reason="too long")])
    failures = [f.model_dump(mode="json") for f in report.failures]
    return RunStatus(id="r1", pipeline="index", kind="ingestion", state="COMPLETED", state_name="Completed",
                     result=dict(report.model_dump(mode="json"), failures=failures), summary=report.summary(),
                     failures=failures, message=message)


def test_a_viewer_without_ingest_sees_counts_not_the_failed_documents():
    shown = without_failure_details(_failed_run())
    text = shown.model_dump_json()
    assert "salaries" not in text and "layoffs" not in text and "bad PDF" not in text
    assert shown.failures == [] and shown.result["failed"] == 2 and "failed 2" in shown.summary
    assert shown.message == "2 failure details withheld: they need the ingest scope"


def test_the_withheld_note_follows_the_runs_own_message():
    shown = without_failure_details(_failed_run("a root was unreachable"))
    assert shown.message == "a root was unreachable; 2 failure details withheld: they need the ingest scope"


def test_a_run_without_failures_is_unchanged():
    status = RunStatus(id="r2", pipeline="index", kind="ingestion", state="COMPLETED", state_name="Completed",
                       result={"added": 3, "failures": []})
    assert without_failure_details(status) == status


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
""" + PIPELINES))
    return load_project(path, tuned=False)


def principal(scopes: set[str], collections: set[str]) -> Principal:
    return Principal(id="key:1", kind="key", scopes=frozenset(scopes), collections=frozenset(collections))


def test_the_run_list_covers_the_pipelines_a_credential_may_read(project):
    everything = _listed_pipelines(project, None, principal({"admin"}, {"*"}))
    assert everything == list(project.pipelines)
    own = _listed_pipelines(project, None, principal({"ingest"}, collections_of(project.pipeline("index@handbook"))))
    assert own == ["index@handbook"]
    assert _listed_pipelines(project, None, principal({"query"}, {"nothing"})) == []


def test_a_named_pipeline_the_credential_may_not_read_is_refused_and_an_unknown_one_named(project):
    with pytest.raises(ApiError) as refused:
        _listed_pipelines(project, "index@papers", principal({"ingest"}, collections_of(project.pipeline("index@handbook"))))
    assert refused.value.status == 403
    with pytest.raises(ApiError) as unknown:
        _listed_pipelines(project, "nope", principal({"admin"}, {"*"}))
    assert unknown.value.status == 400 and unknown.value.param == "pipeline"


@pytest.mark.parametrize("given, wanted", [("completed", ["COMPLETED"]), ("failed, crashed", ["FAILED", "CRASHED"])])
def test_states_are_prefect_state_types(given, wanted):
    assert _listed_states(given) == wanted


@pytest.mark.parametrize("given", ["done", ",", "completed,late"])
def test_an_unknown_state_names_the_field(given):
    with pytest.raises(ApiError) as refused:
        _listed_states(given)
    assert refused.value.status == 400 and refused.value.param == "state"


# -- starting a run: the busy check, and a Prefect API that does not answer

class _RunMovingOn:
    """A Prefect client whose one run of the deployment leaves SCHEDULED for PENDING right after
    the first query: the moment the runner picks it up, which no test can time on a real server."""

    def __init__(self, deployment):
        now = datetime.datetime.now(datetime.UTC)
        self.run = SimpleNamespace(id=uuid.uuid4(), deployment_id=deployment, start_time=None, expected_start_time=now,
                                   state=SimpleNamespace(type="SCHEDULED", name="Scheduled"))
        self.queries = 0

    async def read_flow_runs(self, flow_run_filter, sort, limit):
        run, wanted = self.run, flow_run_filter.state.type.any_
        due = flow_run_filter.expected_start_time
        found = [run] if run.state.type in wanted and (due is None or run.expected_start_time < due.before_) else []
        self.queries += 1
        run.state = SimpleNamespace(type="PENDING", name="Pending")
        return found


def test_a_run_picked_up_while_the_busy_check_reads_is_still_seen(project):
    runs = _Runs(project)
    runs.deployment_ids = {name: uuid.uuid4() for name in project.pipelines}
    client = _RunMovingOn(runs.deployment_ids["index@handbook"])
    busy = asyncio.run(runs.running(client, "index@handbook"))
    assert busy is not None and str(client.run.id) in busy


@pytest.fixture
def silent_prefect():
    """A Prefect API that accepts connections and never answers (a server starved or stuck)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/api"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def test_a_prefect_api_that_does_not_answer_is_a_503_within_the_deadline(silent_prefect, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(runs_module, "PREFECT_DEADLINE_SECONDS", 1.0)

    async def read() -> None:
        async with get_client() as client:
            await client.read_flow_run(uuid.uuid4())

    started = time.monotonic()
    with temporary_settings({PREFECT_API_URL: silent_prefect}), pytest.raises(ApiError) as refused:
        asyncio.run(runs_module.within_prefect_deadline(read(), started="index"))
    assert time.monotonic() - started < 10  # Prefect's client alone waits 60 s, then retries
    error = refused.value
    assert error.status == 503 and error.code == "prefect_unavailable" and error.headers["Retry-After"] == "5"
    assert "did not answer within 1 s" in error.message and "GET /v1/runs?pipeline=index" in error.message
