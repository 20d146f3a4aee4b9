"""An ingestion run as a Prefect flow run (what a schedule or ``POST /v1/ingest`` starts) is one
trace, exported over OTLP/HTTP to a collector stand-in on loopback; its steps, run as Prefect
task runs, are its children; ``GET /v1/runs/{id}`` names its trace id. A successful run records
when it succeeded, which ``/metrics`` reports."""
from __future__ import annotations

import httpx
import pytest

from ragline.flows import telemetry
from ragline.flows.run import engine
from ragline.flows.serve.app import create_app
from ragline.flows.serve.routers.runs import runs_router
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import AUTH, TOKEN, running
from tests.helpers.data import index_and_search_yaml, scifact_records, write_jsonl
from tests.helpers.otlp import OtlpReceiver

pytestmark = pytest.mark.integration


def test_an_ingestion_flow_run_is_traced_and_v1_runs_names_its_trace(tmp_path, prefect_server, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(4))
    path = tmp_path / "pipelines.yaml"
    path.write_text(index_and_search_yaml())
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with OtlpReceiver() as collector:
        monkeypatch.setenv("RAGLINE_OTLP_ENDPOINT", collector.url)
        report = engine.run(load_project(path).pipeline("index"))  # a flow run, its steps task runs
        assert report.added == 4
        spans = collector.wait_for(lambda: [s for s in collector.spans if s["name"] == "ingestion index"]
                                   and collector.spans)
        [run] = [s for s in spans if s["name"] == "ingestion index"]
        steps = {s["name"] for s in collector.trace(run["trace_id"]) if s["parent_id"] == run["span_id"]}
        assert {"step load", "step write.plan", "step chunk", "step embed", "step write",
                "step write.finalize"} <= steps
        with get_client(sync_client=True) as client:
            [flow_run] = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
        app = create_app(str(path), token=TOKEN, routers=[runs_router(path)], warm_up=False)
        with running(app) as url:
            status = httpx.get(f"{url}/v1/runs/{flow_run.id}", headers=AUTH, timeout=30).json()
            assert status["state"] == "COMPLETED" and status["trace_id"] == run["trace_id"]
            metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
        telemetry.flush()  # the API's own spans, while the collector still listens
    # not on a schedule: the last success is recorded, the last scheduled one is not
    assert 'ragline_ingestion_last_success_timestamp_seconds{pipeline="index",trigger="any"}' in metrics
    assert 'trigger="scheduled"' not in metrics
