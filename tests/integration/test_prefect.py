"""Pipelines as real Prefect flow runs: task runs per step, concurrency, retries, failures."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Passage, Query, Ranking
from ragline.flows.run.engine import StepFailed
from ragline.flows.spec.registry import stage
from tests.helpers.harness import default_corpus
from tests.helpers.prefect_runs import latest_flow_run, task_runs_once

pytestmark = pytest.mark.integration

INTERVALS: dict[str, tuple[float, float, str]] = {}
ATTEMPTS: dict[str, int] = {}


class SleepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = 1.5  # long enough to overlap even when the machine is busy
    fail_times: int = 0


@stage("test_sleepy_retriever", params=SleepParams, produces="rankings", kind="query")
def _sleepy(query: Query, params: SleepParams, ctx) -> list[Ranking]:
    start = time.perf_counter()
    ATTEMPTS[ctx.step_id] = ATTEMPTS.get(ctx.step_id, 0) + 1
    if ATTEMPTS[ctx.step_id] <= params.fail_times:
        raise ConnectionError(f"transient failure #{ATTEMPTS[ctx.step_id]}")
    time.sleep(params.seconds)
    INTERVALS[ctx.step_id] = (start, time.perf_counter(), threading.current_thread().name)
    passage = Passage(chunk_id=f"{ctx.step_id}-1", source_id=ctx.step_id, text=query.text)
    return [Ranking(retriever=ctx.step_id, query=query.text, passages=[passage])]


DAG = """
pipelines:
  fan:
    kind: query
    steps:
      - {id: left,  task: test_sleepy_retriever}
      - {id: right, task: test_sleepy_retriever, after: []}
      - {id: join,  task: fuse, after: [left, right]}
  flaky:
    kind: query
    steps:
      - {id: flaky, task: test_sleepy_retriever, retries: 2, retry_delay_seconds: 0, with: {seconds: 0, fail_times: 2}}
      - {id: join,  task: fuse}
  broken:
    kind: query
    steps:
      - {id: broken, task: test_sleepy_retriever, with: {seconds: 0, fail_times: 99}}
      - {id: join,   task: fuse}
"""


def flow_runs(name: str):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            return [(r, await client.read_task_runs()) for r in runs]

    return asyncio.run(read())


def test_independent_steps_run_concurrently_and_fan_in(prefect_server, make_project):
    project = load_project(make_project(DAG))
    INTERVALS.clear()
    passages = engine.run(project.pipeline("fan"), {"query": "hello"})
    assert {p.chunk_id for p in passages} == {"left-1", "right-1"}  # fan-in got both producers' outputs
    (a_start, a_end, a_thread), (b_start, b_end, b_thread) = INTERVALS["left"], INTERVALS["right"]
    assert a_start < b_end and b_start < a_end, "independent steps did not overlap"
    assert a_thread != b_thread


def test_step_retries_are_prefect_retries(prefect_server, make_project):
    project = load_project(make_project(DAG))
    ATTEMPTS.clear()
    passages = engine.run(project.pipeline("flaky"), {"query": "x"})
    assert ATTEMPTS["flaky"] == 3 and passages[0].chunk_id == "flaky-1"


def test_failure_names_pipeline_and_step(prefect_server, make_project):
    project = load_project(make_project(DAG))
    with pytest.raises(StepFailed, match=r"pipeline 'broken', step 'broken' .*ConnectionError"):
        engine.run(project.pipeline("broken"), {"query": "x"})


def test_ingestion_is_one_flow_run_with_task_runs_per_step_and_batch(prefect_server, index_project, tmp_path):
    project_path = index_project(batch_size=5)
    default_corpus(tmp_path / "docs")
    report = engine.run(load_project(project_path).pipeline("index"))
    assert report.added == 12 and report.failed == 0
    expected = {"load", "write.plan", "write.finalize"} | {f"{s}[batch {b}]" for s in
                                                            ("convert", "chunk", "embed", "write") for b in (0, 1, 2)}
    runs = task_runs_once("index", lambda states: expected <= set(states))
    names, states = set(runs), {state.type.value for state in runs.values()}
    assert latest_flow_run("index").state_type.value == "COMPLETED"
    assert expected <= names and states == {"COMPLETED"}, (sorted(expected - names), states)


def test_an_ingestion_run_shows_its_report_and_failed_documents_on_the_dashboard(prefect_server, index_project,
                                                                                   tmp_path):
    """Issue 20.5: the report is a markdown artifact of the flow run; a hostile file name stays text."""
    project_path = index_project(batch_size=5)
    default_corpus(tmp_path / "docs")
    (tmp_path / "docs" / "[x](http:evil) <b>.md").write_text("   \n")  # nothing to chunk: a failed document
    report = engine.run(load_project(project_path).pipeline("index"))
    assert report.added == 12 and report.failed == 1
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def artifacts_of_latest_index_run():
        async with get_client() as client:
            runs = await client.read_flow_runs()
            run = next(r for r in sorted(runs, key=lambda r: r.created, reverse=True) if r.name == "index")
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))

    found = asyncio.run(artifacts_of_latest_index_run())
    assert [a.key for a in found] == ["ragline-index"] and found[0].type == "markdown"
    markdown = found[0].data
    assert "| 12 | 0 | 0 | 0 | 1 |" in markdown and "## Failed documents" in markdown
    assert "\\[x\\]\\(http:evil\\) \\<b\\>" in markdown and "| load | empty document |" in markdown
