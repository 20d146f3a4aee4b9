"""An ingestion run's failure details (document ids, reasons) go only to those who may ingest."""
import textwrap

import pytest

from ragline.flows.contracts import Failure, IndexReport
from ragline.flows.serve.principals import Principal, collections_of
from ragline.flows.serve.query_service import ApiError
from ragline.flows.serve.runs import RunStatus, _listed_pipelines, _listed_states, without_failure_details
from ragline.flows.spec.compile import load_project
from tests.flows.spec.test_collections import PIPELINES, RESOURCES


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
