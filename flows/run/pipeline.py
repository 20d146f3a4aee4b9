"""One pipeline run on an executor, whatever runs it (this process, a flow run, a worker): an
ingestion through the incremental protocol, a query or job through the query runner; a job's
report is then published by the runner (``jobs``), never by its stage."""
from __future__ import annotations

from typing import Any

from ragline.flows.contracts import PipelineKind
from ragline.flows.run import jobs
from ragline.flows.run.driver import DriverHooks
from ragline.flows.run.ingest import run_ingestion
from ragline.flows.run.query_runner import coerce_inputs, run_query
from ragline.flows.spec.model import CompiledPipeline


def execute_pipeline(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any,
                     hooks: DriverHooks | None = None) -> Any:
    """Run a pipeline on an executor (inside a flow run for the Prefect one)."""
    hooks = hooks or DriverHooks()
    if pipeline.kind == PipelineKind.INGESTION:
        return run_ingestion(pipeline, executor, hooks.progress)
    output = run_query(pipeline, coerce_inputs(pipeline, inputs), executor, hooks.trace)
    return jobs.publish(pipeline, output) if pipeline.kind == PipelineKind.JOB else output
