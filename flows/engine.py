"""Running compiled pipelines, as Prefect flows (observable) or directly (no orchestration).

Every step becomes a Prefect task run named after the step; steps that do not depend on each
other are submitted together and run concurrently. Inputs travel between tasks as futures
wrapped in ``quote`` so Prefect neither hashes nor walks large batches of chunks.

Ingestion runs are incremental: the sink's ``plan`` hook decides which documents changed,
the steps between the sources and the sink run once per batch of changed documents, and the
sink's ``finalize`` hook removes deleted sources and publishes derived indexes.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from pydantic import TypeAdapter, ValidationError

from flows.compile import CompiledPipeline, CompiledStep
from flows.context import StepContext
from flows.contracts import Document, Failure, IndexReport, Query


class StepFailed(RuntimeError):
    """A stage raised; the message names the pipeline and step."""


# ----------------------------------------------------------------------------- executors
class DirectExecutor:
    """Calls stages in order in this thread: the lowest overhead, for tight loops like evaluation."""

    def submit(self, step: CompiledStep, label: str, call: Callable[[], Any], deps: list[Any]) -> Future:
        future: Future = Future()
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - surfaced by result()
            future.set_exception(exc)
        return future

    @staticmethod
    def result(future: Any) -> Any:
        return future.result()


class PrefectExecutor:
    """Submits each step as a Prefect task run inside the current flow run."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, int, float, float | None], Any] = {}

    def _task(self, step: CompiledStep):
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        key = (step.id, step.spec.retries, step.spec.retry_delay_seconds, step.spec.timeout_seconds)
        if key not in self._tasks:
            self._tasks[key] = task(_call_thunk, name=step.id, cache_policy=NO_CACHE, persist_result=False,
                                    retries=step.spec.retries, retry_delay_seconds=step.spec.retry_delay_seconds,
                                    timeout_seconds=step.spec.timeout_seconds)
        return self._tasks[key]

    def submit(self, step: CompiledStep, label: str, call: Callable[[], Any], deps: list[Any]) -> Any:
        from prefect.utilities.annotations import quote

        return self._task(step).with_options(task_run_name=label).submit(quote(call), wait_for=deps)

    @staticmethod
    def result(future: Any) -> Any:
        return future.result()


def _call_thunk(call: Callable[[], Any]) -> Any:
    return call()


# ----------------------------------------------------------------------------- step execution
@dataclass
class RunState:
    pipeline: CompiledPipeline
    executor: Any
    fingerprint: str = ""
    contexts: list[StepContext] = field(default_factory=list)
    on_token: Callable[[str], None] | None = None

    def failures(self) -> list[Failure]:
        return [f for ctx in self.contexts for f in ctx.failures]

    def context(self, step: CompiledStep) -> StepContext:
        project = self.pipeline.project
        ctx = StepContext(pipeline=self.pipeline.name, step_id=step.id, fingerprint=self.fingerprint,
                          base_dir=str(project.base_dir),
                          prompt_name=step.prompt, render_prompt=project.prompts.render, on_token=self.on_token)
        self.contexts.append(ctx)
        return ctx

    def submit(self, step: CompiledStep, sources: dict[str, Any], label: str | None = None,
               after: list[Any] = ()) -> Any:
        """Submit ``step`` with its inputs taken from ``sources`` (step id or pipeline input -> value/future);
        ``after`` adds futures it must wait for without taking their output."""
        ctx = self.context(step)
        deps = [sources[p] for p in step.upstream if p in sources and _is_future(sources[p])] + list(after)
        executor = self.executor

        def call() -> Any:
            kwargs = {port: _gather(port, producers, sources, executor) for port, producers in step.wiring.items()}
            return invoke(self.pipeline, step, {k: v for k, v in kwargs.items() if v is not _MISSING}, ctx)

        return executor.submit(step, label or step.id, call, deps)


_MISSING = object()


def _is_future(value: Any) -> bool:
    return hasattr(value, "result") and callable(value.result)


def _gather(port: str, producers: list[str], sources: dict[str, Any], executor: Any) -> Any:
    """One input's value: a pipeline input, one producer's output, or several producers' lists joined."""
    if not producers:
        return sources.get(port, _MISSING)
    values = [executor.result(sources[p]) if _is_future(sources[p]) else sources[p] for p in producers]
    if len(values) == 1:
        return values[0]
    return [item for value in values for item in value]


def invoke(pipeline: CompiledPipeline, step: CompiledStep, inputs: dict[str, Any], ctx: StepContext,
           params: Any = None, hook: Callable[..., Any] | None = None) -> Any:
    """Call a stage (or one of its hooks) with its inputs, params, resources and context."""
    import inspect

    fn = hook or step.stage.fn
    accepted = inspect.signature(fn).parameters
    kwargs = dict(inputs)
    if "params" in accepted:
        kwargs["params"] = params or step.params
    if "ctx" in accepted:
        kwargs["ctx"] = ctx
    for role, name in step.resources.items():
        if role in accepted:
            kwargs[role] = pipeline.project.resource(name)
    started = time.perf_counter()
    try:
        return fn(**{k: v for k, v in kwargs.items() if k in accepted})
    except StepFailed:
        raise
    except Exception as exc:
        raise StepFailed(f"pipeline '{pipeline.name}', step '{step.id}' (task '{step.stage.name}') failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        ctx.seconds += time.perf_counter() - started


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


def settle(steps: list[CompiledStep], futures: dict[str, Any], executor: Any) -> None:
    """Wait for every step in order, so the first failure surfaces with its own message (a step
    downstream of a failed one never runs, and would only report that it is unfinished)."""
    for step in steps:
        executor.result(futures[step.id])


def run_query(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any,
              on_token: Callable[[str], None] | None = None, trace: list | None = None) -> Any:
    state = RunState(pipeline, executor, on_token=on_token)
    sources: dict[str, Any] = dict(inputs)  # already coerced by run()
    for step in pipeline.steps:
        sources[step.id] = state.submit(step, sources)
    try:
        settle(pipeline.steps, sources, executor)
    finally:
        if trace is not None:
            trace.extend((ctx.step_id, ctx.seconds) for ctx in state.contexts)
    return executor.result(sources[pipeline.output])


# ----------------------------------------------------------------------------- ingestion pipelines
@dataclass
class IngestPlan:
    """The sink's decision: which documents to (re)index and which sources to delete."""

    to_index: list[Document]
    new: set[str] = field(default_factory=set)
    updated: set[str] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0


def _batches(documents: list[Document], size: int) -> Iterator[list[Document]]:
    for start in range(0, len(documents), size):
        yield documents[start:start + size]


def run_ingestion(pipeline: CompiledPipeline, executor: Any, progress: Any = None) -> IndexReport:
    started = time.perf_counter()
    steps = pipeline.steps
    source_steps = [s for s in steps if not s.stage.inputs and s.stage.produces == "documents"]
    sink = next((s for s in steps if s.stage.plan is not None), None)
    middle = [s for s in steps if s not in source_steps]
    state = RunState(pipeline, executor, pipeline.fingerprint([s for s in middle if s is not sink]))

    loaded = {s.id: state.submit(s, {}) for s in source_steps}
    documents_by_source = {sid: executor.result(f) for sid, f in loaded.items()}
    origin = {d.source_id: sid for sid, docs in documents_by_source.items() for d in docs}
    documents = [d for docs in documents_by_source.values() for d in docs]
    failed_sources = [f.source_id for f in state.failures()]

    if sink is None:
        plan = IngestPlan(to_index=documents, new={d.source_id for d in documents})
    else:
        ctx = state.context(sink)
        plan = executor.result(executor.submit(sink, f"{sink.id}.plan", lambda: invoke(
            pipeline, sink, {"documents": documents, "failed_sources": failed_sources}, ctx, hook=sink.stage.plan), []))

    report = IndexReport(unchanged=plan.unchanged)
    if progress is not None:
        progress.start(len(plan.to_index))
    in_flight: deque[tuple[list[Document], dict[str, Any]]] = deque()
    previous: dict[str, Any] = {}
    for number, batch in enumerate(_batches(plan.to_index, pipeline.spec.batch_size)):
        # Pipelined: each step takes the batches in order, but different steps overlap, so batch
        # n+1 is chunked (and batch n-1 written) while batch n is embedded. Two batches in flight.
        sources: dict[str, Any] = {sid: [d for d in batch if origin.get(d.source_id) == sid] for sid in loaded}
        for step in middle:
            sources[step.id] = state.submit(step, sources, label=f"{step.id}[batch {number}]",
                                            after=[previous[step.id]] if step.id in previous else [])
        previous = {step.id: sources[step.id] for step in middle}
        in_flight.append((batch, sources))
        if len(in_flight) > 1:
            report = _collect(in_flight.popleft(), middle, sink, executor, report, progress)
    while in_flight:
        report = _collect(in_flight.popleft(), middle, sink, executor, report, progress)
    if sink is not None and sink.stage.finalize is not None:
        ctx = state.context(sink)
        final = executor.result(executor.submit(sink, f"{sink.id}.finalize", lambda: invoke(
            pipeline, sink, {"plan": plan}, ctx, hook=sink.stage.finalize), []))
        report = report.merge(final)
    report.failures = state.failures()
    report.failed = len({f.source_id for f in report.failures})
    report.seconds = time.perf_counter() - started
    return report


def _collect(done: tuple[list[Document], dict[str, Any]], middle: list[CompiledStep], sink: CompiledStep | None,
             executor: Any, report: IndexReport, progress: Any) -> IndexReport:
    """Wait for one batch; add its sink's report; advance the progress bar."""
    batch, sources = done
    settle(middle, sources, executor)
    result = executor.result(sources[sink.id if sink else middle[-1].id])
    written = result.chunks_written if isinstance(result, IndexReport) else 0
    if progress is not None:
        progress.advance(len(batch), written)
    return report.merge(result) if isinstance(result, IndexReport) else report


# ----------------------------------------------------------------------------- entry point
def run(pipeline: CompiledPipeline, inputs: dict[str, Any] | None = None, *, orchestrate: bool = True,
        progress: Any = None, on_token: Callable[[str], None] | None = None, trace: list | None = None) -> Any:
    """Run a pipeline: as a Prefect flow run (default) or directly in this thread.
    ``on_token`` receives generated text as it streams (stages that generate with ``stream``);
    ``trace`` (a list) receives (step id, seconds) for every step of a query pipeline."""
    inputs = inputs or {}
    if pipeline.kind == "query":
        inputs = coerce_inputs(pipeline, inputs)  # a bad request fails here, before any flow run
    if not orchestrate:
        return _dispatch(pipeline, inputs, DirectExecutor(), progress, on_token, trace)
    from flows.orchestration import run_as_flow

    return run_as_flow(pipeline, inputs,
                       lambda: _dispatch(pipeline, inputs, PrefectExecutor(), progress, on_token, trace))


def _dispatch(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any, progress: Any,
              on_token: Callable[[str], None] | None, trace: list | None) -> Any:
    if pipeline.kind == "ingestion":
        return run_ingestion(pipeline, executor, progress)
    return run_query(pipeline, inputs, executor, on_token, trace)
