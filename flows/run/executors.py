"""Executors: how the steps of one run are started, in this process or as Prefect task runs.

Both run the same ``ragline.flows.run.steps.execute`` on the same plain-data ``StepCall``s, with upstream
outputs passed as inputs (futures the executor resolves), so results are identical either way.
Independent steps run concurrently in both, and both apply a step's ``retries``,
``retry_delay_seconds`` and ``timeout_seconds``.
"""
from __future__ import annotations

import contextvars
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import tenacity

from ragline.flows import telemetry
from ragline.flows.contracts import StepResult
from ragline.flows.spec.model import CompiledPipeline, CompiledStep
from ragline.flows.run.steps import WHEN_INPUT, PipelineRef, StepCall, StepTimedOut, execute
from ragline.flows.threads import call_with_timeout

_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ragline-step")


class DirectExecutor:
    """In this process: each step starts on a shared thread pool as soon as its inputs are ready
    (no worker ever blocks waiting for another), with Prefect's retry and timeout semantics."""

    def __init__(self, on_token: Callable[[str], None] | None = None):
        self.on_token = on_token
        self._context = contextvars.copy_context()  # the caller's (e.g. QUERY_ARRIVAL), for every step

    def submit(self, step: CompiledStep, call: StepCall, inputs: dict[str, list[Any]], after: list[Any],
               label: str) -> Future:
        out: Future = Future()
        deps = [f for results in inputs.values() for f in results if isinstance(f, Future)] + list(after)
        pending = [len(deps)]
        lock = threading.Lock()

        def start() -> None:
            # the inputs are let go of here: a dependency's callback list keeps this closure, and the
            # cycle through it would hold every finished batch's data until a full garbage collection
            nonlocal inputs, deps
            given, waited, inputs, deps = inputs, deps, {}, []
            failed = next((d for d in waited if d.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed.exception())
                return
            resolved = {port: [r.result() if isinstance(r, Future) else r for r in rs] for port, rs in given.items()}
            job = _POOL.submit(self._context.copy().run, run_with_policy, step,
                               lambda: execute(call, resolved, self.on_token))
            job.add_done_callback(lambda done: _transfer(done, out))

        def one_done(_: Future) -> None:
            with lock:
                pending[0] -= 1
                ready = pending[0] == 0
            if ready:
                start()

        if not deps:
            start()
        for dep in deps:
            dep.add_done_callback(one_done)
        return out

    @staticmethod
    def result(future: Any) -> StepResult:
        return future.result()


def _lists_from_state(step: CompiledStep, call: StepCall) -> bool:
    """A source step's listing (not its batch reads): it asks the sink's index state which items are
    unchanged, so it runs beside the sink, in this process (a worker elsewhere may not reach an
    embedded state; its batches' reads, ``stage.read``, go to the cluster)."""
    return step.stage.read is not None and call.hook is None


def _transfer(done: Future, out: Future) -> None:
    if done.exception() is not None:
        out.set_exception(done.exception())
    else:
        out.set_result(done.result())


def run_with_policy(step: CompiledStep, fn: Callable[[], StepResult]) -> StepResult:
    """Retries with a fixed delay and a per-attempt timeout: what Prefect applies to a task run."""
    spec = step.spec
    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(spec.retries + 1),
                                 wait=tenacity.wait_fixed(spec.retry_delay_seconds), reraise=True)
    return retrying(_with_timeout, step, fn) if spec.timeout_seconds else retrying(fn)


def _with_timeout(step: CompiledStep, fn: Callable[[], StepResult]) -> StepResult:
    """Give up on an attempt after ``timeout_seconds``."""
    try:
        return call_with_timeout(fn, step.spec.timeout_seconds, name=f"ragline-{step.id}")
    except TimeoutError:
        raise StepTimedOut(None, step.id, step.stage.name, step.spec.timeout_seconds) from None


class PrefectExecutor:
    """Each step is a Prefect task run named after the step (and batch); upstream futures are its
    parameters, so Prefect resolves them in the worker and records the lineage.

    With a cluster task runner (``task_runner``: Dask or Ray, started by ``with`` for the run; or a
    flow run whose own runner is not a thread pool) the steps run on the cluster, except the
    ingestion sink (plan, batch writes, finalize: ``stage.plan is not None``), a source's listing
    (it reads the sink's state for change signals) and any step that takes one of its results:
    those run on a thread pool of this process, so the embedded stores
    have a single writer here and never see a worker process. Cluster futures are parameters of
    the local task runs, resolved here."""

    def __init__(self, task_runner: Any = None):
        self.task_runner = task_runner  # a Dask/Ray task runner, not started; None: the flow's own
        self._stack = ExitStack()
        self._remote: Any = None  # started cluster task runner, when steps leave this process
        self._local: Any = None  # thread pool for the sink, beside a cluster

    def __enter__(self) -> "PrefectExecutor":
        from prefect.context import FlowRunContext
        from prefect.task_runners import ThreadPoolTaskRunner

        if self.task_runner is not None:
            self._remote = self._stack.enter_context(self.task_runner)
        else:
            own = getattr(FlowRunContext.get(), "task_runner", None)
            if own is not None and not isinstance(own, ThreadPoolTaskRunner):
                self._remote = own  # e.g. run_pipeline.with_options(task_runner=DaskTaskRunner())
        if self._remote is not None:
            self._local = self._stack.enter_context(ThreadPoolTaskRunner())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remote = self._local = None
        self._stack.close()

    def submit(self, step: CompiledStep, call: StepCall, inputs: dict[str, list[Any]], after: list[Any],
               label: str) -> Any:
        from prefect.futures import PrefectConcurrentFuture
        from ragline.flows.run.step_task import run_step  # lazy: Prefect loads only for orchestrated runs

        options = dict(name=step.id, task_run_name=label, retries=step.spec.retries,
                       retry_delay_seconds=step.spec.retry_delay_seconds, timeout_seconds=step.spec.timeout_seconds)
        task = run_step.with_options(**options)
        if self._remote is None:
            return task.submit(call, inputs, wait_for=after)
        deps = [f for results in inputs.values() for f in results] + list(after)
        here = step.stage.plan is not None or any(isinstance(f, PrefectConcurrentFuture) for f in deps) or \
            _lists_from_state(step, call)
        runner = self._local if here else self._remote
        return runner.submit(task, {"call": call, "inputs": inputs}, wait_for=after or None)

    @staticmethod
    def result(future: Any) -> StepResult:
        return future.result()


# ----------------------------------------------------------------------------- wiring
def _inputs(step: CompiledStep, sources: dict[str, Any]) -> dict[str, list[Any]]:
    """Each input port's producers (futures or StepResults): upstream steps, or a pipeline input."""
    inputs: dict[str, list[Any]] = {}
    for port, producers in step.wiring.items():
        if producers:
            inputs[port] = [sources[p] for p in producers]
        elif port in sources:
            inputs[port] = [sources[port]]
    if step.when is not None and step.when.step in sources:  # the classify step its condition reads
        inputs[WHEN_INPUT] = [sources[step.when.step]]
    return inputs


def _order_only(step: CompiledStep, sources: dict[str, Any]) -> list[Any]:
    """Upstream steps this one waits for without taking their output (``after`` without data)."""
    wired = {p for producers in step.wiring.values() for p in producers}
    return [sources[u] for u in step.upstream if u not in wired and u in sources]


@dataclass
class Run:
    """One pipeline run: what every step call shares."""

    pipeline: CompiledPipeline
    executor: Any
    ref: PipelineRef
    fingerprint: str = ""

    def submit(self, step: CompiledStep, sources: dict[str, Any], label: str | None = None,
               after: list[Any] = (), hook: str | None = None, inputs: dict[str, list[Any]] | None = None) -> Any:
        call = StepCall(self.ref, step.id, self.fingerprint, hook, telemetry.carrier())
        inputs = _inputs(step, sources) if inputs is None else inputs
        return self.executor.submit(step, call, inputs, _order_only(step, sources) + list(after), label or step.id)

    def result(self, future: Any) -> StepResult:
        return self.executor.result(future)


def settle(run: Run, steps: list[CompiledStep], futures: dict[str, Any]) -> list[StepResult]:
    """Wait for every step in order, so the first failure surfaces with its own message (a step
    downstream of a failed one never runs, and would only report that it is unfinished)."""
    return [run.result(futures[step.id]) for step in steps]


