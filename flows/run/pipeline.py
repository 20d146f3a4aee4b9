"""One pipeline run on an executor, whatever runs it (this process, a flow run, a worker): an
ingestion through the incremental protocol, a query or job through the query runner; a job's
report is then published by the runner (``jobs``), never by its stage."""
from __future__ import annotations

from typing import Any

from ragline.flows import telemetry
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
    with telemetry.span(f"{pipeline.kind.value} {pipeline.name}", lambda: _run_attributes(pipeline, inputs)) as span:
        if span is not None and hasattr(hooks.progress, "trace"):  # a flow run: /v1/runs shows the trace id
            hooks.progress.trace(telemetry.trace_id(span))
        output = _execute(pipeline, inputs, executor, hooks)
        if span is not None and span.is_recording():  # sizes: the output step's span lists the ids and scores
            span.set_attributes(telemetry.clean(telemetry.describe_value("ragline.output", output, listed=False)))
        return output


def _execute(pipeline: CompiledPipeline, inputs: dict[str, Any], executor: Any, hooks: DriverHooks) -> Any:
    if pipeline.kind == PipelineKind.INGESTION:
        return run_ingestion(pipeline, executor, hooks.progress)
    output = run_query(pipeline, coerce_inputs(pipeline, inputs), executor, hooks.trace, hooks.on_step)
    return jobs.publish(pipeline, output) if pipeline.kind == PipelineKind.JOB else output


def _run_attributes(pipeline: CompiledPipeline, inputs: dict[str, Any]) -> dict[str, Any]:
    """The run span's attributes: the question's text only with ``trace_content``."""
    attributes: dict[str, Any] = {"ragline.pipeline": pipeline.name, "ragline.kind": pipeline.kind.value}
    query = inputs.get("query")
    text = query.get("text") if isinstance(query, dict) else getattr(query, "text", query)
    if isinstance(text, str):
        attributes["ragline.question.chars"] = len(text)
        if telemetry.content_on():
            attributes["ragline.question"] = text
    return attributes
