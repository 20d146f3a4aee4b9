"""Executors, unit by unit: the retry and timeout policy (what Prefect applies to a task run),
inline on the caller's thread or on a watched thread, and the Prefect-free ``DirectExecutor``
wiring upstream futures, order-only waits, failures and the caller's context into each step.
(Whole pipelines through both executors: test_engine_v2.py and tests/integration/test_prefect.py.)"""
from __future__ import annotations

import contextvars
import threading
import time
from concurrent.futures import Future

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Passage, Query, Ranking, StepResult
from ragline.flows.run.executors import DirectExecutor, Run, run_with_policy, settle
from ragline.flows.spec.registry import stage
from ragline.flows.run.steps import PipelineRef, StepCall, StepFailed, StepTimedOut, execute

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("test_executors_mark", default="unset")
SEEN: dict[str, dict] = {}


class EchoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail: bool = False


@stage("test_exec_echo", params=EchoParams, produces="rankings", kind="query")
def _echo(query: Query, params: EchoParams, ctx) -> list[Ranking]:
    """One passage naming the step and the query; records the thread and context it ran in."""
    SEEN[ctx.step_id] = {"thread": threading.current_thread().name, "mark": MARK.get(), "at": time.perf_counter()}
    if params.fail:
        raise ValueError(f"{ctx.step_id} refuses")
    return [Ranking(retriever=ctx.step_id, query=query.text,
                    passages=[Passage(chunk_id=f"{ctx.step_id}|{query.text}", source_id=ctx.step_id, text="t")])]


PROJECT = """
pipelines:
  search:
    kind: query
    steps:
      - {id: a,    task: test_exec_echo}
      - {id: b,    task: test_exec_echo, after: []}
      - {id: fuse, task: fuse, after: [a, b]}
  broken:
    kind: query
    steps:
      - {id: a,    task: test_exec_echo, with: {fail: true}}
      - {id: fuse, task: fuse, after: [a]}
  policy:
    kind: query
    steps:
      - {id: plain,   task: test_exec_echo}
      - {id: retried, task: test_exec_echo, after: [], retries: 2, retry_delay_seconds: 0}
      - {id: delayed, task: test_exec_echo, after: [], retries: 1, retry_delay_seconds: 0.4}
      - {id: timed,   task: test_exec_echo, after: [], timeout_seconds: 0.3}
      - {id: timed_retried, task: test_exec_echo, after: [], timeout_seconds: 0.3, retries: 1,
         retry_delay_seconds: 0}
      - {id: fuse, task: fuse, after: [plain, retried, delayed, timed, timed_retried]}
"""


@pytest.fixture
def project(make_project):
    return load_project(make_project(PROJECT))


@pytest.fixture
def policy(project):
    return project.pipeline("policy")


def flaky(failures: int, value: str = "done", nap: float = 0.0):
    """A callable that raises ``failures`` times (naming the attempt), then naps and returns."""
    attempts: list[str] = []

    def fn():
        attempts.append(threading.current_thread().name)
        if len(attempts) <= failures:
            raise ConnectionError(f"attempt {len(attempts)} failed")
        time.sleep(nap)
        return StepResult(value)

    return fn, attempts


# ----------------------------------------------------------------------------- run_with_policy
def test_without_a_timeout_an_attempt_runs_inline_on_the_callers_thread(policy):
    fn, attempts = flaky(0)
    assert run_with_policy(policy.step("plain"), fn).value == "done"
    assert attempts == [threading.current_thread().name]


def test_with_a_timeout_each_attempt_runs_on_a_thread_named_after_the_step(policy):
    fn, attempts = flaky(0)
    assert run_with_policy(policy.step("timed"), fn).value == "done"
    assert attempts == ["ragline-timed"]


def test_retries_run_until_an_attempt_succeeds(policy):
    fn, attempts = flaky(2)
    assert run_with_policy(policy.step("retried"), fn).value == "done"
    assert len(attempts) == 3


def test_after_the_last_retry_the_last_failure_is_raised(policy):
    fn, attempts = flaky(5)
    with pytest.raises(ConnectionError, match="attempt 3 failed"):
        run_with_policy(policy.step("retried"), fn)
    assert len(attempts) == 3  # retries: 2


def test_a_step_without_retries_fails_on_its_first_failure(policy):
    fn, attempts = flaky(1)
    with pytest.raises(ConnectionError, match="attempt 1 failed"):
        run_with_policy(policy.step("plain"), fn)
    assert len(attempts) == 1


def test_retries_wait_the_retry_delay(policy):
    fn, attempts = flaky(1)
    started = time.perf_counter()
    assert run_with_policy(policy.step("delayed"), fn).value == "done"
    assert len(attempts) == 2 and time.perf_counter() - started >= 0.4


def test_an_attempt_past_its_timeout_is_a_step_timeout_named_after_the_step(policy):
    fn, attempts = flaky(0, nap=3)
    with pytest.raises(StepTimedOut, match=r"^step 'timed' \(task 'test_exec_echo'\) timed out after 0.3 s$") as info:
        run_with_policy(policy.step("timed"), fn)
    # event order, not the wall clock: the caller has its answer while the attempt still naps
    assert any(t.name == attempts[0] and t.is_alive() for t in threading.enumerate()), attempts
    assert info.value.seconds == 0.3 and info.value.http_status == 504 and info.value.step == "timed"


def test_a_timed_out_attempt_is_retried(policy):
    slow_then_fast: list[float] = [1.5, 0.0]

    def fn():
        time.sleep(slow_then_fast.pop(0))
        return StepResult("second")

    assert run_with_policy(policy.step("timed_retried"), fn).value == "second"
    assert slow_then_fast == []


# ----------------------------------------------------------------------------- DirectExecutor
def submit_all(pipeline, executor) -> tuple[Run, dict]:
    """Start every step as the engine does: each on its upstream futures."""
    run = Run(pipeline, executor, PipelineRef.of(pipeline))
    query = StepResult(Query(text="q"))
    sources: dict = {"query": query}
    for step in pipeline.steps:
        sources[step.id] = run.submit(step, sources)
    return run, sources


def chunk_ids(value) -> list[str]:
    """The passages' ids of a step's output (rankings, or fused passages)."""
    return [p.chunk_id for item in value for p in (item.passages if isinstance(item, Ranking) else [item])]


def test_direct_results_equal_an_inline_execute(project):
    pipeline = project.pipeline("search")
    run, futures = submit_all(pipeline, DirectExecutor())
    results = settle(run, pipeline.steps, futures)

    ref = PipelineRef.of(pipeline)
    inline = {"query": StepResult(Query(text="q"))}
    for step in pipeline.steps:
        upstream = {port: [inline[p] for p in producers] if producers else [inline[port]]
                    for port, producers in step.wiring.items()}
        inline[step.id] = execute(StepCall(ref, step.id), upstream)
    assert [chunk_ids(r.value) for r in results] == [chunk_ids(inline[s.id].value) for s in pipeline.steps]
    assert {p.chunk_id for p in results[-1].value} == {"a|q", "b|q"}


def test_steps_run_on_the_pool_with_the_callers_context(project):
    MARK.set("caller's")
    run, futures = submit_all(project.pipeline("search"), DirectExecutor())
    settle(run, project.pipeline("search").steps, futures)
    assert SEEN["a"]["mark"] == SEEN["b"]["mark"] == "caller's"
    assert SEEN["a"]["thread"].startswith("ragline-step")


def test_a_failed_upstream_fails_its_downstream_without_running_it(project):
    pipeline = project.pipeline("broken")
    SEEN.clear()
    run, futures = submit_all(pipeline, DirectExecutor())
    with pytest.raises(StepFailed, match=r"pipeline 'broken', step 'a' \(task 'test_exec_echo'\) failed: "
                                         r"ValueError: a refuses"):
        settle(run, pipeline.steps, futures)
    with pytest.raises(StepFailed, match="step 'a'"):  # fuse got a's failure, not a run of its own
        futures["fuse"].result()
    assert "a" in SEEN


def test_a_step_waits_for_its_order_only_upstream(project):
    """``after`` without data: the step starts only once that future is done, and takes no input from it."""
    pipeline = project.pipeline("search")
    gate: Future = Future()
    executor = DirectExecutor()
    run = Run(pipeline, executor, PipelineRef.of(pipeline))
    SEEN.clear()
    started = run.submit(pipeline.step("a"), {"query": StepResult(Query(text="q"))}, after=[gate])
    time.sleep(0.3)
    assert "a" not in SEEN and not started.done()
    gate.set_result(StepResult(None))
    assert started.result(timeout=30).value[0].passages[0].chunk_id == "a|q"


def test_settle_reports_the_first_failing_step_in_order(project):
    pipeline = project.pipeline("search")
    first, later = Future(), Future()
    first.set_exception(RuntimeError("first"))
    later.set_exception(RuntimeError("later"))
    run = Run(pipeline, DirectExecutor(), PipelineRef.of(pipeline))
    with pytest.raises(RuntimeError, match="first"):
        settle(run, pipeline.steps[:2], {"a": first, "b": later})
