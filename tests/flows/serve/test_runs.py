"""An ingestion run's failure details (document ids, reasons) go only to those who may ingest."""
from ragline.flows.contracts import Failure, IndexReport
from ragline.flows.serve.runs import RunStatus, without_failure_details


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
