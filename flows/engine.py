"""Running compiled pipelines, as Prefect flows (observable) or directly (no orchestration).

The pieces: ``executors`` (direct and Prefect), ``query_runner`` (query pipelines), ``ingest``
(the incremental-ingestion protocol), ``steps`` (one step as plain data, run in any process) and
``entrypoints`` (the importable Prefect flow and task).
"""
from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from ragline.flows.context import QUERY_ARRIVAL
from ragline.flows.contracts import IngestPlan
from ragline.flows.executors import DirectExecutor, PrefectExecutor, run_with_policy
from ragline.flows.ingest import run_ingestion
from ragline.flows.model import CompiledPipeline
from ragline.flows.query_runner import coerce_inputs, run_query
from ragline.flows.steps import StepFailed, invoke

__all__ = ["run", "execute_pipeline", "DriverHooks", "DRIVER", "StepFailed", "IngestPlan", "invoke",
           "DirectExecutor", "PrefectExecutor", "run_with_policy", "coerce_inputs", "run_query", "run_ingestion"]


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
        arrival = QUERY_ARRIVAL.set(QUERY_ARRIVAL.get() or time.monotonic())
        try:
            return execute_pipeline(pipeline, inputs, DirectExecutor(on_token), hooks)
        finally:
            QUERY_ARRIVAL.reset(arrival)
    from ragline.flows.entrypoints import run_as_flow

    return run_as_flow(pipeline, inputs, hooks)
