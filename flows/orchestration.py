"""Prefect flow wrapping: one flow run per pipeline run, named after the pipeline."""
from __future__ import annotations

from typing import Any, Callable

from flows.compile import CompiledPipeline


def run_as_flow(pipeline: CompiledPipeline, inputs: dict[str, Any], body: Callable[[], Any]) -> Any:
    """Run ``body`` inside a Prefect flow run; in-process runs skip the ~1 s heartbeat wait."""
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    def pipeline_flow(pipeline_name: str, inputs: dict[str, Any]) -> Any:
        return body()

    named = flow(pipeline_flow, name=f"ragline-{pipeline.name}", validate_parameters=False,
                 persist_result=False, log_prints=False, flow_run_name=f"{pipeline.name}")
    shown = {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in inputs.items()}
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return named(pipeline_name=pipeline.name, inputs=shown)
