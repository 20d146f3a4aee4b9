"""Engine v2: calls that pickle, a direct executor with concurrency, retries and timeouts, and an
importable flow entry point (issue 6, items 1, 2 and 4)."""
from __future__ import annotations

import threading
import time

import cloudpickle
import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Passage, Query, Ranking, StepResult
from ragline.flows.run.engine import DirectExecutor, StepFailed
from ragline.flows.spec.registry import stage
from ragline.flows.run.steps import PipelineRef, StepCall

INTERVALS: dict[str, tuple[float, float]] = {}
ATTEMPTS: dict[str, int] = {}


class NapParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = 0.6
    fail_times: int = 0


@stage("test_nap_rewrite", params=NapParams, produces="query", kind="query")
def _nap_rewrite(query: Query, params: NapParams, ctx) -> Query:
    """A rewrite that takes a while (an LLM call, in ask_fusion)."""
    _nap(ctx.step_id, params)
    return query.model_copy(update={"variants": query.variants + [f"{ctx.step_id}:{query.text}"]})


@stage("test_nap_retriever", params=NapParams, produces="rankings", kind="query")
def _nap_retriever(query: Query, params: NapParams, ctx) -> list[Ranking]:
    _nap(ctx.step_id, params)
    return [Ranking(retriever=ctx.step_id, query=t, passages=[Passage(chunk_id=f"{ctx.step_id}|{t}",
                                                                      source_id=ctx.step_id, text=t)])
            for t in query.search_texts()]


def _nap(step_id: str, params: NapParams) -> None:
    ATTEMPTS[step_id] = ATTEMPTS.get(step_id, 0) + 1
    if ATTEMPTS[step_id] <= params.fail_times:
        raise ConnectionError(f"transient failure #{ATTEMPTS[step_id]}")
    start = time.perf_counter()
    time.sleep(params.seconds)
    INTERVALS[step_id] = (start, time.perf_counter())


FUSION_SHAPED = """
pipelines:
  fusion:
    kind: query
    steps:
      - {id: hyde,   task: test_nap_rewrite}
      - {id: multi,  task: test_nap_rewrite, after: []}
      - {id: dense,  task: test_nap_retriever, after: [hyde]}
      - {id: sparse, task: test_nap_retriever, after: [multi]}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
  flaky:
    kind: query
    steps:
      - {id: flaky, task: test_nap_retriever, retries: 2, retry_delay_seconds: 0, with: {seconds: 0, fail_times: 2}}
      - {id: join,  task: fuse}
  hung:
    kind: query
    steps:
      - {id: hung, task: test_nap_retriever, timeout_seconds: 0.3, with: {seconds: 5}}
      - {id: join, task: fuse}
"""


def overlap(a: str, b: str) -> bool:
    (a_start, a_end), (b_start, b_end) = INTERVALS[a], INTERVALS[b]
    return a_start < b_end and b_start < a_end


def test_direct_mode_runs_independent_branches_concurrently(make_project):
    pipeline = load_project(make_project(FUSION_SHAPED)).pipeline("fusion")
    INTERVALS.clear()
    passages = engine.run(pipeline, {"query": "q"}, orchestrate=False)

    assert {p.chunk_id for p in passages} == {"dense|hyde:q", "sparse|multi:q"}
    assert overlap("hyde", "multi") and overlap("dense", "sparse")  # event order: the branches' runs overlap


def test_direct_mode_applies_retries_and_timeouts(make_project):
    project = load_project(make_project(FUSION_SHAPED))
    ATTEMPTS.clear()
    assert engine.run(project.pipeline("flaky"), {"query": "x"}, orchestrate=False)[0].chunk_id == "flaky|x"
    assert ATTEMPTS["flaky"] == 3
    INTERVALS.pop("hung", None)
    with pytest.raises(StepFailed, match=r"step 'hung' \(task 'test_nap_retriever'\) timed out after 0.3 s"):
        engine.run(project.pipeline("hung"), {"query": "x"}, orchestrate=False)
    assert "hung" not in INTERVALS  # event order: the run failed while its step still napped (5 s)


class PicklingExecutor(DirectExecutor):
    """Sends every call and its resolved inputs through cloudpickle, as a Dask or Ray runner would."""

    sent: list[int] = []

    def submit(self, step, call, inputs, after, label):
        call = cloudpickle.loads(cloudpickle.dumps(call))
        self.sent.append(len(cloudpickle.dumps(call)))
        return super().submit(step, call, {port: [_travel(r) for r in rs] for port, rs in inputs.items()}, after,
                              label)


def _travel(result):
    if isinstance(result, StepResult):
        return cloudpickle.loads(cloudpickle.dumps(result))
    out = type(result)()
    result.add_done_callback(lambda done: out.set_exception(done.exception()) if done.exception() else
                             out.set_result(cloudpickle.loads(cloudpickle.dumps(done.result()))))
    return out


def test_every_call_and_its_inputs_pickle(index_project, tmp_path):
    project_path = index_project(batch_size=3)
    (tmp_path / "docs").mkdir()
    for i in range(7):
        (tmp_path / "docs" / f"n{i}.md").write_text(f"# Note {i}\n\nZebrafish fin regeneration, note {i}.\n")
    pipeline = load_project(project_path).pipeline("index")
    PicklingExecutor.sent = []

    report = engine.execute_pipeline(pipeline, {}, PicklingExecutor())
    passages = engine.execute_pipeline(load_project(project_path).pipeline("search"), {"query": "zebrafish"},
                                       PicklingExecutor())

    assert report.added == 7 and report.failed == 0
    assert len(passages) == 7 and len(PicklingExecutor.sent) > 10


def test_a_call_is_plain_data_that_another_process_resolves(index_project):
    pipeline = load_project(index_project()).pipeline("index").with_overrides({"chunk": {"overlap": 4}})
    ref = PipelineRef.of(pipeline)
    copy = cloudpickle.loads(cloudpickle.dumps(StepCall(ref, "chunk", "abc")))

    from ragline.flows.run import steps
    steps._LIVE.pop(ref.key)  # as in a fresh worker process: compiled from the file
    resolved = copy.pipeline.resolve()

    assert resolved is not pipeline and resolved.step("chunk").params.overlap == 4
    assert ref.overrides == {"chunk": {"overlap": 4}}


def test_the_flow_entry_point_is_importable_and_deployable():
    from prefect.flows import load_flow_from_entrypoint

    from ragline.flows.run.entrypoints import run_pipeline

    flow = load_flow_from_entrypoint("flows/run/entrypoints.py:run_pipeline")
    deployment = run_pipeline.to_deployment(name="index", parameters={"pipeline": "index"}, cron="0 * * * *")

    assert flow.name == run_pipeline.name == "ragline"
    assert deployment.entrypoint.endswith("flows/run/entrypoints.py:run_pipeline")
    assert deployment.parameters == {"pipeline": "index"}


def test_concurrent_queries_share_the_pool_without_deadlock(make_project):
    pipeline = load_project(make_project(FUSION_SHAPED.replace("seconds: 5", "seconds: 0"))).pipeline("fusion")
    results: list[int] = []

    def ask() -> None:
        results.append(len(engine.run(pipeline, {"query": "q"}, orchestrate=False)))

    threads = [threading.Thread(target=ask) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [2] * 40
