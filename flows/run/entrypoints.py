"""Importable Prefect entry points: the flow any deployment, worker or ``prefect deploy`` runs.

``run_pipeline`` takes JSON parameters and returns JSON, so a deployment can be created from it
(``run_pipeline.to_deployment(name="index", parameters={"pipeline": "index"})``) and triggered over
the Prefect API. Each step is the module-level task ``step_task.run_step``; its arguments are plain data and
upstream futures, so a thread, Dask or Ray task runner can run it.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal

import httpx
from prefect.flows import Flow
from prefect.task_runners import TaskRunner
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ragline.flows import settings, telemetry
from ragline.flows import context as step_context  # by module, like driver: a ContextVar cannot be pickled
from ragline.flows.run import artifacts
from ragline.flows.run import driver as drivers  # by module: the flow is pickled by value into Dask workers
from ragline.flows.run.driver import DriverHooks
from ragline.flows.run.executors import PrefectExecutor
from ragline.flows.run.pipeline import execute_pipeline
from ragline.flows.spec.compile import CompiledPipeline
from ragline.flows.contracts import DEFAULT_MAX_QUESTION_CHARS, IndexReport, PipelineKind, to_json
from ragline.flows.errors import RaglineError
from ragline.flows.spec.parse import RunnerSpec
from ragline.flows.run.steps import PipelineRef, digest_of, served_copy
from ragline.flows.resources.stores.filters import validate

FLOW_NAME = "ragline"  # deployments are "ragline/<name>"


class JsonFlow(Flow):
    """A Prefect flow whose parameters are JSON and pydantic models: recorded on its flow run as
    Prefect records them (``jsonable_encoder``: models dumped by alias), without importing FastAPI
    for that encoder (0.3 s, over 1 s on a loaded machine: a cost every CLI flow run paid). Anything
    else still goes through Prefect's own ``serialize_parameters``."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return json.loads(json.dumps(parameters, allow_nan=False, default=_model_as_json))
        except (TypeError, ValueError):
            return super().serialize_parameters(parameters)


def _model_as_json(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    raise TypeError(f"{type(value).__name__} is not JSON")


def json_flow(**options: Any):
    """``@prefect.flow(**options)``, making a ``JsonFlow``."""
    return lambda fn: JsonFlow(fn=fn, **options)


@json_flow(name=FLOW_NAME, flow_run_name="{pipeline}", validate_parameters=False, persist_result=False,
           log_prints=False)
def run_pipeline(pipeline: str, inputs: dict[str, Any] | None = None, file: str = "pipelines.yaml",
                 overrides: dict[str, dict[str, Any]] | None = None,
                 resources: dict[str, dict[str, Any]] | None = None, data_dir: str | None = None,
                 digest: str | None = None) -> Any:
    """Run one pipeline of a pipelines file; the result as JSON (an ingestion run's report, the
    passages of a search, the answer of an ask pipeline). An ingestion run that could not reach one
    of its roots ends Failed (``SourcesUnreachable``, which carries its report). ``digest``: run the copy of the
    file that ``ragline serve`` pinned (``steps.pin_file``), not the file as it is now.

    A run of a deployment takes only what the deployment allows (``deployment_refusal``): anything
    else ends Failed before the file is read."""
    from prefect.states import Failed

    given = dict(pipeline=pipeline, inputs=inputs, file=file, overrides=overrides, resources=resources,
                 data_dir=data_dir, digest=digest)
    refusal = deployment_refusal(given)
    if refusal is not None:
        return Failed(message=refusal)
    path = Path(file).resolve()
    source = str(served_copy(path, data_dir, digest)) if digest else None
    if source is not None and not Path(source).is_file():
        return Failed(message=f"the pipelines file this deployment was served with ({digest}) is gone from "
                              f"{Path(source).parent}: restart `ragline serve`")
    ref = PipelineRef(str(path), pipeline, overrides or {}, resources or {}, data_dir,
                      digest or digest_of(path), source)
    compiled = ref.resolve()
    if refusal := _query_refusal(compiled, inputs):
        return Failed(message=refusal)
    inputs = _triggered_access(compiled, inputs)
    if compiled.kind == PipelineKind.QUERY:
        _record_access(inputs)
    runner = task_runner(compiled.spec.runner)
    driver = drivers.DRIVER.get()
    progress = _run_progress(driver.progress) if compiled.kind == PipelineKind.INGESTION else driver.progress
    hooks = DriverHooks(progress, driver.on_token, driver.trace, driver.on_step)
    vectors = step_context.QUERY_VECTORS.set({} if compiled.kind == PipelineKind.QUERY else None)  # shared by steps
    try:
        with _api_for_workers(runner), PrefectExecutor(runner) as executor:
            result = execute_pipeline(compiled, inputs or {}, executor, hooks)
    finally:
        step_context.QUERY_VECTORS.reset(vectors)
        if isinstance(progress, RunProgress):
            progress.close()
        telemetry.flush()  # a deployment's run is a process of its own, which may exit next
    artifacts.publish(compiled.name, result)  # the run's report beside it on the dashboard
    if isinstance(result, IndexReport) and not result.incomplete:
        record_success(compiled)
    if isinstance(result, IndexReport) and result.incomplete:
        unreachable = SourcesUnreachable(result)  # returned, not raised: no traceback in the run's log
        return Failed(message=str(unreachable), data=unreachable)
    return to_json(result)


class SourcesUnreachable(RaglineError):
    """An ingestion run that could not reach one of its roots: the Failed state's data, so the
    process that ran the flow in-process gets the report back as the exception Prefect raises."""

    error_code = "sources_unreachable"

    def __init__(self, report: IndexReport | str):
        self.report = report if isinstance(report, IndexReport) else None
        if isinstance(report, str):  # rebuilt from a persisted result: the message only
            super().__init__(report)
            return
        unreachable = ", ".join(f.source_id for f in report.incomplete)
        super().__init__(f"source path(s) could not be reached ({unreachable}): nothing was deleted")


# ----------------------------------------------------------------------------- what a deployment may run
SERVED = "served_deployments"  # {deployment name: parameters}, set by `ragline serve` for its runs
PINNED = ("pipeline", "file", "overrides", "resources", "data_dir", "digest")  # fixed by the deployment
_DEFAULTS: dict[str, Any] = {"file": "pipelines.yaml"}


@contextmanager
def served_deployments(parameters: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Tell the flow-run processes this runner starts what each deployment was created with, so a
    run compares its parameters with that, not with what the Prefect API says now (anyone who can
    reach the API can also change a deployment's stored parameters)."""
    previous = settings.serve().served_deployments
    settings.export(SERVED, json.dumps(parameters))
    try:
        yield
    finally:
        settings.export(SERVED, json.dumps(previous) if previous else None)


REFUSED = "refused_parameters"  # the top-level parameters of a flow run that the flow does not take


@contextlib.contextmanager
def unknown_parameters_refused() -> Iterator[None]:
    """While open, a flow run this process's runner starts with a top-level parameter ``run_pipeline``
    does not take runs without it and is told its name (the ``refused_parameters`` setting, in the
    run's own environment), so ``deployment_refusal`` ends it Failed naming the parameter. Prefect
    would bind the parameters in the new process before its engine starts, and the run would end
    CRASHED ("exited with status code 1") with the reason only in serve's log. Wraps Prefect's
    ``run_flow_in_subprocess`` where its runner calls it (the seam Prefect documents for this)."""
    import prefect.runner._starter_direct as direct
    import prefect.runner.runner as runner

    modules = [module for module in (direct, runner) if hasattr(module, "run_flow_in_subprocess")]
    originals = [module.run_flow_in_subprocess for module in modules]
    for module, original in zip(modules, originals):
        module.run_flow_in_subprocess = _without_unknown_parameters(original)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.run_flow_in_subprocess = original


def _without_unknown_parameters(start: Callable[..., Any]) -> Callable[..., Any]:
    def start_flow_run(flow: Any, flow_run: Any = None, *args: Any, env: dict[str, str | None] | None = None,
                       **kwargs: Any) -> Any:
        taken = inspect.signature(flow.fn).parameters
        given = dict(getattr(flow_run, "parameters", None) or {})
        unknown = sorted(name for name in given if name not in taken)
        if unknown:
            flow_run = flow_run.model_copy(update={"parameters": {k: v for k, v in given.items() if k in taken}})
        env = {**(env or {}), settings.env_name(REFUSED): ",".join(unknown) or None}  # None: unset there
        return start(flow, *args, flow_run=flow_run, env=env, **kwargs)

    return start_flow_run


def deployment_refusal(given: dict[str, Any]) -> str | None:
    """Why a deployment's run must not run with ``given`` (None: it may, or it is no deployment's
    run: the CLI and in-process runs take overrides). Every parameter but ``inputs`` must be the
    one the deployment was created with; ``inputs`` is checked once the pipeline's kind is known."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context is not None and context.flow_run else None
    if deployment_id is None:
        return None
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
    name = f"{FLOW_NAME}/{deployment.name}"
    unknown = settings.serve().refused_parameters
    if unknown:
        return (f"deployment '{name}' refuses parameter {', '.join(repr(p) for p in unknown)}: the ragline flow "
                f"takes only {', '.join(inspect.signature(run_pipeline.fn).parameters)}")
    served = settings.serve().served_deployments
    expected = served.get(name, deployment.parameters or {})
    for parameter in PINNED:
        if _normal(given.get(parameter)) != _normal(expected.get(parameter, _DEFAULTS.get(parameter))):
            return (f"deployment '{name}' refuses parameter '{parameter}': a deployment runs only what it was "
                    f"created with (change pipelines.yaml and restart `ragline serve`, or run `ragline` locally)")
    return None


def _normal(value: Any) -> Any:
    return None if value in (None, {}, "") else value


def _deployment_run() -> bool:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def _triggered_access(pipeline: CompiledPipeline, inputs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A deployment's query run has no principal: it reads public documents only, or the groups of
    the ``triggered_groups`` setting (``*``: everything). Its parameters can never set the access
    (``DeployedQuery`` forbids the field); this is the only place it is given."""
    if pipeline.kind != PipelineKind.QUERY or not _deployment_run():
        return inputs
    groups = settings.serve().triggered_groups
    query = dict(inputs or {}).get("query")
    query = {"text": query} if isinstance(query, str) else dict(query or {})
    query["access"] = None if "*" in groups else frozenset(groups)
    return {**(inputs or {}), "query": query}


def _record_access(inputs: dict[str, Any] | None) -> None:
    """A query run's access as a label of its flow run (``ACCESS_LABEL``): its stored result may
    hold any document that access reads, so ``GET /v1/runs/{id}`` shows it only to readers of all
    of them. Best effort: a run without the label counts as one that read everything."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    query = (inputs or {}).get("query")
    access = query.get("access") if isinstance(query, dict) else getattr(query, "access", None)
    progress = RunProgress(context.flow_run.id)
    try:
        progress._labels({ACCESS_LABEL: "*" if access is None else ",".join(sorted(access))})
    finally:
        progress.close()


def _query_refusal(pipeline: CompiledPipeline, inputs: dict[str, Any] | None) -> str | None:
    """A deployment's query run takes the question, its history and filters, checked as the HTTP
    API checks them (length, roles, filter shape); an ingestion or job run takes no inputs."""
    if not _deployment_run():
        return None
    if pipeline.kind != PipelineKind.QUERY:
        return None if not inputs else (f"pipeline '{pipeline.name}' ({pipeline.kind}) refuses parameter 'inputs': "
                                        f"its deployment takes no parameters")
    try:
        DeployedInputs.model_validate(inputs or {})
    except ValidationError as exc:
        problems = "; ".join(f"'{'.'.join(['inputs', *map(str, e['loc'])])}': {e['msg']}" for e in exc.errors())
        return f"pipeline '{pipeline.name}' refuses parameter {problems}"
    return None


class DeployedTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: str


class DeployedQuery(BaseModel):
    """What a triggered query may carry: the API's question, history and filters, nothing else
    (not the pipeline-internal fields of ``Query``: variants, instruction, ...)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    history: list[DeployedTurn] = Field(default_factory=list)
    filters: dict[str, Any] | None = None

    @field_validator("text")
    @classmethod
    def _question(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        if len(value) > DEFAULT_MAX_QUESTION_CHARS:
            raise ValueError(f"the question is {len(value):,} characters long; the limit is "
                             f"{DEFAULT_MAX_QUESTION_CHARS:,}")
        return value

    @field_validator("filters")
    @classmethod
    def _filters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:

        validate(value)
        return value


class DeployedInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: DeployedQuery

    @field_validator("query", mode="before")
    @classmethod
    def _plain_text(cls, value: Any) -> Any:
        return {"text": value} if isinstance(value, str) else value


# ----------------------------------------------------------------------------- success, for /metrics
LAST_SUCCESS, LAST_SCHEDULED_SUCCESS = "last_success:", "last_scheduled_success:"  # + pipeline: state-DB meta keys


def record_success(pipeline: CompiledPipeline) -> None:
    """Note in the index's state DB when this ingestion pipeline last succeeded (and, for a run
    its deployment's schedule made, that too): what ``/metrics`` reports. Best effort."""
    from prefect.context import FlowRunContext

    sink = pipeline.sink
    name = sink.resources.get("state") if sink is not None else None
    if name is None:
        return
    context = FlowRunContext.get()
    scheduled = bool(context is not None and context.flow_run is not None and context.flow_run.auto_scheduled)
    now = repr(time.time())
    try:
        state = pipeline.project.resource(name)
        state.set_meta(LAST_SUCCESS + pipeline.name, now)
        if scheduled:
            state.set_meta(LAST_SCHEDULED_SUCCESS + pipeline.name, now)
    except Exception as exc:  # noqa: BLE001 - a metric's source, never a reason to fail the run
        logging.getLogger("ragline.progress").warning("could not record the success of %s: %s", pipeline.name, exc)


# ----------------------------------------------------------------------------- progress on the flow run
PROGRESS_LABEL = "ragline.progress."  # flow-run labels: phase, documents_planned, documents_done, chunks_written
TRACE_LABEL = "ragline.trace_id"  # the run's OpenTelemetry trace id, when traced
ACCESS_LABEL = "ragline.access"  # a query run's access: '*' (every document) or its groups, comma-separated


class RunProgress:
    """An ingestion run's progress as labels of its flow run (what ``GET /v1/runs/{id}`` and the
    dashboard read: the run is another process), passed on to the driver's bar when there is one.
    Best effort: a label that cannot be written never fails the run. One API client for all its
    writes (a new one per label cost 0.1-0.4 s: its TLS context, its CSRF token): ``close()`` it."""

    def __init__(self, flow_run_id: Any, driver: Any = None):
        self.flow_run_id, self.driver = flow_run_id, driver
        self.done = self.chunks = 0
        self._client: Any = None
        self._lock = threading.Lock()

    def phase(self, name: str) -> None:
        self._label(phase=name)
        if self.driver is not None and hasattr(self.driver, "phase"):
            self.driver.phase(name)

    def trace(self, trace_id: str | None) -> None:
        """The run's trace id, for ``GET /v1/runs/{id}``."""
        if trace_id:
            self._labels({TRACE_LABEL: trace_id})

    def start(self, total_documents: int) -> None:
        self._label(documents_planned=total_documents, documents_done=0, chunks_written=0)
        if self.driver is not None:
            self.driver.start(total_documents)

    def advance(self, documents: int, chunks: int) -> None:
        self.done += documents
        self.chunks += chunks
        self._label(documents_done=self.done, chunks_written=self.chunks)
        if self.driver is not None:
            self.driver.advance(documents, chunks)

    def _label(self, **values: Any) -> None:
        self._labels({PROGRESS_LABEL + k: v for k, v in values.items()})

    def _labels(self, values: dict[str, Any]) -> None:
        from prefect.client.orchestration import get_client

        try:
            with self._lock:
                if self._client is None:
                    self._client = get_client(sync_client=True, httpx_settings=_busy_retrying()).__enter__()
                self._client.update_flow_run_labels(self.flow_run_id, values)
        except Exception as exc:  # noqa: BLE001 - progress is a courtesy
            logging.getLogger("ragline.progress").debug("could not record progress %s: %s", values, exc)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.__exit__(None, None, None)


BUSY_RETRY_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8)  # seconds before each new attempt at a 503 from the API


def _busy_retrying() -> dict[str, Any] | None:
    """httpx settings for a Prefect client whose writes of a flow run's labels meet a busy server.
    Prefect's server reads then writes the labels in one SQLite transaction, which fails (503,
    SQLITE_BUSY_SNAPSHOT) whenever it recorded a task run's state in between, often just after a
    step ends; Prefect's client then waits 2 s (4, 8...) before its next attempt: seconds a command
    waited on every other run. This transport asks again after a short pause first. Plain HTTP APIs
    only (ragline's local server among them): an HTTPS one keeps the transport Prefect builds (its TLS settings)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or ""
    return {"transport": BusyRetryTransport()} if url.startswith("http://") else None


class BusyRetryTransport(httpx.BaseTransport):
    """An httpx transport that sends a request again, after ``BUSY_RETRY_PAUSES``, while the
    server answers 503; the last answer goes to the client (whose own retries then apply)."""

    def __init__(self):
        # Plain HTTP only: no TLS context to build (0.05-0.3 s); connection retries as Prefect sets them
        self._inner = httpx.HTTPTransport(verify=False, retries=3)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":  # e.g. redirected to HTTPS: not through an unverified transport
            raise httpx.UnsupportedProtocol(f"{request.url.scheme} is not sent by this transport: {request.url}")
        for pause in (*BUSY_RETRY_PAUSES, None):
            response = self._inner.handle_request(request)
            if response.status_code != 503 or pause is None:
                return response
            response.read()
            response.close()
            time.sleep(pause)

    def close(self) -> None:
        self._inner.close()


@contextmanager
def prefect_settings(section: str, **values: Any) -> Iterator[None]:
    """Prefect's settings with some fields of one section replaced, for this context. A copy of the
    current settings, not ``temporary_settings``'s revalidation of every setting (0.1-0.3 s, and
    more on a loaded machine): for fields that no other setting is derived from."""
    from prefect.context import SettingsContext

    context = SettingsContext.get()
    current = context.settings
    replaced = getattr(current, section).model_copy(update=values)
    with SettingsContext(profile=context.profile, settings=current.model_copy(update={section: replaced})):
        yield


def _run_progress(driver: Any) -> Any:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return driver
    return RunProgress(context.flow_run.id, driver)


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
    if pipeline.kind == PipelineKind.INGESTION:
        return IndexReport
    return pipeline.step(pipeline.output).stage.output_type


def run_as_flow(pipeline: CompiledPipeline, inputs: dict[str, Any], hooks: DriverHooks) -> Any:
    """Run ``pipeline`` as a flow run of ``run_pipeline`` from this process (the CLI's default for
    ingestion), with this process's progress bar; in-process runs skip the ~1 s heartbeat wait."""
    from pydantic import TypeAdapter

    ref = PipelineRef.of(pipeline)
    parameters = dict(pipeline=ref.pipeline, inputs=to_json(inputs), file=ref.file, overrides=ref.overrides,
                      resources=ref.resources, data_dir=ref.data_dir)
    token = drivers.DRIVER.set(hooks)
    try:
        # The plain call returns the flow's in-memory return value (raises what it raised). Its final
        # state may instead be the API's copy, without data, when a loaded server answered the
        # proposal of that state late and the client's retry was told the run had already ended.
        with prefect_settings("flows", heartbeat_frequency=None):
            value = run_pipeline(**parameters)
    except SourcesUnreachable as unreachable:
        if unreachable.report is None:
            raise
        return unreachable.report
    finally:
        drivers.DRIVER.reset(token)
    return TypeAdapter(output_type(pipeline)).validate_python(value)
