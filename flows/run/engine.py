"""Running compiled pipelines, as Prefect flows (observable) or directly (no orchestration).

The pieces: ``executors`` (direct and Prefect), ``query_runner`` (query pipelines), ``ingest``
(the incremental-ingestion protocol), ``steps`` (one step as plain data, run in any process) and
``entrypoints`` (the importable Prefect flow and task).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ragline.flows.context import QUERY_ARRIVAL, QUERY_VECTORS
from ragline.flows.contracts import IngestPlan, PipelineKind
from ragline.flows.errors import DependencyUnavailable
from ragline.flows.run.driver import DRIVER, DriverHooks
from ragline.flows.run.executors import DirectExecutor, PrefectExecutor, run_with_policy
from ragline.flows.run.ingest import run_ingestion
from ragline.flows.spec.model import CompiledPipeline
from ragline.flows.run.pipeline import execute_pipeline
from ragline.flows.run.query_runner import coerce_inputs, run_query
from ragline.flows.run.steps import StepFailed, invoke

__all__ = ["run", "execute_pipeline", "DriverHooks", "DRIVER", "StepFailed", "IngestPlan", "invoke",
           "DirectExecutor", "PrefectExecutor", "run_with_policy", "coerce_inputs", "run_query", "run_ingestion",
           "PrefectUnavailable"]


class PrefectUnavailable(DependencyUnavailable):
    """An orchestrated run could not reach the Prefect API it is configured with; the message
    names the API and what to do, on one line."""

    error_code = "prefect_unavailable"
    dependency = "prefect"


def run(pipeline: CompiledPipeline, inputs: dict[str, Any] | None = None, *, orchestrate: bool = True,
        progress: Any = None, on_token: Callable[[str], None] | None = None, trace: list | None = None,
        on_step: Callable[[str, Any], None] | None = None) -> Any:
    """Run a pipeline: as a Prefect flow run (default) or directly in this process.
    ``on_token`` receives generated text as it streams (in-process only); ``trace`` (a list)
    receives (step id, seconds) for every step of a query pipeline; ``on_step`` (step id, output)
    for each query step as soon as it finishes."""
    inputs = inputs or {}
    if pipeline.kind == PipelineKind.QUERY:
        inputs = coerce_inputs(pipeline, inputs)  # a bad request fails here, before any flow run
    hooks = DriverHooks(progress, on_token, trace, on_step)
    if not orchestrate:
        arrival = QUERY_ARRIVAL.set(QUERY_ARRIVAL.get() or time.monotonic())
        vectors = QUERY_VECTORS.set({} if pipeline.kind == PipelineKind.QUERY else None)  # this query's own
        try:
            return execute_pipeline(pipeline, inputs, DirectExecutor(on_token), hooks)
        finally:
            QUERY_VECTORS.reset(vectors)
            QUERY_ARRIVAL.reset(arrival)
    from ragline.flows.run.entrypoints import run_as_flow

    try:
        return run_as_flow(pipeline, inputs, hooks)
    except StepFailed:
        raise
    except Exception as exc:
        unreachable = _prefect_unreachable(exc)
        if unreachable is None:
            raise
        raise unreachable from exc


def _prefect_unreachable(exc: BaseException) -> PrefectUnavailable | None:
    """A PrefectUnavailable when ``exc`` is the Prefect client failing to connect to its API, else
    None. Why: Prefect says only ``Failed to reach API at http://...`` (not which API, nor what to
    do), and a configured API on a closed port is the commonest way to meet it (issue 9)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = (PREFECT_API_URL.value() or "").rstrip("/")
    chain, current = [], exc
    while current is not None and len(chain) < 20:
        chain.append(current)
        current = current.__cause__ or current.__context__
    transport = next((e for e in chain if isinstance(e, httpx.TransportError)), None)
    said = any(str(e).startswith("Failed to reach API at") for e in chain)
    try:
        target = str(transport.request.url) if transport is not None else ""
    except RuntimeError:  # an httpx error without its request
        target = ""
    if not (said or (url and target.startswith(url))):
        return None
    cause = f" ({type(transport).__name__}: {transport})" if transport is not None else ""
    return PrefectUnavailable(
        f"Prefect API {url or '(not configured)'} unreachable{cause}: start it, or point PREFECT_API_URL at a "
        f"running server (unset, ragline starts its own), or run in this process with --no-prefect")
