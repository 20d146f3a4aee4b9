"""The document API: upload, list, read and delete single documents of an ingestion pipeline.

- ``POST /v1/documents`` (multipart: ``file``, optional ``pipeline``, ``ingest``) stores the file in
  the pipeline's managed folder (a ``{type: uploads}`` root of its ``load`` step,
  ``flows/sources/uploads.py``: content-addressed, written atomically) and starts the pipeline's
  next ingestion run (as ``POST /v1/ingest`` does). 201 with the document when new; 200 with
  ``"unchanged": true`` when these bytes are already there (nothing written, nothing re-indexed).
  An ``Idempotency-Key`` header makes a retry safe: the same key with the same pipeline, name and
  bytes answers what the first request answered; with anything else, 409 ``idempotency_conflict``.
- ``GET /v1/documents`` (``pipeline``, ``limit``, ``cursor``): every document of the served
  ingestion pipelines, by id: what the index state records (indexed, with chunk count and time),
  the failures of the last run (failed, with the reason), the uploads not indexed yet (queued) and
  uploads deleted whose removal waits for the next run (deleting).
- ``GET /v1/documents/{id}`` one of them; ``DELETE /v1/documents/{id}`` removes an upload from its
  folder and starts (or, while a run writes the index, schedules) the next ingestion run, which
  removes it from Chroma, BM25 and the state. A document of any other root is not the API's to
  delete: 409 ``not_managed``. The list drops it once the state forgets it; queries stop finding it
  when that run has deleted it from the stores and published BM25 (poll the run it names).

Under ``ragline serve`` a triggered run is a flow run of the pipeline's deployment; under ``ragline
api`` (no Prefect server, ``api_documents``) it runs in the API's own process, on a thread, as
``ragline index`` does: one run per index at a time, and requests during a run make one more run
after it (``_InProcess``). A run killed with the process is finished by the next one (crash safety).

An upload's id is the first 32 hex digits of its SHA-256; any other document's id is its source id.
Writes need the token ``/v1/ingest`` needs (the guard checks every ``/v1`` route); reads only read
the state file. Limits: the ``load`` step's ``max_bytes`` per file (413 naming ``file``), and the
types ``load`` reads (text formats and every registered converter; 415 naming ``file``).
"""
from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Header, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ragline.flows import formats
from ragline.flows.access import checked
from ragline.flows.contracts import PipelineKind
from ragline.flows.files import write_atomic
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.serve.query_service import ERRORS, ApiError
from ragline.flows.serve.auth.principals import may_read, principal_of, reading_groups, require
from ragline.flows.run import engine
from ragline.flows.serve.ingestion_runs import _Runs, ingestion_runs
from ragline.flows.sources.base import SourceError
from ragline.flows.sources.uploads import (
    ID,
    TooLarge,
    UploadFolder,
    folder_of,
    safe_name,
)
from ragline.tasks.ingest.index import FAILURES
from ragline.tasks.ingest.load import FORMATS

log = logging.getLogger("ragline.api.documents")
RETRY_SECONDS = 3.0  # while a run writes the index, a requested run is retried this often
MULTIPART_SLACK = 64 * 1024  # a multipart body's boundaries and headers, beyond the file's own bytes
Status = Literal["queued", "indexed", "failed", "deleting"]


class DocumentInfo(BaseModel):
    id: str = Field(description="an upload's content id (32 hex digits), else the source id")
    pipeline: str
    source: str = Field(description="the source id its chunks carry (an upload's: '<root name>/<id>/<file name>')")
    name: str | None = Field(None, description="an upload's file name")
    managed: bool = Field(description="uploaded through this API (only these can be deleted here)")
    status: Status
    reason: str | None = Field(None, description="why it failed (status failed)")
    stage: str | None = Field(None, description="the step it failed in (status failed): load, convert, chunk, ...")
    chunks: int = 0
    size: int | None = None
    updated: str | None = Field(None, description="when it was last indexed, else uploaded (ISO 8601, UTC)")


class DocumentPage(BaseModel):
    documents: list[DocumentInfo]
    next_cursor: str | None = Field(None, description="pass as `cursor` for the next page; null on the last")


class Ingestion(BaseModel):
    state: Literal["started", "scheduled", "not_started"]
    run_id: str | None = None
    reason: str | None = None


class UploadResult(BaseModel):
    document: DocumentInfo
    unchanged: bool = Field(description="these bytes were already uploaded: nothing written or re-indexed")
    ingestion: Ingestion | None = None


class DeleteResult(BaseModel):
    id: str
    deleted: bool
    ingestion: Ingestion


@dataclass(frozen=True)
class _Managed:
    """One pipeline's uploads root: its folder and the name its source ids start with."""

    pipeline: str
    name: str
    folder: Path
    max_bytes: int


def upload_roots(runs: _Runs) -> dict[str, _Managed]:
    """The ingestion pipelines with an uploads root in their load step, by pipeline."""
    found = {}
    for name, pipeline in runs.project.pipelines.items():
        if pipeline.kind != PipelineKind.INGESTION:
            continue
        for step in pipeline.steps:
            params = step.params
            for spec in getattr(params, "paths", None) or []:
                if getattr(spec, "type", None) == "uploads":
                    found[name] = _Managed(name, spec.name, folder_of(spec, runs.project.base_dir), params.max_bytes)
    return found


def upload_limit(runs: _Runs) -> int | None:
    """The body limit ``/v1/documents`` needs (the largest uploads root's ``max_bytes`` plus the
    multipart framing), None when no pipeline takes uploads."""
    roots = upload_roots(runs)
    return max(r.max_bytes for r in roots.values()) + MULTIPART_SLACK if roots else None


def accepted_suffixes() -> list[str]:
    return sorted(set(FORMATS) | set(formats.extensions()))


def _iso(timestamp: float | None) -> str | None:
    if not timestamp:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat()


# ----------------------------------------------------------------------------- reading
class _Catalogue:
    """The documents of the served pipelines, read from the state files and the upload folders."""

    def __init__(self, runs: _Runs):
        self.runs = runs
        self.roots = upload_roots(runs)

    def pipelines(self, only: str | None) -> list[str]:
        names = [n for n, p in self.runs.project.pipelines.items() if p.kind == PipelineKind.INGESTION]
        if only is None:
            return names
        if only not in names:
            raise ApiError(404, f"field 'pipeline': no ingestion pipeline '{only}'; ingestion pipelines: "
                                f"{', '.join(names) or 'none'}", param="pipeline", code="pipeline_not_found")
        return [only]

    def known_to(self, pipeline: str, documents: list[DocumentInfo], reader: frozenset[str] | None
                 ) -> list[DocumentInfo]:
        """The documents a viewer reading ``reader``'s groups (None: every document) may know of: an
        indexed one by the groups its chunks were granted (any record of a file), an upload not
        indexed yet by its uploaders' groups, one whose groups are unknown only by the operator."""
        if reader is None:
            return documents
        resource, path = self.runs.state_resource.get(pipeline), self.runs.state_path(pipeline)
        granted: dict[str, list[tuple[str, ...] | None]] = {}
        if resource is not None and path is not None and path.exists():
            for source, groups in self.runs.project.resource(resource).readers(origin=pipeline).items():
                granted.setdefault(source.partition("#")[0], []).append(groups)
        root = self.roots.get(pipeline)

        def readable(document: DocumentInfo) -> bool:
            found = granted.get(document.source)
            if found is None and document.managed and root is not None:
                try:
                    found = [UploadFolder(root.folder).groups(document.id) or ()]
                except SourceError:  # its access file is unreadable: the operator's until fixed
                    return False
            return any(g is not None and (not g or bool(reader.intersection(g))) for g in found or [])
        return [d for d in documents if readable(d)]

    def documents(self, pipeline: str, reader: frozenset[str] | None = None) -> list[DocumentInfo]:
        """The pipeline's documents that a viewer reading ``reader``'s groups may know of (``known_to``)."""
        return self.known_to(pipeline, self._documents(pipeline), reader)

    def _documents(self, pipeline: str) -> list[DocumentInfo]:
        rows, failures = self._state(pipeline)
        root = self.roots.get(pipeline)
        out: dict[str, DocumentInfo] = {}
        by_source: dict[str, list[tuple]] = {}
        for row in rows:
            by_source.setdefault(row[0].partition("#")[0], []).append(row)
        uploads = UploadFolder(root.folder).uploads() if root is not None else []
        for upload in uploads:
            source = f"{root.name}/{upload.key}"
            indexed = by_source.pop(source, [])
            failed = None if indexed else failures.get(source)
            status: Status = "indexed" if indexed else "failed" if failed else "queued"
            updated = max((r[3] for r in indexed), default=upload.modified)
            out[upload.id] = DocumentInfo(id=upload.id, pipeline=pipeline, source=source, name=upload.name,
                                          managed=True, status=status, **self._failure(failed),
                                          chunks=sum(r[4] for r in indexed), size=upload.size, updated=_iso(updated))
        for source, indexed in by_source.items():
            upload_id = self._upload_id(root, source)
            out[upload_id or source] = DocumentInfo(
                id=upload_id or source, pipeline=pipeline, source=source, managed=upload_id is not None,
                name=source.rsplit("/", 1)[-1] if upload_id else None,
                status="deleting" if upload_id else "indexed", chunks=sum(r[4] for r in indexed),
                updated=_iso(max(r[3] for r in indexed)))
        for source, failed in failures.items():
            if source not in out and self._upload_id(root, source) is None and source.partition("#")[0] not in out:
                out[source] = DocumentInfo(id=source, pipeline=pipeline, source=source, managed=False,
                                           status="failed", **self._failure(failed))
        return [out[k] for k in sorted(out)]

    def _failure(self, failed: dict[str, str] | str | None) -> dict[str, str | None]:
        """A recorded failure's reason (redacted) and stage: {"stage", "reason"}, or the reason
        alone as states written before stages were recorded hold it."""
        if failed is None:
            return {}
        if isinstance(failed, str):
            return {"reason": self.runs.redact(failed)}
        return {"reason": self.runs.redact(str(failed.get("reason", ""))), "stage": failed.get("stage")}

    @staticmethod
    def _upload_id(root: _Managed | None, source: str) -> str | None:
        if root is None or not source.startswith(root.name + "/"):
            return None
        candidate = source[len(root.name) + 1:].partition("/")[0]
        return candidate if ID.match(candidate) else None

    def _state(self, pipeline: str) -> tuple[list[tuple], dict[str, Any]]:
        """The state's rows of this pipeline and its last run's failures; nothing when there is no
        state file yet (opening it would create one: a read never writes)."""
        resource, path = self.runs.state_resource.get(pipeline), self.runs.state_path(pipeline)
        if resource is None or path is None or not path.exists():
            return [], {}
        state = self.runs.project.resource(resource)
        try:
            failures = json.loads(state.get_meta(f"{FAILURES}:{pipeline}") or "{}")
        except ValueError:
            failures = {}
        return state.documents(origin=pipeline), failures

    def find(self, document_id: str, pipeline: str | None) -> DocumentInfo:
        for name in self.pipelines(pipeline):
            for document in self.documents(name):
                if document.id == document_id:
                    return document
        raise ApiError(404, f"no document '{document_id[:200]}'", param="id", code="document_not_found")


def catalogue(project: Any) -> _Catalogue:
    """The documents of a compiled project as ``GET /v1/documents`` lists them (read-only): for a
    surface without ingestion runs of its own (MCP's ``list_documents`` and resources)."""
    return _Catalogue(_Runs(project))


# ----------------------------------------------------------------------------- ingestion runs
@dataclass
class _Trigger:
    """Starts a pipeline's next run; while one writes the index, retries until a new one starts
    (one retry loop per pipeline: many uploads during a run cost one more run, not one each)."""

    runs: _Runs
    pending: dict[str, asyncio.Task] = field(default_factory=dict)

    async def request(self, pipeline: str) -> Ingestion:
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():  # Prefect's client would start a temporary server of its own
            return Ingestion(state="not_started", reason="no Prefect API is configured (PREFECT_API_URL): the "
                                                         "next `ragline index` or scheduled run indexes it")
        if pipeline in self.pending and not self.pending[pipeline].done():
            return Ingestion(state="scheduled", reason="a run is already scheduled after the one writing the index")
        try:
            flow_run = await self.runs.start(pipeline)
        except ApiError as exc:
            if exc.code not in ("index_busy", "prefect_unavailable"):
                return Ingestion(state="not_started", reason=exc.message)
            self.pending[pipeline] = asyncio.get_running_loop().create_task(self._retry(pipeline))
            return Ingestion(state="scheduled", reason=exc.message)
        return Ingestion(state="started", run_id=str(flow_run.id))

    async def _retry(self, pipeline: str) -> None:
        while True:
            await asyncio.sleep(RETRY_SECONDS)
            try:
                flow_run = await self.runs.start(pipeline)
            except ApiError as exc:
                if exc.code in ("index_busy", "prefect_unavailable"):
                    continue
                log.warning("the scheduled ingestion of %s was not started: %s", pipeline, exc.message)
                return
            except Exception as exc:  # noqa: BLE001 - logged; the next request schedules again
                log.warning("the scheduled ingestion of %s failed to start: %s", pipeline, exc)
                return
            log.info("started the scheduled ingestion run %s of %s", flow_run.id, pipeline)
            return


class _InProcess:
    """Runs a pipeline's ingestion in this process (``ragline api``: no Prefect to start a
    deployment run), on a thread: one run per index at a time; a request while one runs makes one
    more run after it (many requests during a run cost one more run, not one each)."""

    def __init__(self, runs: _Runs):
        self.runs = runs
        self.lock = threading.Lock()
        self.running: dict[str, str] = {}  # index (its state file) -> the run id in progress
        self.queued: dict[str, list[str]] = {}  # index -> pipelines to run after it

    async def request(self, pipeline: str) -> Ingestion:
        index = str(self.runs.state_path(pipeline) or pipeline)
        with self.lock:
            if index in self.running:
                if pipeline not in self.queued.setdefault(index, []):
                    self.queued[index].append(pipeline)
                return Ingestion(state="scheduled", reason=f"run {self.running[index]} is writing this index: "
                                                           f"one more run follows it")
            run_id = self.running[index] = uuid.uuid4().hex
        threading.Thread(target=self._runs, args=(index, pipeline, run_id), daemon=True,
                         name=f"ragline-ingest-{pipeline}").start()
        return Ingestion(state="started", run_id=run_id)

    def _runs(self, index: str, pipeline: str, run_id: str) -> None:
        while True:
            self._run(pipeline, run_id)
            with self.lock:
                if not self.queued.get(index):
                    del self.running[index]
                    return
                pipeline, run_id = self.queued[index].pop(0), uuid.uuid4().hex
                self.running[index] = run_id

    def _run(self, pipeline: str, run_id: str) -> None:
        """One run, as ``ragline index`` runs it (it waits while another writer holds the index)."""
        try:
            report = engine.run(self.runs.project.pipeline(pipeline), orchestrate=False)
        except Exception as exc:  # noqa: BLE001 - logged; the next upload or delete starts another
            log.warning("ingestion run %s of %s failed: %s", run_id, pipeline, self.runs.redact(str(exc)))
            return
        log.info("ingestion run %s of %s: %s", run_id, pipeline, report.summary())


# ----------------------------------------------------------------------------- idempotency keys
class _Keys:
    """``Idempotency-Key`` answers, one file per key under the data dir (they outlive a restart)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.lock = asyncio.Lock()

    def _path(self, key: str) -> Path:
        return self.folder / hashlib.sha256(key.encode()).hexdigest()

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, request: str, status: int, body: dict[str, Any]) -> None:
        write_atomic(self._path(key), json.dumps({"request": request, "status": status, "body": body}))


# ----------------------------------------------------------------------------- the router
def _principals_groups(request: Request) -> Iterable[str] | None:
    """An upload is readable by its uploader's groups (a key's or a token's); the operator's
    uploads (legacy token, loopback user) by everyone, as before keys existed."""
    return reading_groups(principal_of(request))


def documents_router(runs: _Runs, uploader_groups: Callable[[Request], Iterable[str] | None] = _principals_groups,
                     *, in_process: bool = False) -> APIRouter:
    """``/v1/documents`` for the ingestion pipelines of ``runs``' project. ``uploader_groups``: who may
    read what a request uploads (the server's, from its principal; None: everyone), never a field
    the client sends. ``in_process``: runs are started in this process (``ragline api``), not as
    deployment runs. Staging left by uploads killed before this start is removed now."""
    catalogue = _Catalogue(runs)
    trigger = _InProcess(runs) if in_process else _Trigger(runs)
    for root in catalogue.roots.values():
        UploadFolder(root.folder).sweep()
    keys = _Keys(data_dir_of(runs.project) / ".ragline" / "idempotency")
    router = APIRouter(prefix="/v1", tags=["documents"])

    def managed(pipeline: str | None) -> _Managed:
        roots = catalogue.roots
        if pipeline is None:
            if len(roots) == 1:
                return next(iter(roots.values()))
            raise ApiError(422, f"field 'pipeline': name the pipeline to upload to ({', '.join(roots) or 'none takes uploads'})",
                           param="pipeline", code="invalid_value")
        if pipeline not in roots:
            catalogue.pipelines(pipeline)  # 404 for an unknown one
            raise ApiError(409, f"field 'pipeline': pipeline '{pipeline}' takes no uploads: add a root "
                                f"{{type: uploads}} to its load step's paths", param="pipeline", code="no_uploads_root")
        return roots[pipeline]

    @router.post("/documents", status_code=201, response_model=UploadResult,
                 responses={**ERRORS, 409: {**ERRORS[400], "description": "idempotency key reused with another "
                                                                          "request, or a pipeline without uploads"},
                            413: {**ERRORS[400], "description": "the file is over the pipeline's max_bytes"},
                            415: {**ERRORS[400], "description": "a file type load does not read"}})
    async def upload(request: Request, file: Annotated[UploadFile, File(description="the document")],
                     pipeline: Annotated[str | None, Form(description="the ingestion pipeline (default: the only "
                                                                      "one with an uploads root)")] = None,
                     ingest: Annotated[Literal["true", "false"], Form(description="start the pipeline's next "
                                                                                  "ingestion run")] = "true",
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JSONResponse:
        """Store a document in the pipeline's managed uploads and index it by the next run (the
        upload scope covers starting that run)."""
        root = managed(pipeline)
        require(request, "upload", runs.project.pipeline(root.pipeline))
        given = uploader_groups(request)
        groups = None if given is None else checked(given, "uploader")
        try:
            name = safe_name(file.filename or "")
        except ValueError as exc:
            raise ApiError(422, f"field 'file': {exc}", param="file", code="invalid_file_name") from None
        suffix = os.path.splitext(name)[1].lower()
        if suffix not in accepted_suffixes():
            raise ApiError(415, f"field 'file': type {suffix or '(no extension)'!r} of {name!r} is not read; "
                                f"accepted: {', '.join(accepted_suffixes())}", param="file",
                           code="unsupported_file_type")
        request_digest = await asyncio.to_thread(_digest, file.file, root.pipeline, name)
        if idempotency_key is not None:
            async with keys.lock:
                if (seen := keys.get(idempotency_key)) is not None:
                    if seen["request"] != request_digest:
                        raise ApiError(409, "header 'Idempotency-Key': this key was used with another request "
                                            "(pipeline, file name or bytes differ)", param="Idempotency-Key",
                                       code="idempotency_conflict")
                    return JSONResponse(seen["body"], seen["status"], headers={"Idempotent-Replayed": "true"})
                status, body = await _store(root, file, name, ingest == "true", groups)
                keys.put(idempotency_key, request_digest, status, body)
        else:
            status, body = await _store(root, file, name, ingest == "true", groups)
        return JSONResponse(body, status)

    async def _store(root: _Managed, file: UploadFile, name: str, ingest: bool,
                     groups: tuple[str, ...] | None) -> tuple[int, dict[str, Any]]:
        try:
            upload, created = await asyncio.to_thread(UploadFolder(root.folder).put, file.file, name, root.max_bytes,
                                                      groups)
        except TooLarge as exc:
            raise ApiError(413, f"field 'file': {name!r} is over the limit of {exc.limit} bytes", param="file",
                           code="file_too_large") from None
        document = next((d for d in await asyncio.to_thread(catalogue.documents, root.pipeline) if d.id == upload.id),
                        None)
        ingestion = None
        # the same bytes sent by an uploader with groups may widen who reads them: the next run re-grants
        if ingest and (created or groups is not None or (document is not None and document.status == "queued")):
            ingestion = await trigger.request(root.pipeline)
        document = document or DocumentInfo(id=upload.id, pipeline=root.pipeline, managed=True, status="queued",
                                            source=f"{root.name}/{upload.key}", name=upload.name, size=upload.size)
        result = UploadResult(document=document, unchanged=not created, ingestion=ingestion)
        return (201 if created else 200), result.model_dump(mode="json")

    @router.get("/documents", response_model=DocumentPage, responses=ERRORS)
    async def list_documents(request: Request,
                             pipeline: str | None = Query(None, description="one ingestion pipeline (default: all "
                                                                             "this credential may read)"),
                             limit: int = Query(100, ge=1, le=1000),
                             cursor: str | None = Query(None, max_length=2000)) -> DocumentPage:
        """Documents by (id, pipeline), a page at a time."""
        after = _decode_cursor(cursor)
        found: list[DocumentInfo] = []
        reader = reading_groups(principal_of(request))
        for name in readable(request, runs.project, catalogue.pipelines(pipeline), explicit=pipeline is not None):
            found += await asyncio.to_thread(catalogue.documents, name, reader)
        found.sort(key=lambda d: (d.id, d.pipeline))
        if after is not None:
            found = [d for d in found if (d.id, d.pipeline) > after]
        page = found[:limit]
        more = len(found) > limit
        return DocumentPage(documents=page, next_cursor=_encode_cursor(page[-1]) if more else None)

    @router.get("/documents/{document_id:path}", response_model=DocumentInfo,
                responses={**ERRORS, 404: {**ERRORS[404], "description": "no such document"}})
    async def get_document(request: Request, document_id: str, pipeline: str | None = Query(None)) -> DocumentInfo:
        if pipeline is not None and pipeline in runs.project.pipelines:
            require(request, "query", runs.project.pipeline(pipeline))
        document = await asyncio.to_thread(catalogue.find, document_id, pipeline)
        require(request, "query", runs.project.pipeline(document.pipeline))
        reader = reading_groups(principal_of(request))
        if not await asyncio.to_thread(catalogue.known_to, document.pipeline, [document], reader):
            raise ApiError(404, f"no document '{document_id[:200]}'", param="id", code="document_not_found")
        return document

    @router.delete("/documents/{document_id:path}", status_code=202, response_model=DeleteResult,
                   responses={**ERRORS, 404: {**ERRORS[404], "description": "no such document"},
                              409: {**ERRORS[400], "description": "not an upload (code not_managed)"}})
    async def delete_document(request: Request, document_id: str, pipeline: str | None = Query(None)) -> DeleteResult:
        """Remove an upload; the next ingestion run (started or scheduled now) removes it from the indexes."""
        if pipeline is not None and pipeline in runs.project.pipelines:
            require(request, "delete", runs.project.pipeline(pipeline))
        document = await asyncio.to_thread(catalogue.find, document_id, pipeline)
        require(request, "delete", runs.project.pipeline(document.pipeline))
        if not document.managed:
            raise ApiError(409, f"document '{document_id[:200]}' comes from a configured root of pipeline "
                                f"'{document.pipeline}', not from uploads: remove it at its source",
                           param="id", code="not_managed")
        deleted = False
        for root in catalogue.roots.values():
            if root.folder == catalogue.roots[document.pipeline].folder:
                deleted = await asyncio.to_thread(UploadFolder(root.folder).remove, document.id) or deleted
        readers = [r.pipeline for r in catalogue.roots.values() if r.folder == catalogue.roots[document.pipeline].folder]
        ingestion = Ingestion(state="not_started")
        for name in readers:
            started = await trigger.request(name)
            ingestion = started if name == document.pipeline else ingestion
        return DeleteResult(id=document.id, deleted=deleted, ingestion=ingestion)

    return router


def api_documents(project_path: str | Path, *, data_dir: str | Path | None = None
                  ) -> tuple[APIRouter, dict[str, int]]:
    """The document API of ``ragline api``: its router (ingestion runs in this process) and the
    body limit its uploads need, for ``create_app(routers=..., body_limits=...)``."""
    runs = ingestion_runs(project_path, data_dir=data_dir)
    limit = upload_limit(runs)
    return documents_router(runs, in_process=True), ({"/v1/documents": limit} if limit else {})


def readable(request: Request, project: Any, names: list[str], explicit: bool) -> list[str]:
    """The pipelines whose documents the caller may read: one asked for by name is a 403 when it
    may not; "all" means all it may read."""
    if explicit:
        for name in names:
            require(request, "query", project.pipeline(name))
        return names
    principal = principal_of(request)
    return [name for name in names if may_read(principal, project.pipeline(name))]


def _digest(stream: Any, pipeline: str, name: str) -> str:
    """What makes two upload requests the same: pipeline, file name and bytes."""
    digest = hashlib.sha256(f"{pipeline}\0{name}\0".encode())
    while chunk := stream.read(1 << 20):
        digest.update(chunk)
    stream.seek(0)
    return digest.hexdigest()


def _encode_cursor(document: DocumentInfo) -> str:
    return base64.urlsafe_b64encode(json.dumps([document.id, document.pipeline]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> tuple[str, str] | None:
    if cursor is None:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            return value[0], value[1]
    except ValueError:
        pass
    raise ApiError(422, "field 'cursor': not a cursor this API returned", param="cursor", code="invalid_value")
