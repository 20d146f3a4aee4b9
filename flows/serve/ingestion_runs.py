"""Ingestion jobs and run status: what ``POST /v1/ingest`` and ``GET /v1/runs/{id}``
(``flows/serve/routers/runs.py``) and the document API (``routers/documents.py``) share: one
``_Runs`` per file, which starts the deployments' flow runs (serialised) and reads their status.
The routers are mounted by the API app (``flows/serve/app.py``) that ``ragline serve`` runs beside
the Prefect runner serving the file's deployments (``flows/serve/supervise/service.py``).

- ``POST /v1/ingest`` ``{"pipeline": "index"}`` creates a flow run of that ingestion pipeline's
  deployment (``ragline/<pipeline>``) and answers 202 ``{"run_id", "pipeline", "state"}``. It
  answers 409, naming the holder, while a run writing the same index (this pipeline, or any
  ingestion pipeline of the file with the same state DB) is pending, running or due to start
  (checked on the Prefect API), or while the index's writer lease is held (a ``ragline index``
  run, a run of another server). 404: no such pipeline; 400: a query pipeline; 503: not deployed
  or the Prefect API is unreachable or has not answered within 20 s (``Retry-After``). Concurrent
  requests are serialised, so two POSTs can never both start a run.
- ``GET /v1/runs/{id}`` reports a run of this file's pipelines (deployment-triggered, scheduled,
  or ``ragline index``): state, times, the persisted JSON result once completed (the IndexReport
  of an ingestion run, also for a run that failed because a root was unreachable; the answer or
  passages of a query run; shown only to a credential that reads every document the query could,
  ``shown_to``; a job run's only to a credential that reads every document), the ingestion summary line, per-document failures (to a credential with the
  ingest scope only: they name documents and paths, ``without_failure_details``), the failure
  message, and for a running ingestion run its progress (see ``progress``). 404 for any other id.

Progress comes from what the run records, read live: its phase (waiting for the lease, listing,
then converting/chunking/embedding/writing as its steps run, publishing) and the documents it
planned, indexed and the chunks it wrote, which the run sets as labels of its flow run
(``entrypoints.RunProgress``, fed by the ingestion's progress hooks); completed ``<sink>[batch n]``
task runs on the Prefect API (each is one batch written), the steps running now, the documents the
state DB recorded since the run started and the writer lease's heartbeat (every 5 s while the run
holds the index).

Job runs (tune, adapt, summarize) are listed and shown only to a credential with the ``admin`` scope
(``may_see_runs``): to any other they do not exist (404).

Nothing returned names the pipelines file or the data dir: messages and failure reasons have
those paths (and any absolute path outside the configured source roots) replaced.
"""
from __future__ import annotations

import asyncio
import datetime
import sqlite3
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.serve.query_service import ApiError
from ragline.flows.serve.auth.principals import collections_of, may_read
from ragline.flows.spec.compile import Project, load_project
from ragline.flows.contracts import PipelineKind
from ragline.flows.serve.layout import data_dir_of, deployment_name
from ragline.flows.serve.redact import Redactor
from ragline.flows.run.entrypoints import ACCESS_LABEL, FLOW_NAME, PROGRESS_LABEL, TRACE_LABEL
from ragline.flows.contracts import IndexReport
from ragline.flows.resources.stores.state import StorageError, StoreDamaged

ACTIVE = ("PENDING", "RUNNING", "CANCELLING")
DUE_SLACK_SECONDS = 5.0  # a scheduled run due this soon counts as started
LEASE_STALE_SECONDS = 30.0  # as IndexState.lease: a holder silent this long has lost the lease
PREFECT_DEADLINE_SECONDS = 20.0  # an API answer that needs the Prefect API waits this long for it at most
PROGRESS_WAIT = 10.0  # seconds a status poll spends on the progress courtesy at most
STATUS_READ_WAIT = 2.0  # seconds a status poll waits on a committing writer before it goes without the count
LIST_PAGE, LIST_PAGES = 100, 5  # runs read per Prefect call, calls at most (other files' runs are skipped)
STATE_TYPES = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING", "COMPLETED", "FAILED", "CRASHED",
               "CANCELLED")
STEP_PHASES = {"convert": "converting", "chunk": "chunking", "embed": "embedding"}  # by stage, in pipeline order


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipeline: str = Field("index", min_length=1, description="an ingestion pipeline of the served file")
    collection: str | None = Field(None, min_length=1, description="with collections declared: the collection "
                                   "whose ingestion runs (``<pipeline>@<collection>``); may be left out when "
                                   "there is one")


class IngestAccepted(BaseModel):
    run_id: str
    pipeline: str
    state: str = Field(description="Prefect state type, e.g. SCHEDULED")
    state_name: str = Field(description="Prefect state name, e.g. Scheduled")


class RunStatus(BaseModel):
    id: str
    pipeline: str
    kind: str
    state: str = Field(description="Prefect state type: SCHEDULED, PENDING, RUNNING, COMPLETED, FAILED, CRASHED, "
                                   "CANCELLED, ...")
    state_name: str = Field(description="Prefect state name, e.g. Late, AwaitingConcurrencySlot, Completed")
    created: str | None = None
    started: str | None = None
    ended: str | None = None
    result: Any = Field(None, description="the persisted JSON result: an ingestion run's report, a query's output "
                                          "(withheld from a credential that may not read every document the query "
                                          "could)")
    summary: str | None = Field(None, description="an ingestion run's summary line")
    failures: list[dict[str, Any]] = Field(default_factory=list, description="documents that could not be indexed")
    message: str | None = Field(None, description="why a run failed, crashed or was cancelled, or its result "
                                                  "was withheld")
    progress: dict[str, Any] | None = Field(None, description="a running ingestion run's progress")
    trace_id: str | None = Field(None, description="the run's OpenTelemetry trace id (32 hex digits), when traced")


class RunSummary(BaseModel):
    """One run in ``GET /v1/runs``: what it is and where it stands, without its result."""

    id: str
    pipeline: str
    kind: str
    state: str
    state_name: str
    created: str | None = None
    started: str | None = None
    ended: str | None = None
    trace_id: str | None = None


class RunList(BaseModel):
    runs: list[RunSummary] = Field(description="newest first")


# ----------------------------------------------------------------------------- the router
class _Runs:
    """What the endpoints share: the compiled project, deployment ids, index groups, a lock."""

    def __init__(self, project: Project):
        self.project = project
        self.file = str(project.path.resolve())
        self.redact = Redactor(project)
        self.deployment_ids: dict[str, UUID] = {}
        self.lock = asyncio.Lock()
        self.sinks: dict[str, Any] = {}
        self.state_resource: dict[str, str | None] = {}
        for name, pipeline in project.pipelines.items():
            if pipeline.kind != PipelineKind.INGESTION:
                continue
            sink = pipeline.sink
            self.sinks[name] = sink
            self.state_resource[name] = sink.resources.get("state") if sink is not None else None

    # -- the index a pipeline writes, and who else writes it
    def state_path(self, pipeline: str) -> Path | None:
        resource = self.state_resource.get(pipeline)
        if resource is None:
            return None
        return (data_dir_of(self.project) / self.project.spec.resources[resource].path).resolve()

    def same_index(self, pipeline: str) -> list[str]:
        path = self.state_path(pipeline)
        if path is None:
            return [pipeline]
        return [name for name in self.state_resource if self.state_path(name) == path]

    def has_state(self, pipeline: str) -> bool:
        """Whether a status read of the pipeline's state can find one: a database state always (its
        reads create nothing), a state file once it exists."""
        resource = self.state_resource.get(pipeline)
        if resource is None:
            return False
        path = self.state_path(pipeline)
        return bool(getattr(self.project.spec.resources[resource], "url", None)) or (path is not None and path.exists())

    def lease_holder(self, pipeline: str):
        resource = self.state_resource.get(pipeline)
        if not self.has_state(pipeline):
            return None
        holder = self.project.resource(resource).lease_holder(wait=STATUS_READ_WAIT)  # busy: sqlite3.Error
        if holder is None or holder.stale(time.time(), LEASE_STALE_SECONDS):
            return None
        return holder

    def documents_written_since(self, pipeline: str, since: datetime.datetime) -> int | None:
        resource = self.state_resource.get(pipeline)
        if not self.has_state(pipeline):
            return None
        try:
            return self.project.resource(resource).sources_indexed_since(since.timestamp(), wait=STATUS_READ_WAIT)
        except (sqlite3.Error, StorageError, StoreDamaged):  # a status line without the count, not a failure
            return None

    # -- Prefect
    async def deployment_id(self, client: Any, pipeline: str) -> UUID | None:
        from prefect.exceptions import ObjectNotFound

        if pipeline not in self.deployment_ids:
            try:
                deployment = await client.read_deployment_by_name(deployment_name(self.project, pipeline))
            except ObjectNotFound:
                return None
            if (deployment.parameters or {}).get("file") != self.file:
                return None  # the same name, deployed from another file: not ours
            self.deployment_ids[pipeline] = deployment.id
        return self.deployment_ids[pipeline]

    async def learn_deployments(self, client: Any) -> None:
        """This file's deployment ids (cached), which ``owns`` and ``recent`` tell its runs by."""
        for name in self.project.pipelines:
            await self.deployment_id(client, name)

    async def running(self, client: Any, pipeline: str) -> str | None:
        """Why a new run of ``pipeline`` must not start now (None: it may)."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterExpectedStartTime,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.sorting import FlowRunSort

        group = self.same_index(pipeline)
        ids = {name: await self.deployment_id(client, name) for name in group}
        by_id = {dep: name for name, dep in ids.items() if dep is not None}
        if by_id:
            deployments = FlowRunFilterDeploymentId(any_=list(by_id))
            due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=DUE_SLACK_SECONDS)
            # One query for both (a run due now or started): with two, a run leaving SCHEDULED for PENDING
            # between them was seen by neither and a second run started beside it. A started run was due
            # (its expected start is past); the second filter catches one started ahead of its schedule.
            filters = [
                FlowRunFilter(deployment_id=deployments,
                              state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED", *ACTIVE])),
                              expected_start_time=FlowRunFilterExpectedStartTime(before_=due)),
                FlowRunFilter(deployment_id=deployments, state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(ACTIVE)))),
            ]
            for flow_run_filter in filters:
                runs = await client.read_flow_runs(flow_run_filter=flow_run_filter, sort=FlowRunSort.START_TIME_DESC,
                                                   limit=1)
                if runs:
                    run = runs[0]
                    name = by_id.get(run.deployment_id, pipeline)
                    state = run.state.name if run.state else "unknown"
                    since = run.start_time or run.expected_start_time
                    when = f", since {since.astimezone().strftime('%H:%M:%S')}" if since else ""
                    return (f"pipeline '{name}' writes this index and has a run in progress: flow run {run.id} "
                            f"({state}{when}); try again when it ends (GET /v1/runs/{run.id})")
        try:
            holder = await asyncio.to_thread(self.lease_holder, pipeline)
        except sqlite3.Error as exc:  # a writer is committing (or the file is unreadable): not now
            return f"the index state is busy ({exc}); try again shortly"
        if holder is not None:
            return f"the index is being written by {holder.describe()}; try again when that run ends"
        return None

    async def start(self, name: str) -> Any:
        """Create a run of ingestion pipeline ``name``'s deployment, or raise the ApiError saying why
        not (404 unknown, 400 a query pipeline, 409 ``index_busy``, 503 not deployed or no Prefect).
        Serialised, so two callers can never both start a run."""
        project = self.project
        if name not in project.pipelines:
            ingestion = [n for n, p in project.pipelines.items() if p.kind == PipelineKind.INGESTION]
            raise ApiError(404, f"field 'pipeline': no pipeline '{name}'; ingestion pipelines: "
                                f"{', '.join(ingestion) or 'none'}", param="pipeline", code="pipeline_not_found")
        if project.pipeline(name).kind != PipelineKind.INGESTION:
            raise ApiError(400, f"field 'pipeline': pipeline '{name}' is a query pipeline: POST /v1/ingest starts "
                                f"ingestion pipelines only", param="pipeline", code="not_an_ingestion_pipeline")
        from prefect.client.orchestration import get_client

        async def create() -> Any:
            async with get_client() as client:
                deployment = await self.deployment_id(client, name)
                if deployment is None:
                    raise ApiError(503, f"pipeline '{name}' is not deployed: run `ragline serve` for this file",
                                   "service_unavailable_error", code="not_deployed")
                busy = await self.running(client, name)
                if busy is not None:
                    raise ApiError(409, busy, code="index_busy")
                return await client.create_flow_run_from_deployment(deployment, tags=["ragline-api"])

        async with self.lock:
            return await within_prefect_deadline(create(), started=name)

    async def recent(self, client: Any, pipelines: list[str], states: list[str] | None, limit: int) -> list[Any]:
        """Up to ``limit`` of this file's runs of ``pipelines``, newest first: its deployments' runs
        (by deployment id: a run cancelled or scheduled before it started has no pipeline name yet),
        and runs without a deployment (``ragline index``) by flow and run name, of which ``owns``
        keeps this file's (another file may name its pipelines alike)."""
        from prefect.client.schemas.filters import (
            FlowFilter,
            FlowFilterName,
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterExpectedStartTime,
            FlowRunFilterName,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.sorting import FlowRunSort

        state = FlowRunFilterState(type=FlowRunFilterStateType(any_=states)) if states is not None else None
        due = None  # runs scheduled for later (a schedule keeps many) only when SCHEDULED is asked for
        if states is None or "SCHEDULED" not in states:
            due = FlowRunFilterExpectedStartTime(before_=datetime.datetime.now(datetime.UTC))
        newest = FlowRunSort.EXPECTED_START_TIME_DESC
        deployments = [d for name in pipelines if (d := self.deployment_ids.get(name)) is not None]
        found = []
        if deployments:
            found += await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=deployments), state=state, expected_start_time=due),
                sort=newest, limit=limit)
        undeployed = FlowRunFilter(name=FlowRunFilterName(any_=pipelines),
                                   deployment_id=FlowRunFilterDeploymentId(is_null_=True), state=state,
                                   expected_start_time=due)
        owned: list[Any] = []
        for page in range(LIST_PAGES):
            batch = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
                                                flow_run_filter=undeployed, sort=newest, limit=LIST_PAGE,
                                                offset=page * LIST_PAGE)
            owned += [run for run in batch if self.owns(run)]
            if len(owned) >= limit or len(batch) < LIST_PAGE:
                break
        found += owned
        return sorted(found, key=_newest_first)[:limit]

    def summary(self, flow_run: Any) -> RunSummary:
        state = flow_run.state
        pipeline = flow_run.parameters["pipeline"]
        return RunSummary(id=str(flow_run.id), pipeline=pipeline, kind=self.project.pipeline(pipeline).kind,
                          state=state.type.value if state else "UNKNOWN", state_name=state.name if state else "Unknown",
                          created=_iso(flow_run.created), started=_iso(flow_run.start_time),
                          ended=_iso(flow_run.end_time), trace_id=(flow_run.labels or {}).get(TRACE_LABEL))

    def owns(self, flow_run: Any) -> bool:
        parameters = flow_run.parameters or {}
        if parameters.get("pipeline") not in self.project.pipelines:
            return False
        if flow_run.deployment_id is not None and flow_run.deployment_id in self.deployment_ids.values():
            return True
        file = parameters.get("file")
        return isinstance(file, str) and bool(file) and str(Path(file).resolve()) == self.file

    async def result(self, state: Any) -> Any:
        from prefect._internal.result_records import ResultRecordMetadata

        if not isinstance(state.data, ResultRecordMetadata):
            return None
        if getattr(state.data.serializer, "type", None) != "json":
            return None
        try:
            value = await state.aresult(raise_on_failure=False)
        except Exception:
            return None
        return None if isinstance(value, BaseException) else value

    async def progress(self, client: Any, flow_run: Any, pipeline: str) -> dict[str, Any]:
        sink = self.sinks.get(pipeline)
        runs = {"id": {"any_": [str(flow_run.id)]}}
        out: dict[str, Any] = {}
        if sink is not None:
            body = {"flow_runs": runs, "task_runs": {"name": {"like_": f"{sink.id}[batch "},
                                                     "state": {"type": {"any_": ["COMPLETED"]}}}}
            response = await client.request("POST", "/task_runs/count", json=body)
            out["batches_written"] = response.json() if response.status_code == 200 else None
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterId,
            TaskRunFilter,
            TaskRunFilterState,
            TaskRunFilterStateType,
        )

        running = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=["RUNNING"]))),
            limit=20)
        out["running_steps"] = sorted(t.name for t in running)
        out.update(self.recorded_progress(flow_run, pipeline, out["running_steps"]))
        if flow_run.start_time is not None:
            out["documents_written"] = await asyncio.to_thread(self.documents_written_since, pipeline,
                                                               flow_run.start_time)
        try:
            holder = await asyncio.to_thread(self.lease_holder, pipeline)
        except sqlite3.Error:  # a writer is committing: this poll goes without the heartbeat
            holder = None
        if holder is not None:
            out["lease_heartbeat_seconds_ago"] = round(max(0.0, time.time() - holder.heartbeat_at), 1)
        return out

    def recorded_progress(self, flow_run: Any, pipeline: str, running_steps: list[str]) -> dict[str, Any]:
        """What the run records on itself (``entrypoints.RunProgress``: flow-run labels): the
        documents it planned to index, those done, chunks written, and its phase, made exact
        while batches run by the steps running now (the furthest along the pipeline)."""

        labels = {k.removeprefix(PROGRESS_LABEL): v for k, v in (flow_run.labels or {}).items()
                  if k.startswith(PROGRESS_LABEL)}
        out = {key: labels.get(key) for key in ("documents_planned", "documents_done", "chunks_written")}
        order = ["listing", *STEP_PHASES.values(), "writing", "publishing"]
        running = [p for p in (self.phase_of(pipeline, name) for name in running_steps) if p in order]
        recorded = labels.get("phase")
        out["phase"] = max(running, key=order.index) if running and recorded in (None, "indexing") else recorded
        return out

    def phase_of(self, pipeline: str, task_run: str) -> str:
        """A task run's phase: ``load``/``write.plan`` listing, ``convert[batch 2]`` converting, ...,
        the sink's batches writing, its ``finalize`` publishing."""
        step_id, _, rest = task_run.partition("[")
        step_id, _, hook = step_id.partition(".")
        sink = self.sinks.get(pipeline)
        if hook == "plan" or not rest and not hook:
            return "listing"
        if hook == "finalize":
            return "publishing"
        if sink is not None and step_id == sink.id:
            return "writing"
        try:
            stage = self.project.pipeline(pipeline).step(step_id).stage.name
        except (KeyError, StopIteration, ValueError):
            return step_id
        return STEP_PHASES.get(stage, step_id)

    async def status(self, client: Any, flow_run: Any, reader: frozenset[str] | None = None) -> RunStatus:
        """``reader``: the groups the viewer reads (None: every document), which a query run's
        stored result must not exceed (``shown_to``)."""

        pipeline = flow_run.parameters["pipeline"]
        kind = self.project.pipeline(pipeline).kind
        state = flow_run.state
        status = RunStatus(id=str(flow_run.id), pipeline=pipeline, kind=kind,
                           state=state.type.value if state else "UNKNOWN", state_name=state.name if state else "Unknown",
                           created=_iso(flow_run.created), started=_iso(flow_run.start_time),
                           ended=_iso(flow_run.end_time), trace_id=(flow_run.labels or {}).get(TRACE_LABEL))
        if state is None:
            return status
        if state.is_completed() or (state.is_failed() and kind == PipelineKind.INGESTION):
            status.result = await self.result(state)
        if kind == PipelineKind.QUERY and status.result is not None and not shown_to(reader, flow_run.labels):
            status.result = None
            status.message = "result withheld: this run could read documents this credential may not read"
        if kind == PipelineKind.JOB and status.result is not None and reader is not None:
            status.result = None  # summaries, member documents, paths: a job reads the whole index
            status.message = "result withheld: a job run reads every document; this credential may not"
        if kind == PipelineKind.INGESTION and isinstance(status.result, dict):
            try:
                report = IndexReport.model_validate(status.result)
            except Exception:
                report = None
            if report is not None:
                status.failures = [dict(f.model_dump(mode="json"), reason=self.redact(f.reason)) for f in report.failures]
                status.result = dict(status.result, failures=status.failures)
                status.summary = report.summary()
        if state.is_failed() or state.is_crashed() or state.is_cancelled() or state.is_cancelling():
            status.message = self.redact(state.message) or None
        if kind == PipelineKind.INGESTION and state.type.value in ("RUNNING", "PENDING"):
            try:
                status.progress = await asyncio.wait_for(self.progress(client, flow_run, pipeline), PROGRESS_WAIT)
            except TimeoutError:  # a busy Prefect API or state file: this poll goes without it
                status.progress = {"error": f"progress not read within {PROGRESS_WAIT:g} s; ask again"}
            except Exception as exc:  # progress is a courtesy: never fail the status for it
                status.progress = {"error": self.redact(str(exc))}
        return status


def may_see_runs(principal: Any, pipeline: Any) -> bool:
    """Whether a principal sees a pipeline's runs: one it may read, and a job's (tune, adapt,
    summarize: they read the whole index and change what queries read) only with the admin scope."""
    if not may_read(principal, pipeline):
        return False
    return not is_job(pipeline) or principal.may("admin", collections_of(pipeline))


def is_job(pipeline: Any) -> bool:
    return pipeline.kind == PipelineKind.JOB


def _newest_first(flow_run: Any) -> float:
    when = flow_run.expected_start_time or flow_run.created
    return -when.timestamp() if when is not None else 0.0


def without_failure_details(status: RunStatus) -> RunStatus:
    """An ingestion run's status for a viewer without the ingest scope: the counts stay, the failed
    documents' ids and reasons go (they name documents the viewer may not read, and paths)."""
    if not status.failures:
        return status
    result = dict(status.result, failures=[]) if isinstance(status.result, dict) else status.result
    note = (f"{len(status.failures)} failure detail{'s' if len(status.failures) > 1 else ''} withheld: "
            f"they need the ingest scope")
    return status.model_copy(update={"failures": [], "result": result,
                                     "message": f"{status.message}; {note}" if status.message else note})


def shown_to(reader: frozenset[str] | None, labels: dict[str, Any] | None) -> bool:
    """Whether a query run's stored result may be shown to a viewer reading ``reader``'s groups:
    the run's access (its ``ACCESS_LABEL``; none counts as every document) is within them."""
    if reader is None:
        return True
    access = (labels or {}).get(ACCESS_LABEL)
    if not isinstance(access, str) or access == "*":
        return False
    return set(filter(None, access.split(","))) <= reader


def _iso(value: datetime.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def ingestion_runs(project_path: str | Path, *, data_dir: str | Path | None = None,
                   source: str | Path | None = None) -> _Runs:
    """What starts and watches ingestion runs of one file: shared by ``runs_router`` and the
    document API (``documents``), so their starts are serialised by one lock."""
    project = load_project(project_path, source=source)
    if data_dir:
        project = project.relocated(Path(data_dir))
    return _Runs(project)


async def within_prefect_deadline(call: Coroutine[Any, Any, Any], *, started: str | None = None) -> Any:
    """``call`` (which talks to the Prefect API), or a 503 ``prefect_unavailable`` once it has taken
    ``PREFECT_DEADLINE_SECONDS``: Prefect's client waits 60 s for each answer and retries a timeout
    five times, so a server starved by an ingestion run held a status poll for minutes. ``started``:
    the pipeline whose run ``call`` creates (the answer then says one may have been created)."""
    try:
        return await asyncio.wait_for(call, PREFECT_DEADLINE_SECONDS)
    except ApiError:
        raise
    except TimeoutError:
        maybe = (f"; a run of '{started}' may have been created: GET /v1/runs?pipeline={started} lists it"
                 if started else "")
        raise _prefect_down(f"the Prefect API did not answer within {PREFECT_DEADLINE_SECONDS:g} s (busy or down); "
                            f"try again{maybe}") from None
    except Exception as exc:
        raise _prefect_down(f"the Prefect API did not answer: {type(exc).__name__}") from None


def _prefect_down(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable_error", code="prefect_unavailable", headers={"Retry-After": "5"})
