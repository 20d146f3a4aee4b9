"""Importable Prefect entry points: the flow any deployment, worker or ``prefect deploy`` runs.

``run_pipeline`` takes JSON parameters and returns JSON, so a deployment can be created from it
(``run_pipeline.to_deployment(name="index", parameters={"pipeline": "index"})``) and triggered over
the Prefect API. Each step is the module-level task ``run_step``; its arguments are plain data and
upstream futures, so a thread, Dask or Ray task runner can run it.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner

from ragline.flows import engine
from ragline.flows.compile import CompiledPipeline
from ragline.flows.contracts import IndexReport, StepResult, to_json
from ragline.flows.spec import RunnerSpec
from ragline.flows.steps import PipelineRef, StepCall, digest_of, execute


@task(name="step", cache_policy=NO_CACHE, persist_result=False)
def run_step(call: StepCall, inputs: dict[str, list[StepResult]]) -> StepResult:
    """One step of one run; Prefect has already resolved the upstream futures in ``inputs``. On a
    thread of the calling process the driver's token callback streams too (Prefect copies the
    context into its worker threads); elsewhere there is none."""
    return execute(call, inputs, engine.DRIVER.get().on_token)


@flow(name="ragline", flow_run_name="{pipeline}", validate_parameters=False, persist_result=False, log_prints=False)
def run_pipeline(pipeline: str, inputs: dict[str, Any] | None = None, file: str = "pipelines.yaml",
                 overrides: dict[str, dict[str, Any]] | None = None,
                 resources: dict[str, dict[str, Any]] | None = None, data_dir: str | None = None) -> Any:
    """Run one pipeline of a pipelines file; the result as JSON (an ingestion run's report, the
    passages of a search, the answer of an ask pipeline). An ingestion run that could not reach one
    of its roots ends Failed, with its report as the state's data."""
    path = Path(file).resolve()
    ref = PipelineRef(str(path), pipeline, overrides or {}, resources or {}, data_dir, digest_of(path))
    compiled = ref.resolve()
    runner = task_runner(compiled.spec.runner)
    with _api_for_workers(runner), engine.PrefectExecutor(runner) as executor:
        result = engine.execute_pipeline(compiled, inputs or {}, executor, engine.DRIVER.get())
    payload = to_json(result)
    if isinstance(result, IndexReport) and result.incomplete:
        from prefect.states import Failed

        unreachable = ", ".join(f.source_id for f in result.incomplete)
        return Failed(message=f"source path(s) could not be reached ({unreachable}): nothing was deleted",
                      data=payload)
    return payload


def task_runner(runner: RunnerSpec) -> TaskRunner | None:
    """The cluster task runner a pipeline's ``runner:`` names (not started: the run enters it, and
    leaves it when done, which stops a local cluster); None for ``thread``, the flow's own pool.
    Chosen inside the flow, so a deployment-triggered run uses it exactly like an in-process one."""
    if runner.type == "thread":
        return None
    if runner.type == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as exc:
            raise ImportError(f"runner type 'dask' needs prefect-dask: install ragline[dask] "
                              f"(pip install 'ragline[dask]'); {exc}") from exc
        if runner.address:
            return DaskTaskRunner(address=runner.address)
        local = dict(n_workers=runner.n_workers, threads_per_worker=runner.threads_per_worker,
                     processes=runner.processes)
        return DaskTaskRunner(cluster_kwargs={k: v for k, v in local.items() if v is not None})
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as exc:
        raise ImportError(f"runner type 'ray' needs prefect-ray: install ragline[ray] "
                          f"(pip install 'ragline[ray]'); {exc}") from exc
    return RayTaskRunner(address=runner.address,
                         init_kwargs={"num_cpus": runner.n_workers} if runner.n_workers else None)


@contextmanager
def _api_for_workers(runner: TaskRunner | None) -> Iterator[None]:
    """Worker processes record their task runs through the Prefect API named in the settings they
    receive with each task. Prefect's temporary server (no PREFECT_API_URL set) is not named there,
    so each worker would start a server of its own: name this run's. (A cluster on other machines
    needs a PREFECT_API_URL they can reach.)"""
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    context = FlowRunContext.get()
    if runner is None or PREFECT_API_URL.value() or context is None:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: str(context.client.api_url).rstrip("/")}):
        yield


def output_type(pipeline: CompiledPipeline) -> Any:
    if pipeline.kind == "ingestion":
        return IndexReport
    return pipeline.step(pipeline.output).stage.output_type


def run_as_flow(pipeline: CompiledPipeline, inputs: dict[str, Any], hooks: engine.DriverHooks) -> Any:
    """Run ``pipeline`` as a flow run of ``run_pipeline`` from this process (the CLI's default for
    ingestion), with this process's progress bar; in-process runs skip the ~1 s heartbeat wait."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from pydantic import TypeAdapter

    ref = PipelineRef.of(pipeline)
    parameters = dict(pipeline=ref.pipeline, inputs=to_json(inputs), file=ref.file, overrides=ref.overrides,
                      resources=ref.resources, data_dir=ref.data_dir)
    token = engine.DRIVER.set(hooks)
    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            state = run_pipeline(**parameters, return_state=True)
    finally:
        engine.DRIVER.reset(token)
    value = state.result(raise_on_failure=False)
    if isinstance(value, BaseException):
        raise value
    return TypeAdapter(output_type(pipeline)).validate_python(value)
