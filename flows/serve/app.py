"""The HTTP API: query pipelines over FastAPI, OpenAPI at ``/docs``.

- ``POST /v1/query``: run a query pipeline; JSON, or server-sent events with ``"stream": true``.
- ``POST /v1/chat/completions``, ``GET /v1/models``: the OpenAI-compatible surface (``flows/serve/routers/openai_api.py``).
- ``GET /healthz`` (alive) and ``GET /readyz`` (one status per dependency: each resource's ``health()``,
  the Prefect API, the pipelines file).

At start-up (the app's lifespan, before the port answers) the resources of the query pipelines are
warmed up (``Resource.warm_up``: models loaded, stores opened), so the first query does not pay it.

The project is compiled once at start-up. Queries run in-process (``engine.run(orchestrate=False)``)
on a pool of driver threads, never on the event loop; streamed tokens cross from the generating
step's thread to the loop through ``call_soon_threadsafe`` into an ``asyncio.Queue``.

One ASGI guard in front of every route gives each request an id (``X-Request-ID``), serves only
loopback ``Host`` names and ``Origin``s when no credential is configured (DNS rebinding, ``api_checks``),
turns the bearer credential (the token, an API key, an OIDC JWT) into the request's ``Principal``
(``principals``; 401 on ``/v1``, ``/docs`` and private ``/metrics`` without one, before the body is
read; each route then checks its scope on its pipeline's collections, 403 ``forbidden``), buffers the body up to
``max_body_bytes`` (413 beyond it, chunked bodies included), refuses a JSON body no field can take
(invalid UTF-8, nested too deep, NaN, numbers beyond 64 bits, lone surrogates: a 4xx naming the
field) and turns any unexpected exception into a generic 500 naming the request id (the traceback
goes to the log, never to the client). Slow and half-sent requests are bounded below it, in the
HTTP protocol (``connections``).
A question longer than ``max_question_chars`` (10,000 by default) is refused naming its field
(422 on ``/v1/query``, 400 on the OpenAI route, code ``question_too_long``) before any step runs:
the pipeline would read only its start (prompts clip a question to ~2,000 characters, the embedder
to 256 tokens) and answer a question the client did not ask, while BM25 scored every word.
Every error of every route is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``,
with a code; messages never show the pipelines file or the data dir (``api_runs.Redactor``).

After each query a Prefect event (``ragline.query.completed`` / ``.failed``) is emitted on a
background thread when a Prefect API is configured: never on the response's path, never fatal.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragline.flows import settings, telemetry
from ragline.flows.serve.auth.guard import BodyProblem, check_json, foreign_host, is_loopback
from ragline.flows.spec.compile import CompiledPipeline, Project, load_project
from ragline.flows.contracts import PipelineKind
from ragline.flows.errors import ConfigError

from ragline.flows.serve.supervise.discovery import published
from ragline.flows.serve.routers.metrics import INDEXES, metrics_router
from ragline.flows.serve.auth.oidc import OidcConfig
from ragline.flows.serve.auth.principals import Authenticator, scope_query
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.serve.routers.openai_api import openai_router
from ragline.flows.serve.routers.catalog import catalog_router
from ragline.flows.serve.routers.feedback import FEEDBACK_BODY_BYTES, feedback_router
from ragline.flows.serve.mcp import MCP_PATH, http_endpoint, rpc_error
from ragline.flows.serve.mcp import openapi_path as mcp_openapi_path
from ragline.flows.serve.query_service import (
    ANSWER_ID_HEADER,
    ApiError,
    CHECK_TIMEOUT_SECONDS,
    DEFAULT_MAX_QUESTION_CHARS,
    DependencyStatus,
    EVIDENCE_NOTICE,
    EarlyEvidence,
    ERRORS,
    OPENAI_PATHS,
    Outcome,
    QueryRequest,
    QueryResponse,
    QueryService,
    REPLACED_NOTICE,
    Readiness,
    STREAM_HEADERS,
    internal_error,
    request_id,
    sse,
)
from ragline.flows.run.check import indexes
from ragline.flows.run.steps import digest_of
from ragline.flows.serve.connections import server_limits
from ragline.flows.ops.store_servers import serve_stores

from ragline.flows.resources import close_resources

log = logging.getLogger("ragline.api")
SERVING = ("up", "degraded")  # the dependency statuses a ready server may have

def query_router(service: QueryService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["query"])

    @router.post("/query", response_model=QueryResponse, responses=ERRORS,
                 summary="Run a query pipeline: an answer with its sources, or ranked passages")
    async def query(body: QueryRequest, request: Request) -> Response:
        """JSON by default. With `"stream": true`, server-sent events: first, for a pipeline with an
        evidence step, `event: evidence` / `data: {"answer_id", "pipeline", "step", "latency_ms",
        "evidence": {...}}` as soon as the extractive answer is ready (before any generated text);
        then `event: token` / `data: {"text": ...}` for every generated piece, then exactly one
        `event: answer` whose data is this endpoint's JSON response plus `replaced_by_refusal` (when
        true, verification replaced the streamed draft with the refusal text: discard the streamed
        tokens) and `replaced_by_evidence` (the draft was replaced by the evidence answer), or
        `event: error` / `data: {"error": {...}}`. Comment lines (`: keep-alive`) may arrive while a
        step runs."""
        rid = request_id(request)
        try:
            service.check_question(body.question, "question", 422)
            pipeline = service.pipeline(body.pipeline, stream=body.stream)
            query = {"text": body.question, "history": [t.model_dump() for t in body.history],
                     "filters": body.filters}
            principal = scope_query(request, pipeline, query, body.collections)
            if body.stream and not service.answers(body.pipeline):
                raise ApiError(400, f"field 'stream': pipeline '{body.pipeline}' returns passages, not generated "
                                    f"text; stream an answer pipeline or leave stream false", param="stream",
                               code="stream_not_supported")
        except ApiError as exc:
            return exc.response()
        answer_id = service.new_answer_id()
        if body.stream:
            return EventSourceResponse(_sse_query(service, pipeline, query, rid, answer_id, principal.id),
                                       headers={**STREAM_HEADERS, ANSWER_ID_HEADER: answer_id})
        try:
            outcome = await service.run(pipeline, query, answer_id=answer_id, request_id=rid, principal=principal.id)
        except Exception as exc:  # noqa: BLE001 - classified, logged, never a traceback
            return service.failure(exc, rid).response()
        return JSONResponse(outcome.to_json(body.top_k), headers={ANSWER_ID_HEADER: answer_id})

    return router


async def _sse_query(service: QueryService, pipeline: CompiledPipeline, query: dict[str, Any],
                     rid: str, answer_id: str, principal: str) -> AsyncIterator[bytes]:
    try:
        async for item in service.stream(pipeline, query, answer_id=answer_id, request_id=rid, principal=principal):
            if isinstance(item, Outcome):
                yield sse("answer", _final(item))
            elif isinstance(item, EarlyEvidence):
                yield sse("evidence", {"answer_id": answer_id, "pipeline": pipeline.name, "step": item.step,
                                       "latency_ms": item.latency_ms, "evidence": item.evidence})
            else:
                yield sse("token", None if item is None else {"text": item})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        yield sse("error", service.failure(exc, rid).body())


def _final(outcome: Outcome) -> dict[str, Any]:
    """The stream's `answer` event: the JSON response, and whether the streamed draft stands."""
    final = {**outcome.to_json(), "replaced_by_refusal": outcome.replaced_by_refusal(),
             "replaced_by_evidence": outcome.replaced_by_evidence()}
    if final["replaced_by_refusal"]:
        final["notice"] = REPLACED_NOTICE
    elif final["replaced_by_evidence"]:
        final["notice"] = EVIDENCE_NOTICE
    return final


# ----------------------------------------------------------------------------- chat page
PAGE_HEADERS = {  # the page's own inline script and style only; it talks to this origin alone
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def page_router() -> APIRouter:
    """The chat page at ``/``: one static file, served without a token (it asks for one when the
    API answers 401, and sends it on the /v1 calls it makes)."""
    from importlib.resources import files

    from fastapi.responses import HTMLResponse

    page = (files("ragline.flows.serve.web") / "index.html").read_text(encoding="utf-8")
    router = APIRouter(tags=["page"])

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    return router


# ----------------------------------------------------------------------------- health
def health_router(service: QueryService, require_prefect: bool = False) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}},
                summary="Readiness: one status per dependency; 503 unless every required one is up")
    async def readyz(request: Request) -> JSONResponse:
        """No token needed (probes); when the server has one, errors and details (endpoints, counts)
        are shown only to callers that send it."""
        checks = await readiness(service, require_prefect)
        down = [name for name, c in checks.items() if c.required and c.status not in SERVING]
        ready = not down
        if not getattr(request.state, "authorized", True):
            checks = {name: c.model_copy(update={"error": None, "detail": {}}) for name, c in checks.items()}
        error = None if ready else ApiError(503, f"not ready: {', '.join(down)} not up (see checks)",
                                            "service_unavailable_error", code="not_ready").body()["error"]
        body = Readiness(status="ready" if ready else "not_ready", checks=checks, error=error,
                         events={"emitted": service.events.emitted, "failed": service.events.failed})
        return JSONResponse(body.model_dump(mode="json"), 200 if ready else 503)

    return router


async def readiness(service: QueryService, require_prefect: bool) -> dict[str, DependencyStatus]:
    """Every check at once, each with its own time limit: each resource's ``health()`` (a store
    against the index state it belongs to), the Prefect API and the pipelines file."""

    states: dict[str, set[str]] = {}
    for index in indexes(service.project):
        for member in (index.store, index.sparse):
            if member:
                states.setdefault(member, set()).add(index.state)
    jobs: dict[str, Any] = {name: _check_resource(service, name, states.get(name, set()))
                            for name in service.project.spec.resources}
    jobs["prefect" if "prefect" not in jobs else "prefect_api"] = _check_prefect(service.events.url, require_prefect)
    jobs["config" if "config" not in jobs else "pipelines_config"] = _check_config(service)
    results = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, results))


async def _check_resource(service: QueryService, name: str, states: set[str]) -> DependencyStatus:
    """The resource's own ``health()`` on a thread, with a time limit; ``states``: the index states
    it is a store of (compared only when there is exactly one)."""
    project = service.project
    kind = project.spec.resources[name].type

    def health() -> Any:
        state = project.resource(next(iter(states))) if len(states) == 1 else None
        return project.resource(name).health(state)

    try:
        found = await asyncio.wait_for(asyncio.to_thread(health), CHECK_TIMEOUT_SECONDS)
    except TimeoutError:
        return DependencyStatus(status="down", required=True, type=kind,
                                error=f"no answer within {CHECK_TIMEOUT_SECONDS:g} s")
    except Exception as exc:  # noqa: BLE001 - reported, redacted
        return DependencyStatus(status="down", required=True, type=kind,
                                error=service.redact(f"{type(exc).__name__}: {exc}"))
    return DependencyStatus(status=found.status, required=True, type=kind, detail=found.detail,
                            error=service.redact(found.error) if found.error else None)


async def _check_config(service: QueryService) -> DependencyStatus:
    """The pipelines file this server serves (by digest) and whether the file on disk still says
    the same. Never a reason to be unready: an edit is applied by a restart, not half-way."""

    project = service.project
    on_disk = await asyncio.to_thread(digest_of, project.path)
    changed = on_disk != service.config_digest
    policy = "pinned" if project.source is not None else "read at start"
    detail = {"digest": service.config_digest, "policy": policy, "file_digest": on_disk or None,
              "changed_on_disk": changed}
    if changed:
        detail["note"] = (f"{project.path.name} changed since this server started; the API"
                          f"{' and its deployment runs' if project.source is not None else ''} keep serving "
                          f"{service.config_digest}: restart to apply the edit")
    return DependencyStatus(status="up", required=False, type="config", detail=detail)


async def _check_prefect(url: str | None, required: bool) -> DependencyStatus:
    import httpx

    if not url:
        return DependencyStatus(status="not_configured", required=required, type="prefect",
                                error="PREFECT_API_URL is not set: no events are emitted")
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            response = await client.get(f"{url.rstrip('/')}/health")
    except httpx.HTTPError as exc:
        return DependencyStatus(status="down", required=required, type="prefect", detail={"url": url},
                                error=f"Prefect API {url} unreachable: {type(exc).__name__}: {exc or 'no answer'}")
    if response.status_code != 200:
        return DependencyStatus(status="down", required=required, type="prefect", detail={"url": url},
                                error=f"Prefect API {url} answered HTTP {response.status_code}")
    return DependencyStatus(status="up", required=required, type="prefect", detail={"url": url})


# ----------------------------------------------------------------------------- the guard (ASGI)
class Guard:
    """Request id, Host/Origin (without a token), bearer token, body limit, body checks and
    last-resort 500s, before FastAPI sees a request."""

    def __init__(self, app: Any, *, token: str | None = None, max_body_bytes: int, protected: Iterable[str] = ("/v1",),
                 allowed_origins: Iterable[str] = (), body_limits: dict[str, int] | None = None,
                 auth: Authenticator | None = None, admin_only: Iterable[str] = ()):
        self.app, self.max_body_bytes, self.protected = app, max_body_bytes, tuple(protected)
        self.admin_only = tuple(admin_only)  # protected prefixes only an admin may read (/metrics)
        self.body_limits = dict(body_limits or {})  # path prefix -> its own limit (uploads)
        self.auth = auth or Authenticator(token, None)
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex[:16]
        started, seen = time.perf_counter(), {"status": 500, "route": REFUSED}
        with telemetry.span(f"HTTP {scope['method']}", {"http.request.method": scope["method"],
                                                        "ragline.request_id": rid}, kind="SERVER") as span:
            try:
                await self._handle(scope, receive, _tagged(send, rid, seen, telemetry.traceparent(span)), rid, seen)
            finally:
                route = _route_of(scope, seen)
                telemetry.http_done(route, scope["method"], seen["status"], time.perf_counter() - started)
                if span is not None:
                    span.update_name(f"{scope['method']} {route}")
                    span.set_attributes({"http.route": route, "http.response.status_code": seen["status"]})

    async def _handle(self, scope: dict, receive: Callable, send: Callable, rid: str, seen: dict) -> None:
        rpc = _under(scope["path"], MCP_PATH)  # an MCP client reads a refusal as a JSON-RPC error
        if self.auth.needs_thread(scope["headers"]):  # a JWT: its issuer's keys may have to be fetched
            verdict = await asyncio.to_thread(self.auth.authenticate, scope["headers"])
        else:
            verdict = self.auth.authenticate(scope["headers"])
        principal = verdict.principal
        scope.setdefault("state", {}).update(request_id=rid, authorized=principal is not None, principal=principal)
        if not verdict.required and (refusal := foreign_host(scope["headers"], self.allowed_origins)):
            return await _reply(send, ApiError(403, refusal[1], code=refusal[0]), rpc=rpc)
        protected = any(_under(scope["path"], p) for p in self.protected) and scope["method"] != "OPTIONS"
        if principal is None and protected:
            why = verdict.refusal or "missing or wrong bearer token"
            return await _reply(send, ApiError(401, f"{why} (send `Authorization: Bearer <API key or token>`)",
                                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
                                rpc=rpc)
        if protected and any(_under(scope["path"], p) for p in self.admin_only) and not principal.may("admin"):
            return await _reply(send, ApiError(403, f"forbidden: this credential lacks scope 'admin' needed to read "
                                                    f"{scope['path'][:100]}", "permission_error", code="forbidden"),
                                rpc=rpc)
        body = await self._read_body(scope, receive)
        if body is None:  # the client left before sending its whole body: nothing to answer
            return
        if isinstance(body, ApiError):
            return await _reply(send, body, close=True, rpc=rpc)
        if body and _json_request(scope):
            try:
                check_json(body)
            except BodyProblem as problem:
                return await _reply(send, _body_error(problem, scope["path"]), rpc=rpc)
        started = False

        async def replay() -> dict:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()

        async def tracking(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        seen["route"] = UNMATCHED  # until the router names the route it matched (scope["route"])
        try:
            await self.app(scope, replay, tracking)
        except Exception as exc:
            log.error("request %s (%s %s) failed", rid, scope["method"], scope["path"], exc_info=exc)
            if started:
                raise  # too late for a response: the server closes the connection
            await _reply(send, internal_error(rid), rpc=rpc)

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | ApiError | None:
        """The whole body, a 413 as soon as it is known to be too large (declared or sent), or None
        when the client disconnected first (a truncated body must never reach a route)."""
        limit = next((n for prefix, n in self.body_limits.items() if _under(scope["path"], prefix)),
                     self.max_body_bytes)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return self._too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return self._too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, limit: int) -> ApiError:
        return ApiError(413, f"request body too large: the limit is {limit} bytes",
                        code="request_too_large")


def _json_request(scope: dict) -> bool:
    """A request whose body FastAPI will parse as JSON (no Content-Type counts: FastAPI tries JSON)."""
    if scope["method"] not in ("POST", "PUT", "PATCH"):
        return False
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    return content_type is None or _is_json(content_type.decode("latin-1"))


def _body_error(problem: Any, path: str) -> ApiError:
    """A body problem in a field answers as that route answers a bad field (400 on the OpenAI
    surface, 422 elsewhere); a body that is not JSON at all is a 400 everywhere."""
    status = 400 if problem.field is None or path.startswith(OPENAI_PATHS) else 422
    return ApiError(status, problem.message, param=problem.field, code=problem.code)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


REFUSED = "<refused>"  # the route label of a request the guard answered itself (no token, too large, ...)
UNMATCHED = telemetry.UNMATCHED


def _route_of(scope: dict, seen: dict) -> str:
    """The matched route's template (``/v1/runs/{run_id}``), never the path a client sent."""
    route = scope.get("route")
    path = getattr(route, "path", None) if seen["route"] == UNMATCHED else None
    return path if isinstance(path, str) else seen["route"]


def _tagged(send: Callable, rid: str, seen: dict, traceparent: str | None = None) -> Callable:
    """Adds the request id (and the trace, when traced) to the response's headers; notes its status."""
    extra = [(b"x-request-id", rid.encode())]
    if traceparent:
        extra += [(b"traceparent", traceparent.encode()), (b"x-trace-id", traceparent.split("-")[1].encode())]

    async def tagged(message: dict) -> None:
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return tagged


async def _reply(send: Callable, error: ApiError, close: bool = False, rpc: bool = False) -> None:
    body = json.dumps(rpc_error(error) if rpc else error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if close:  # the rest of an oversized body is never read
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------- error handlers
def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 list as one readable message naming the field; OpenAI routes answer 400."""
    openai = request.url.path.startswith(OPENAI_PATHS)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    content_type = request.headers.get("content-type", "")
    if first["type"] == "json_invalid":
        error = ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'JSON decode error')} "
                              f"(at character {first['loc'][-1]})", code="invalid_json")
    elif first["loc"] == ("body",) and content_type and not _is_json(content_type):
        error = ApiError(415, f"unsupported Content-Type {content_type.split(';')[0]!r}: send application/json",
                         code="unsupported_media_type")
    elif first["loc"] == ("body",) and first["type"] == "missing":
        error = ApiError(400 if openai else 422, "the request body is missing: send a JSON object",
                         code="missing_body")
    else:
        messages = [f"field '{_field(e['loc'])}': {_message(e)}" for e in errors]
        param = _field(first["loc"]) or None
        error = ApiError(400 if openai else 422, "; ".join(messages), param=param,
                         code="invalid_filter" if param == "filters" else "invalid_value")
    return error.response()


def _field(loc: Iterable[Any]) -> str:
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";")[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette/FastAPI HTTPExceptions (unknown routes, wrong methods) in the one error shape,
    with a code named after the status."""
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response()


def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    """An ApiError raised by a route (mounted routers raise them too)."""
    return exc.response()


# ----------------------------------------------------------------------------- the app
_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>` when the server has a token")


def create_app(project_path: str, *, token: str | None = None, routers: Iterable[APIRouter] = (),
               max_body_bytes: int = 1_000_000, cors_origins: Iterable[str] = (), data_dir: str | None = None,
               require_prefect: bool = False, max_concurrent_runs: int = 32,
               max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS, source: str | None = None,
               warm_up: bool = True, body_limits: dict[str, int] | None = None) -> FastAPI:
    """The API of one pipelines file, compiled now (an invalid file fails here, not per request).
    ``routers`` are mounted under the same token, body limit and error shapes; ``source``: the
    file's text pinned by ``ragline serve`` (``steps.pin_file``), compiled instead of the file;
    ``warm_up``: load the query pipelines' resources at start-up (the lifespan), before serving;
    ``body_limits``: path prefixes with a body limit of their own (``/v1/documents``: uploads)."""
    if token is not None and not token.strip():
        raise ValueError("the API token is empty")
    cors_origins = list(cors_origins)
    project = load_project(project_path, source=source)
    if data_dir:
        project = project.relocated(data_dir)
    if max_question_chars < 1:
        raise ValueError(f"max_question_chars must be at least 1, got {max_question_chars}")
    service = QueryService(project, max_concurrent_runs=max_concurrent_runs, max_question_chars=max_question_chars)
    mcp = http_endpoint(service)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warm_up:
            await asyncio.to_thread(service.warm_up)
        INDEXES.watch(id(service), project)  # its index gauges in /metrics while it serves
        async with mcp.manager.run():  # MCP sessions live while the app serves
            yield
        INDEXES.watch(id(service), None)
        service.close()

    app = FastAPI(title="ragline", version="1", description=_description(project, token), lifespan=lifespan,
                  openapi_tags=[{"name": "query"}, {"name": "openai"}, {"name": "feedback"}, {"name": "health"}])
    app.state.service = service
    secured = [Depends(_bearer)]  # shows the scheme in /docs; Guard enforces it before the body is read
    app.include_router(query_router(service), dependencies=secured)
    app.include_router(openai_router(service), dependencies=secured)
    app.include_router(feedback_router(service), dependencies=secured)
    app.include_router(catalog_router(service), dependencies=secured)
    for router in routers:
        app.include_router(router, dependencies=secured)
    app.add_route(MCP_PATH, mcp, methods=["GET", "POST", "DELETE"], include_in_schema=False)  # streamable HTTP
    app.openapi = functools.partial(_openapi_with_mcp, app, mcp.tools)  # a raw ASGI route FastAPI cannot describe
    app.include_router(health_router(service, require_prefect))
    app.include_router(page_router())
    metrics = settings.telemetry().metrics
    if metrics:
        app.include_router(metrics_router())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
    private_metrics = ("/metrics",) if metrics and not settings.telemetry().metrics_public else ()
    body_limits = {"/v1/feedback": min(FEEDBACK_BODY_BYTES, max_body_bytes), **(body_limits or {})}
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, allowed_origins=cors_origins,
                       protected=("/v1", MCP_PATH, *DOC_PATHS, *private_metrics), admin_only=private_metrics,
                       body_limits=body_limits, auth=authenticator(project, token))
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-ID", ANSWER_ID_HEADER])
    return app


DOC_PATHS = ("/docs", "/redoc", "/openapi.json")  # any authenticated caller may read them (they hold no data)


def authenticator(project: Project, token: str | None) -> Authenticator:
    """The credentials this project's API accepts: the token, its keys file, the OIDC issuer."""
    return Authenticator(token, data_dir_of(project), OidcConfig.from_settings())


def _openapi_with_mcp(app: FastAPI, tools: list[Any]) -> dict[str, Any]:
    """FastAPI's document of the routes, with ``/mcp`` described (``mcp.openapi_path``); made once."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)  # FastAPI's own, cached on the app
        schema["paths"][MCP_PATH] = mcp_openapi_path(tools)
        schema.setdefault("tags", []).append({"name": "mcp", "description": "the Model Context Protocol"})
    return app.openapi_schema


def _description(project: Project, token: str | None) -> str:
    queries = ", ".join(n for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY) or "none"
    auth = "every /v1 route needs `Authorization: Bearer <API key or token>` (without a token, API keys or " \
           "an OIDC issuer: loopback only, no credential)"
    return f"Query pipelines of {project.path.name}: {queries}. Authentication: {auth}."


# ----------------------------------------------------------------------------- serving
class ApiConfigError(ConfigError, ValueError):
    """The API cannot start as asked (e.g. exposed without a token): one clear line."""




def credentials_configured(project_path: str, token: str | None, data_dir: str | None) -> bool:
    """Whether callers off loopback would need a credential: a token, a key, an OIDC issuer."""
    project = load_project(project_path)
    if data_dir:
        project = project.relocated(data_dir)
    return authenticator(project, token).required()


def serve_api(project_path: str, host: str = "127.0.0.1", port: int = 8080, token: str | None = None, *,
              data_dir: str | None = None, routers: Iterable[APIRouter] = (), max_body_bytes: int = 1_000_000,
              cors_origins: Iterable[str] = (), log_level: str = "info",
              max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS, limits: Any = None,
              body_limits: dict[str, int] | None = None) -> None:
    """Serve the API with uvicorn until stopped. ``token`` defaults to ``RAGLINE_API_TOKEN``; off
    loopback a token is required: anyone who can reach the port could otherwise run queries.
    ``limits`` (``connections.ConnectionLimits``, default: from the environment) bound slow and
    half-sent requests and the number of open connections."""

    token = token or settings.auth().api_token or None
    if not is_loopback(host) and not credentials_configured(project_path, token, data_dir):
        raise ApiConfigError(f"refusing to serve the API on {host} (not loopback) without a token: pass --token "
                             f"(or set RAGLINE_API_TOKEN), create an API key (`ragline keys create`), set "
                             f"RAGLINE_OIDC_ISSUER, or listen on 127.0.0.1")
    server_settings = server_limits(limits)
    import uvicorn

    app = create_app(project_path, token=token, routers=routers, max_body_bytes=max_body_bytes,
                     cors_origins=cors_origins, data_dir=data_dir, max_question_chars=max_question_chars,
                     body_limits=body_limits)
    with contextlib.ExitStack() as stack:  # embedded stores get one owner: terminal writers then reach it too
        serve_stores(app.state.service.project, stack, lambda line: print(line, file=sys.stderr, flush=True))
        stack.enter_context(published(app.state.service.project, host, port, token, data_dir))  # for the CLI
        stack.callback(close_resources)  # before the stores' server stops: its clients go first
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **server_settings)
