"""``POST /v1/ingest``, ``GET /v1/runs`` and ``GET /v1/runs/{id}``: the HTTP face of the ingestion
runs of one file (``flows/serve/ingestion_runs.py`` starts and reads them; its docstring says what
each answer holds and who sees it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from fastapi import APIRouter, Query, Request

from ragline.flows.errors import InputError
from ragline.flows.serve.auth.principals import collections_of, principal_of, reading_groups, require
from ragline.flows.serve.ingestion_runs import (STATE_TYPES, IngestAccepted, IngestRequest, RunList, RunStatus, is_job,
                                                _Runs, ingestion_runs, may_see_runs, within_prefect_deadline,
                                                without_failure_details)
from ragline.flows.serve.query_service import ERRORS, ApiError
from ragline.flows.spec.collections import for_collection
from ragline.flows.spec.compile import Project

MAX_LISTED_RUNS = 100  # the most runs one GET /v1/runs lists


def runs_router(project_path: str | Path, *, data_dir: str | Path | None = None,
                source: str | Path | None = None, runs: _Runs | None = None) -> APIRouter:
    """The ``/v1/ingest`` and ``/v1/runs/{id}`` endpoints for the pipelines of one file (its
    deployments ``ragline/<pipeline>``, as ``ragline serve`` creates them); ``source``: the pinned
    copy of the file (``steps.pin_file``); ``runs``: an ``ingestion_runs`` shared with other routers."""
    runs = runs or ingestion_runs(project_path, data_dir=data_dir, source=source)
    project = runs.project
    router = APIRouter(prefix="/v1", tags=["runs"])

    @router.post("/ingest", status_code=202, response_model=IngestAccepted,
                 responses={**ERRORS, 400: {**ERRORS[400], "description": "a query pipeline"},
                            404: {**ERRORS[404], "description": "no such pipeline"},
                            409: {**ERRORS[400], "description": "a run is writing this index (code index_busy)"},
                            503: {**ERRORS[503], "description": "not deployed, or the Prefect API is unreachable"}})
    async def ingest(request: IngestRequest, http: Request) -> IngestAccepted:
        """Start a run of an ingestion pipeline's deployment; poll ``GET /v1/runs/{run_id}``."""
        name = _collection_pipeline(project, request)
        if name in project.pipelines:  # an unknown one: 404 from start
            require(http, "ingest", project.pipeline(name))
        flow_run = await runs.start(name)
        return IngestAccepted(run_id=str(flow_run.id), pipeline=name,
                              state=flow_run.state.type.value if flow_run.state else "SCHEDULED",
                              state_name=flow_run.state.name if flow_run.state else "Scheduled")

    @router.get("/runs", response_model=RunList,
                responses={**ERRORS, 400: {**ERRORS[400], "description": "an unknown pipeline or state"}})
    async def list_runs(http: Request, pipeline: str | None = None, state: str | None = None,
                        limit: int = Query(20, ge=1, le=MAX_LISTED_RUNS)) -> RunList:
        """This file's runs (deployment-triggered, scheduled or ``ragline index``), newest first, of
        the pipelines the credential may read; ``state``: Prefect state types, comma-separated (runs
        scheduled for later are listed only when it names SCHEDULED).
        Results are not listed: ``GET /v1/runs/{id}`` shows one run's."""
        from prefect.client.orchestration import get_client

        principal = principal_of(http)
        names = _listed_pipelines(project, pipeline, principal)
        states = _listed_states(state)
        async def listed() -> list[Any]:
            async with get_client() as client:
                await runs.learn_deployments(client)
                return await runs.recent(client, names, states, limit)

        found = await within_prefect_deadline(listed())
        return RunList(runs=[runs.summary(flow_run) for flow_run in found])

    @router.get("/runs/{run_id}", response_model=RunStatus,
                responses={**ERRORS, 404: {**ERRORS[404], "description": "no such run (code run_not_found)"}})
    async def run_status(run_id: str, http: Request) -> RunStatus:
        """A run's state, times, result, summary, failures and progress."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        try:
            flow_run_id = UUID(run_id)
        except ValueError:
            raise ApiError(404, f"no run '{run_id}'", code="run_not_found") from None
        async def read() -> RunStatus:
            async with get_client() as client:
                await runs.learn_deployments(client)
                try:
                    flow_run = await client.read_flow_run(flow_run_id)
                except ObjectNotFound:
                    raise ApiError(404, f"no run '{run_id}'", code="run_not_found") from None
                if not runs.owns(flow_run):
                    raise ApiError(404, f"no run '{run_id}' of this server's pipelines", code="run_not_found")
                pipeline = project.pipeline(flow_run.parameters["pipeline"])
                principal = principal_of(http)
                if not may_see_runs(principal, pipeline):  # as unknown: its existence is not told
                    raise ApiError(404, f"no run '{run_id}' of the pipelines this credential may read",
                                   code="run_not_found")
                status = await runs.status(client, flow_run, reading_groups(principal))
                if not principal.may("ingest", collections_of(pipeline)):
                    status = without_failure_details(status)
                return status

        return await within_prefect_deadline(read())

    return router


def _collection_pipeline(project: Project, request: IngestRequest) -> str:
    """The pipeline an ingest request starts: with collections declared, ``index`` names the template,
    so the run is its collection's (``index@NAME``); a 400 names the field when that is ambiguous."""
    try:
        return for_collection(project, request.pipeline, request.collection)
    except InputError as exc:
        raise ApiError(400, f"field 'collection': {exc}", param="collection") from None


def _listed_pipelines(project: Project, pipeline: str | None, principal: Any) -> list[str]:
    """The pipelines ``GET /v1/runs`` lists: the one named (400 unknown, 403 unreadable), else every
    one the principal may see the runs of (``may_see_runs``)."""
    if pipeline is not None:
        if pipeline not in project.pipelines:
            raise ApiError(400, f"field 'pipeline': no pipeline '{pipeline}'; pipelines: "
                                f"{', '.join(project.pipelines)}", param="pipeline", code="pipeline_not_found")
        if not may_see_runs(principal, project.pipeline(pipeline)):
            raise ApiError(403, f"forbidden: this credential may not read pipeline '{pipeline}'s runs"
                                + (" (a job's runs need the admin scope)" if is_job(project.pipeline(pipeline))
                                   else ""), "permission_error", code="forbidden")
        return [pipeline]
    return [name for name, p in project.pipelines.items() if may_see_runs(principal, p)]


def _listed_states(state: str | None) -> list[str] | None:
    if state is None:
        return None
    wanted = [s.strip().upper() for s in state.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in STATE_TYPES]
    if unknown or not wanted:
        raise ApiError(400, f"field 'state': unknown state type {', '.join(unknown) or repr(state)}; one or more "
                            f"of {', '.join(STATE_TYPES)}", param="state")
    return wanted
