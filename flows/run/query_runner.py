"""Running a query pipeline: every step submitted at once, each starting when its inputs are ready."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any, Callable

from pydantic import TypeAdapter, ValidationError
from ragline.flows.contracts import Answer, PipelineKind, Query, Skipped, StepResult
from ragline.flows.errors import ConfigError, InputError
from ragline.flows.run.executors import Run, settle
from ragline.flows.spec.model import CompiledPipeline
from ragline.flows.resources.stores import filters
from ragline.flows.run.steps import PipelineRef

log = logging.getLogger("ragline.run")

# Set (to a dict) by a caller that wants every step's output of the query runs in its context: the
# served query log records the rewritten query and the passages retrieved, not just the answer.
STEP_OUTPUTS: ContextVar[dict[str, Any] | None] = ContextVar("ragline_step_outputs", default=None)


def coerce_inputs(pipeline: CompiledPipeline, inputs: dict[str, Any]) -> dict[str, Any]:
    if pipeline.kind == PipelineKind.QUERY:
        query = inputs.get("query")
        if query is None:
            raise InputError(f"pipeline '{pipeline.name}' needs a 'query' input", field="question")
        if isinstance(query, str):
            query = {"text": query}
        try:
            query = TypeAdapter(Query).validate_python(query)
            filters.validate(query.filters)  # a bad request, refused before any step runs (not a step failure)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'query'}: {e['msg']}" for e in exc.errors())
            raise InputError(f"pipeline '{pipeline.name}': invalid query ({problems})", field="question") from None
        except filters.FilterError as exc:
            raise InputError(f"pipeline '{pipeline.name}': invalid query (filters: {exc})", field="question") from None
        _check_collections(pipeline, query.collections)
        if query.labels:  # the decisions of this run's classify steps, never a client's
            query = query.model_copy(update={"labels": {}})
        inputs = dict(inputs, query=query)
    return inputs


def _check_collections(pipeline: CompiledPipeline, wanted: list[str] | None) -> None:
    """A query may name only collections its pipeline searches (pipelines.yaml `collections`)."""
    if wanted is None:
        return
    known = pipeline.collections
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        searched = f"it searches {', '.join(known)}" if known else "the file declares no collections"
        raise InputError(f"pipeline '{pipeline.name}': unknown collection{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(n) for n in unknown) or '(none named)'}; {searched}", field="collections")


def run_query(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any, trace: list | None = None,
              on_step: Callable[[str, Any], None] | None = None) -> Any:
    """Every step submitted at once; ``on_step`` sees each step's output as soon as it is ready."""
    run = Run(pipeline, executor, PipelineRef.of(pipeline))
    sources: dict[str, Any] = {name: StepResult(value) for name, value in inputs.items()}
    idle = idle_steps(pipeline)  # e.g. weighed 0 by every fuse step they feed: not run
    steps = [s for s in pipeline.steps if s.id not in idle]
    for step in pipeline.steps:
        sources[step.id] = StepResult([]) if step.id in idle else run.submit(step, sources)
        if on_step is not None and step.id not in idle:
            when_ready(sources[step.id], step.id, on_step)
    results = settle(run, steps, sources)
    if trace is not None:  # the steps that ran; those skipped are listed on the answer
        trace.extend((step.id, result.seconds) for step, result in zip(steps, results) if not result.skipped)
    outputs = STEP_OUTPUTS.get()
    if outputs is not None:
        outputs.update((step.id, result.value) for step, result in zip(steps, results) if not result.skipped)
    skipped = {step.id: result.skipped for step, result in zip(steps, results) if result.skipped}
    return with_skipped(pipeline, run.result(sources[pipeline.output]).value, skipped)


def when_ready(future: Any, step_id: str, on_step: Callable[[str, Any], None]) -> None:
    """Hands a step's output to ``on_step`` when its future completes. Registered before any later
    step is submitted, so with the direct executor it runs before the steps waiting for this one
    start (an evidence event precedes the generated tokens). A failed or skipped step hands nothing
    (the run reports its failure); a failing hook is logged, never the run's failure."""
    def ready(done: Any) -> None:
        try:
            result = done.result()
        except Exception:  # noqa: BLE001 - the step's failure is settle's to report
            return
        if not isinstance(result, StepResult) or result.skipped:
            return
        try:
            on_step(step_id, result.value)
        except Exception:  # noqa: BLE001 - a surface's hook must not fail the run
            log.warning("the step-output hook failed on step '%s'", step_id, exc_info=True)

    if isinstance(future, Future) or isinstance(getattr(future, "wrapped_future", None), Future):
        future.add_done_callback(ready)  # in this process only: a cluster's future would ask its API


def with_skipped(pipeline: CompiledPipeline, value: Any, skipped: dict[str, str]) -> Any:
    """The output, with the steps a condition left out listed on an answer; a run whose output
    step had nothing to give (every branch feeding it skipped) is an error naming them."""
    if isinstance(value, Skipped):
        raise ConfigError(f"pipeline '{pipeline.name}' produced no output: step '{pipeline.output}' was skipped "
                         f"({skipped.get(pipeline.output, 'no branch ran')})")
    if skipped and isinstance(value, Answer):
        return value.model_copy(update={"skipped": {**value.skipped, **skipped}})
    return value


def idle_steps(pipeline: CompiledPipeline) -> set[str]:
    """Steps whose output every consumer ignores as configured (``Stage.ignores``; fuse: weighed 0)
    and that are not the output: their work would be thrown away, so they are not run."""
    consumers: dict[str, list[bool]] = {}
    for step in pipeline.steps:
        ignored = step.stage.ignores(step.params, step.wiring) if step.stage.ignores else set()
        for upstream in step.upstream:
            consumers.setdefault(upstream, []).append(upstream in ignored)
    return {s.id for s in pipeline.steps if s.id != pipeline.output and consumers.get(s.id) and all(consumers[s.id])}
