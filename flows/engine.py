"""Running compiled pipelines, as Prefect flows (observable) or directly (no orchestration).

Both executors run the same ``flows.steps.execute`` on the same plain-data ``StepCall``s, with
upstream outputs passed as inputs (futures the executor resolves), so results are identical
either way. Steps that do not depend on each other run concurrently in both, and both apply a
step's ``retries``, ``retry_delay_seconds`` and ``timeout_seconds``.

Ingestion runs are incremental: the sink's ``plan`` hook decides which documents changed, the
steps between the sources and the sink run once per batch of changed documents (pipelined:
different steps overlap across batches), and the sink's ``finalize`` hook removes deleted
sources and publishes derived indexes. The sink's ``session`` hook (the writer lease) spans it all.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pydantic import TypeAdapter, ValidationError

from ragline.flows.compile import CompiledPipeline, CompiledStep
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document, IndexReport, IngestPlan, Query, StepResult
from ragline.flows.steps import PipelineRef, StepCall, StepFailed, execute, invoke

__all__ = ["run", "execute_pipeline", "StepFailed", "IngestPlan", "invoke", "DirectExecutor", "PrefectExecutor"]


# ----------------------------------------------------------------------------- executors
_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ragline-step")


class DirectExecutor:
    """In this process: each step starts on a shared thread pool as soon as its inputs are ready
    (no worker ever blocks waiting for another), with Prefect's retry and timeout semantics."""

    def __init__(self, on_token: Callable[[str], None] | None = None):
        self.on_token = on_token

    def submit(self, step: CompiledStep, call: StepCall, inputs: dict[str, list[Any]], after: list[Any],
               label: str) -> Future:
        out: Future = Future()
        deps = [f for results in inputs.values() for f in results if isinstance(f, Future)] + list(after)
        pending = [len(deps)]
        lock = threading.Lock()

        def start() -> None:
            failed = next((d for d in deps if d.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed.exception())
                return
            resolved = {port: [r.result() if isinstance(r, Future) else r for r in rs] for port, rs in inputs.items()}
            job = _POOL.submit(run_with_policy, step, lambda: execute(call, resolved, self.on_token))
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


def _transfer(done: Future, out: Future) -> None:
    if done.exception() is not None:
        out.set_exception(done.exception())
    else:
        out.set_result(done.result())


def run_with_policy(step: CompiledStep, fn: Callable[[], StepResult]) -> StepResult:
    """Retries with a fixed delay and a per-attempt timeout: what Prefect applies to a task run."""
    spec = step.spec
    for attempt in range(spec.retries + 1):
        try:
            return _with_timeout(step, fn) if spec.timeout_seconds else fn()
        except Exception:
            if attempt == spec.retries:
                raise
            time.sleep(spec.retry_delay_seconds)
    raise AssertionError("unreachable")


def _with_timeout(step: CompiledStep, fn: Callable[[], StepResult]) -> StepResult:
    """Give up on an attempt after ``timeout_seconds`` (its thread finishes in the background, unused)."""
    attempt: Future = Future()

    def target() -> None:
        try:
            attempt.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            attempt.set_exception(exc)

    threading.Thread(target=target, name=f"ragline-{step.id}", daemon=True).start()
    try:
        return attempt.result(timeout=step.spec.timeout_seconds)
    except TimeoutError:
        raise StepFailed(f"step '{step.id}' (task '{step.stage.name}') timed out after "
                         f"{step.spec.timeout_seconds:g} s") from None


class PrefectExecutor:
    """Each step is a Prefect task run named after the step (and batch); upstream futures are its
    parameters, so Prefect resolves them in the worker and records the lineage.

    With a cluster task runner (``task_runner``: Dask or Ray, started by ``with`` for the run; or a
    flow run whose own runner is not a thread pool) the steps run on the cluster, except the
    ingestion sink (plan, batch writes, finalize: ``stage.plan is not None``) and any step that
    takes one of its results: those run on a thread pool of this process, so the embedded stores
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

        from ragline.flows.entrypoints import run_step

        options = dict(name=step.id, task_run_name=label, retries=step.spec.retries,
                       retry_delay_seconds=step.spec.retry_delay_seconds, timeout_seconds=step.spec.timeout_seconds)
        task = run_step.with_options(**options)
        if self._remote is None:
            return task.submit(call, inputs, wait_for=after)
        deps = [f for results in inputs.values() for f in results] + list(after)
        here = step.stage.plan is not None or any(isinstance(f, PrefectConcurrentFuture) for f in deps)
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
        call = StepCall(self.ref, step.id, self.fingerprint, hook)
        inputs = _inputs(step, sources) if inputs is None else inputs
        return self.executor.submit(step, call, inputs, _order_only(step, sources) + list(after), label or step.id)

    def result(self, future: Any) -> StepResult:
        return self.executor.result(future)


def settle(run: Run, steps: list[CompiledStep], futures: dict[str, Any]) -> list[StepResult]:
    """Wait for every step in order, so the first failure surfaces with its own message (a step
    downstream of a failed one never runs, and would only report that it is unfinished)."""
    return [run.result(futures[step.id]) for step in steps]


# ----------------------------------------------------------------------------- query pipelines
def coerce_inputs(pipeline: CompiledPipeline, inputs: dict[str, Any]) -> dict[str, Any]:
    if pipeline.kind == "query":
        query = inputs.get("query")
        if query is None:
            raise ValueError(f"pipeline '{pipeline.name}' needs a 'query' input")
        if isinstance(query, str):
            query = {"text": query}
        try:
            query = TypeAdapter(Query).validate_python(query)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'query'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"pipeline '{pipeline.name}': invalid query ({problems})") from None
        inputs = dict(inputs, query=query)
    return inputs


def run_query(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any, trace: list | None = None) -> Any:
    run = Run(pipeline, executor, PipelineRef.of(pipeline))
    sources: dict[str, Any] = {name: StepResult(value) for name, value in inputs.items()}
    for step in pipeline.steps:
        sources[step.id] = run.submit(step, sources)
    results = settle(run, pipeline.steps, sources)
    if trace is not None:
        trace.extend((step.id, result.seconds) for step, result in zip(pipeline.steps, results))
    return run.result(sources[pipeline.output]).value


# ----------------------------------------------------------------------------- ingestion pipelines
def _batches(documents: list[Document], size: int) -> Iterator[list[Document]]:
    for start in range(0, len(documents), size):
        yield documents[start:start + size]


def run_ingestion(pipeline: CompiledPipeline, executor: Any, progress: Any = None) -> IndexReport:
    sink = next((s for s in pipeline.steps if s.stage.plan is not None), None)
    if sink is None or sink.stage.session is None:
        return _ingest(pipeline, executor, progress)
    ctx = StepContext(pipeline=pipeline.name, step_id=sink.id, base_dir=str(pipeline.project.base_dir))
    with invoke(pipeline, sink, {}, ctx, hook=sink.stage.session):
        return _ingest(pipeline, executor, progress)


def _ingest(pipeline: CompiledPipeline, executor: Any, progress: Any) -> IndexReport:
    started = time.perf_counter()
    sources_steps = [s for s in pipeline.steps if not s.stage.inputs and s.stage.produces == "documents"]
    sink = next((s for s in pipeline.steps if s.stage.plan is not None), None)
    middle = [s for s in pipeline.steps if s not in sources_steps]
    run = Run(pipeline, executor, PipelineRef.of(pipeline), pipeline.fingerprint([s for s in middle if s is not sink]))

    loaded = {s.id: run.result(run.submit(s, {})) for s in sources_steps}
    origin = {d.source_id: sid for sid, result in loaded.items() for d in result.value}
    documents = [d for result in loaded.values() for d in result.value]
    failures = [f for result in loaded.values() for f in result.failures]
    covered = [c for result in loaded.values() for c in result.covered]

    if sink is None:
        plan = IngestPlan(to_index=documents, new={d.source_id for d in documents})
        plan_future = None
    else:
        given = {"documents": [StepResult(documents)], "failures": [StepResult(failures)],
                 "covered": [StepResult(covered)]}
        plan_future = run.submit(sink, {}, label=f"{sink.id}.plan", hook="plan", inputs=given)
        plan_result = run.result(plan_future)
        plan, failures = plan_result.value, failures + plan_result.failures
    report = IndexReport(unchanged=plan.unchanged)
    if progress is not None:
        progress.start(len(plan.to_index))
    in_flight: deque[tuple[list[Document], dict[str, Any]]] = deque()
    previous: dict[str, Any] = {}
    for number, batch in enumerate(_batches(plan.to_index, pipeline.spec.batch_size)):
        # Pipelined: each step takes the batches in order, but different steps overlap, so batch
        # n+1 is chunked (and batch n-1 written) while batch n is embedded. Two batches in flight.
        sources: dict[str, Any] = {sid: StepResult([d for d in batch if origin.get(d.source_id) == sid])
                                   for sid in loaded}
        for step in middle:
            sources[step.id] = run.submit(step, sources, label=f"{step.id}[batch {number}]",
                                          after=[previous[step.id]] if step.id in previous else [])
        previous = {step.id: sources[step.id] for step in middle}
        in_flight.append((batch, sources))
        if len(in_flight) > 1:
            report = _collect(run, in_flight.popleft(), middle, sink, report, progress, failures)
    while in_flight:
        report = _collect(run, in_flight.popleft(), middle, sink, report, progress, failures)
    if sink is not None and sink.stage.finalize is not None:
        final = run.result(run.submit(sink, {}, label=f"{sink.id}.finalize", hook="finalize",
                                      inputs={"plan": [plan_future]}))
        report = report.merge(final.value)
        failures += final.failures
    report.failures = failures
    report.failed = len({f.source_id for f in failures})
    report.roots = [c.path for c in covered] + [f.source_id for f in failures if f.root]
    report.seconds = time.perf_counter() - started
    return report


def _collect(run: Run, done: tuple[list[Document], dict[str, Any]], middle: list[CompiledStep],
             sink: CompiledStep | None, report: IndexReport, progress: Any, failures: list) -> IndexReport:
    """Wait for one batch; keep its failures; add its sink's report; advance the progress bar."""
    batch, sources = done
    results = settle(run, middle, sources)
    failures.extend(f for result in results for f in result.failures)
    value = run.result(sources[sink.id if sink else middle[-1].id]).value
    written = value.chunks_written if isinstance(value, IndexReport) else 0
    if progress is not None:
        progress.advance(len(batch), written)
    return report.merge(value) if isinstance(value, IndexReport) else report


# ----------------------------------------------------------------------------- entry points
@dataclass
class DriverHooks:
    """What only the calling process can use (a progress bar, streamed tokens, a trace list):
    never flow-run parameters, so a deployed run simply has none."""

    progress: Any = None
    on_token: Callable[[str], None] | None = None
    trace: list | None = None


DRIVER: ContextVar[DriverHooks] = ContextVar("ragline_driver_hooks", default=DriverHooks())


def execute_pipeline(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any,
                     hooks: DriverHooks | None = None) -> Any:
    """Run a pipeline on an executor (inside a flow run for the Prefect one)."""
    hooks = hooks or DriverHooks()
    if pipeline.kind == "ingestion":
        return run_ingestion(pipeline, executor, hooks.progress)
    return run_query(pipeline, coerce_inputs(pipeline, inputs), executor, hooks.trace)


def run(pipeline: CompiledPipeline, inputs: dict[str, Any] | None = None, *, orchestrate: bool = True,
        progress: Any = None, on_token: Callable[[str], None] | None = None, trace: list | None = None) -> Any:
    """Run a pipeline: as a Prefect flow run (default) or directly in this process.
    ``on_token`` receives generated text as it streams (in-process only); ``trace`` (a list)
    receives (step id, seconds) for every step of a query pipeline."""
    inputs = inputs or {}
    if pipeline.kind == "query":
        inputs = coerce_inputs(pipeline, inputs)  # a bad request fails here, before any flow run
    hooks = DriverHooks(progress, on_token, trace)
    if not orchestrate:
        return execute_pipeline(pipeline, inputs, DirectExecutor(on_token), hooks)
    from ragline.flows.entrypoints import run_as_flow

    return run_as_flow(pipeline, inputs, hooks)
