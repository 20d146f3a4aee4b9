"""The HTTP API: query pipelines over FastAPI, OpenAPI at ``/docs``.

- ``POST /v1/query``: run a query pipeline; JSON, or server-sent events with ``"stream": true``.
- ``POST /v1/chat/completions``, ``GET /v1/models``: the OpenAI-compatible surface (``flows/api_openai.py``).
- ``GET /healthz`` (alive) and ``GET /readyz`` (one status per dependency: Chroma, LLM, Prefect API).

The project is compiled once at start-up. Queries run in-process (``engine.run(orchestrate=False)``)
on a pool of driver threads, never on the event loop; streamed tokens cross from the generating
step's thread to the loop through ``call_soon_threadsafe`` into an ``asyncio.Queue``.

One ASGI guard in front of every route gives each request an id (``X-Request-ID``), serves only
loopback ``Host`` names and ``Origin``s when there is no token (DNS rebinding, ``api_checks``),
checks the bearer token on ``/v1`` (constant time, before the body is read), buffers the body up to
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
import contextvars
import hashlib
import hmac
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragline.flows import engine, settings
from ragline.flows.api_checks import BodyProblem, check_json, foreign_host, is_loopback
from ragline.flows.compile import CompiledPipeline, Project, load_project
from ragline.flows.contracts import Answer, Passage, PipelineKind
from ragline.flows.errors import ConfigError, InputError, RaglineError

log = logging.getLogger("ragline.api")

KEEPALIVE_SECONDS = 15.0  # an SSE comment while a long step (retrieval, a slow LLM) sends nothing
CHECK_TIMEOUT_SECONDS = 5.0
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPENAI_PATHS = ("/v1/chat/", "/v1/models")
DEFAULT_MAX_QUESTION_CHARS = 10_000
REPLACED_NOTICE = ("verification replaced the streamed draft with the refusal text: discard the streamed tokens "
                   "and show answer.text")


# ----------------------------------------------------------------------------- errors
STATUS_CODES = {400: "bad_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "request_too_large",
                415: "unsupported_media_type", 422: "invalid_value", 429: "rate_limited", 431: "headers_too_large",
                500: "internal_error", 502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


def status_code_name(status: int) -> str:
    """The ``code`` of an error that has no more specific one: every error body carries a code."""
    return STATUS_CODES.get(status, f"http_{status}")


class ApiError(RaglineError):
    """A client-visible failure: status and the one error shape of every route,
    ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), ``code`` never null."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code or status_code_name(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, **extra: Any) -> JSONResponse:
        return JSONResponse({**self.body(), **extra}, self.status, headers=self.headers)


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, naming the field when a request field is at fault")
    type: str = Field(description="invalid_request_error, server_error or service_unavailable_error")
    param: str | None = Field(None, description="the request field at fault")
    code: str = Field(description="machine-readable reason, e.g. model_not_found, request_too_large, index_busy")


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 408, 413, 415, 422, 500, 503)}


# ----------------------------------------------------------------------------- request and response models
class HistoryTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"] = Field(description="who said it")
    content: str = Field(description="what was said")


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(description="the question or search text (at most the server's max_question_chars, "
                                      "10,000 characters by default)", examples=["How are deleted sources handled?"])
    pipeline: str = Field("ask", min_length=1, description="a query pipeline of the served file")
    history: list[HistoryTurn] = Field(default_factory=list, description="earlier chat turns, oldest first")
    filters: dict[str, Any] | None = Field(None, description='Chroma-style metadata `where`, e.g. '
                                                             '{"format": "markdown"}')
    stream: bool = Field(False, description="answer as server-sent events: `token` events, then one `answer` "
                                            "event (answer pipelines only)")
    top_k: int | None = Field(None, ge=1, description="return at most this many passages (search pipelines)")

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value

    @field_validator("filters")
    @classmethod
    def _valid_filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from ragline.flows.resources.filters import validate

        validate(value)  # FilterError is a ValueError: reported as field 'filters'
        return value


class QueryResponse(BaseModel):
    pipeline: str
    answer: Answer | None = Field(None, description="for pipelines that answer (the output is an Answer)")
    passages: list[Passage] | None = Field(None, description="for search pipelines (the output is passages)")
    timings: dict[str, float] = Field(description="milliseconds spent in each step")
    latency_ms: float = Field(description="the whole run, milliseconds")
    replaced_by_refusal: bool | None = Field(None, description="streaming only: verification replaced the streamed "
                                                               "draft with the refusal text; discard the tokens")


class DependencyStatus(BaseModel):
    status: Literal["up", "down", "not_configured"]
    required: bool = Field(description="whether readiness depends on it")
    type: str = Field(description="chroma, openai_compatible or prefect")
    error: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    checks: dict[str, DependencyStatus] = Field(description="by resource name, plus `prefect` and `config` "
                                                            "(the pipelines file served)")
    events: dict[str, int] = Field(description="Prefect events emitted and failed since start-up")
    error: ErrorDetail | None = Field(None, description="when not ready: the error shape of every route, code "
                                                        "`not_ready`, naming the dependencies that are down")


# ----------------------------------------------------------------------------- running pipelines
@dataclass
class Outcome:
    """A finished run: the pipeline's output with its step timings."""

    pipeline: str
    value: Any
    timings: dict[str, float]
    latency_ms: float
    tokens: list[str] = field(default_factory=list)

    @property
    def is_answer(self) -> bool:
        return isinstance(self.value, Answer)

    def status(self) -> str:
        return "refused" if self.is_answer and self.value.refused else "answered"

    def replaced_by_refusal(self) -> bool:
        """Streamed text was shown that the final answer no longer stands behind."""
        return bool(self.tokens) and self.is_answer and self.value.refused and bool(self.value.draft)

    def to_json(self, top_k: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"pipeline": self.pipeline}
        if self.is_answer:
            body["answer"] = self.value.model_dump(mode="json")
        else:
            items = list(self.value)[:top_k] if top_k else list(self.value)
            body["passages"] = [p.model_dump(mode="json") if hasattr(p, "model_dump") else p for p in items]
        return {**body, "timings": self.timings, "latency_ms": self.latency_ms}


class Events:
    """Prefect events after each query, off the response path (one background thread).

    Before handing an event to Prefect the thread checks that the API answers (``GET /health``, at
    most every ``PROBE_SECONDS``): Prefect's own client queues the event, reports it sent, and
    loses it later on its websocket, so with the API unreachable every event was counted
    ``emitted`` and ragline never said that they were lost (issue 9: a closed PREFECT_API_URL
    port). Now an event for an API that does not answer is counted ``failed`` (in /readyz), with
    one warning line per outage and an info line when the API answers again."""

    PROBE_SECONDS = 5.0
    PROBE_TIMEOUT_SECONDS = 2.0

    def __init__(self, prefect_url: str | None, context: contextvars.Context):
        self.url, self._context = prefect_url, context
        self.emitted = self.failed = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragline-events") if prefect_url else None
        self._probed_at: float | None = None
        self._down: str | None = None  # why the API did not answer at the last probe

    def query_done(self, pipeline: str, status: str, latency_ms: float, timings: dict[str, float],
                   question_chars: int, surface: str, error: str | None = None) -> None:
        if self._pool is None:
            return
        payload = {"pipeline": pipeline, "status": status, "latency_ms": latency_ms, "timings": timings,
                   "question_chars": question_chars, "surface": surface}
        if error:
            payload["error_type"] = error
        name = "ragline.query.failed" if status == "failed" else "ragline.query.completed"
        self._pool.submit(self._context.copy().run, self._emit, name, pipeline, payload)

    def _reachable(self) -> bool:
        """Whether the Prefect API answered its last probe (any HTTP status counts: it is there)."""
        import httpx

        now = time.monotonic()
        if self._probed_at is not None and now - self._probed_at < self.PROBE_SECONDS:
            return self._down is None
        self._probed_at = now
        was_down = self._down
        try:
            httpx.get(f"{self.url.rstrip('/')}/health", timeout=self.PROBE_TIMEOUT_SECONDS)
        except httpx.HTTPError as exc:
            self._down = f"{type(exc).__name__}: {exc or 'no answer'}"
            if was_down is None:
                log.warning("Prefect API %s unreachable (%s): query events are not sent (queries are answered); "
                            "lost events are counted in /readyz", self.url, self._down)
            return False
        self._down = None
        if was_down is not None:
            log.info("Prefect API %s answers again: query events are sent again (%d lost)", self.url, self.failed)
        return True

    def _emit(self, name: str, pipeline: str, payload: dict[str, Any]) -> None:
        from prefect.events import emit_event

        if not self._reachable():
            self.failed += 1
            log.debug("Prefect event %s lost: the API %s is unreachable (%s)", name, self.url, self._down)
            return
        try:
            sent = emit_event(event=name, payload=payload, resource={
                "prefect.resource.id": f"ragline.pipeline.{pipeline}", "prefect.resource.name": pipeline,
                "ragline.kind": "query"})
            if sent is None:
                raise RuntimeError("Prefect did not accept the event (see its log)")
            self.emitted += 1
        except Exception as exc:  # noqa: BLE001 - observability must never fail a query
            self.failed += 1
            level = logging.WARNING if self.failed == 1 else logging.DEBUG
            log.log(level, "could not emit the Prefect event %s (%s: %s); further failures are counted in /readyz",
                    name, type(exc).__name__, exc)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class QueryService:
    """The compiled project and what every route shares: pipelines, the driver threads, events."""

    def __init__(self, project: Project, *, max_concurrent_runs: int = 32,
                 max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS):
        from ragline.flows.api_runs import Redactor

        self.project = project
        self.max_question_chars = max_question_chars
        self.redact = Redactor(project)
        self.queries = {n: p for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY}
        self.streaming = {n: _streaming(p) for n, p in self.queries.items()}
        self.drivers = ThreadPoolExecutor(max_workers=max_concurrent_runs, thread_name_prefix="ragline-api")
        self.events = Events(_prefect_url(), contextvars.copy_context())
        self.started = int(time.time())
        from ragline.flows.steps import digest_of

        self.config_digest = digest_of(project.source or project.path)  # the text this server compiled

    # -- choosing a pipeline
    def pipeline(self, name: str, param: str = "pipeline", stream: bool = False) -> CompiledPipeline:
        if name not in self.project.pipelines:
            raise ApiError(404, f"field '{param}': no pipeline '{name}' in {self.project.path.name}; query "
                                f"pipelines: {', '.join(self.queries) or 'none'}", param=param,
                           code="pipeline_not_found")
        if name not in self.queries:
            raise ApiError(400, f"field '{param}': pipeline '{name}' is an ingestion pipeline; query pipelines: "
                                f"{', '.join(self.queries) or 'none'}", param=param, code="not_a_query_pipeline")
        return self.streaming[name] if stream else self.queries[name]

    def check_question(self, text: str, param: str, status: int) -> None:
        """A question longer than the limit is refused, not clipped: the answer would be to its start."""
        if len(text) > self.max_question_chars:
            raise ApiError(status, f"field '{param}': the question is {len(text):,} characters long; the limit is "
                                   f"{self.max_question_chars:,} (max_question_chars): shorten it",
                           param=param, code="question_too_long")

    def answers(self, name: str) -> bool:
        """Whether a pipeline's output is an Answer (its output step produces ``answer``)."""
        pipeline = self.queries[name]
        return pipeline.step(pipeline.output).stage.produces == "answer"

    # -- running
    async def run(self, pipeline: CompiledPipeline, query: dict[str, Any], *, surface: str = "query",
                  on_token: Callable[[str], None] | None = None) -> Outcome:
        """The pipeline on a driver thread; the event loop only awaits it."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            value, trace = await loop.run_in_executor(self.drivers, _run, pipeline, query, on_token)
        except Exception as exc:
            self.events.query_done(pipeline.name, "failed", _ms(time.perf_counter() - started), {},
                                   len(query["text"]), surface, type(exc).__name__)
            raise
        outcome = Outcome(pipeline.name, value, {step: _ms(seconds) for step, seconds in trace},
                          _ms(time.perf_counter() - started))
        self.events.query_done(pipeline.name, outcome.status(), outcome.latency_ms, outcome.timings,
                               len(query["text"]), surface)
        return outcome

    async def stream(self, pipeline: CompiledPipeline, query: dict[str, Any], *,
                     surface: str = "query") -> AsyncIterator[str | None | Outcome]:
        """Generated pieces as they come (``None`` now and then while nothing does), then the Outcome.
        The run goes on to the end (and emits its event) if the client leaves."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        listening = threading.Event()
        listening.set()
        done = object()

        def on_token(text: str) -> None:  # in the generating step's thread
            if listening.is_set():
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, text)
                except RuntimeError:  # the loop is closed: the server is stopping
                    listening.clear()

        job = asyncio.ensure_future(self.run(pipeline, query, surface=surface, on_token=on_token))
        job.add_done_callback(lambda finished: (queue.put_nowait(done), finished.cancelled() or finished.exception()))
        tokens: list[str] = []
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(queue.get())
                ready, _ = await asyncio.wait({getter}, timeout=KEEPALIVE_SECONDS)
                if not ready:
                    yield None
                    continue
                item, getter = getter.result(), None
                if item is done:
                    break
                tokens.append(item)
                yield item
            outcome = job.result()
            outcome.tokens = tokens
            yield outcome
        finally:
            listening.clear()
            if getter is not None:
                getter.cancel()

    # -- errors
    def failure(self, exc: BaseException, request_id: str) -> ApiError:
        """What the client may know about a failed run, decided by the error's class (a step's
        failure by its cause's, when that declares a client-facing status); the full error goes to
        the log unless the client is at fault."""
        from ragline.flows.steps import StepFailed

        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, ValueError) and not isinstance(exc, RaglineError):  # engine.run refused the query
            exc = InputError(str(exc), field="question")
        if not isinstance(exc, RaglineError):
            log.error("request %s: %s", request_id, exc, exc_info=exc)
            return internal_error(request_id)
        error = exc
        if isinstance(exc, StepFailed) and isinstance(exc.cause, RaglineError) and exc.cause.http_status != 500:
            error = exc.cause
        if error is not exc or error.http_status >= 500:  # a query refused before any step ran is the client's
            log.error("request %s: %s", request_id, exc, exc_info=exc)
        if error.http_status < 500:  # the client's to fix (a bad query, a filter the store refused)
            return ApiError(error.http_status, self.redact(error.client_message()) or type(error).__name__,
                            param=error.field, code=error.error_code)
        no_retry = {"x-should-retry": "false"}  # the engine has applied its retry policy already
        if error.http_status > 500:  # an unavailable dependency or index, a step past its deadline
            return ApiError(error.http_status, self.redact(str(exc)) or type(exc).__name__, error.api_type(),
                            code=error.error_code, headers=no_retry)
        if isinstance(exc, StepFailed):  # ours: the client learns which step, the log the rest
            return ApiError(500, f"{exc.where} failed (request id {request_id}; details in the server log)",
                            "server_error", code=exc.error_code, headers=no_retry)
        return internal_error(request_id)

    def close(self) -> None:
        self.drivers.shutdown(wait=False, cancel_futures=True)
        self.events.close()


def _run(pipeline: CompiledPipeline, query: dict[str, Any],
         on_token: Callable[[str], None] | None) -> tuple[Any, list[tuple[str, float]]]:
    trace: list[tuple[str, float]] = []
    value = engine.run(pipeline, {"query": query}, orchestrate=False, on_token=on_token, trace=trace)
    return value, trace


def _streaming(pipeline: CompiledPipeline) -> CompiledPipeline:
    """The pipeline with every stage that can stream told to (as ``ragline ask --stream`` does)."""
    overrides = {s.id: {"stream": True} for s in pipeline.steps if "stream" in s.stage.params.model_fields}
    return pipeline.with_overrides(overrides) if overrides else pipeline


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"internal error (request id {request_id}; details in the server log)", "server_error",
                    code="internal_error")


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "-")


def sse(event: str | None, data: Any) -> str:
    """One server-sent event; ``None`` data makes a keep-alive comment."""
    if data is None:
        return ": keep-alive\n\n"
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")) if not isinstance(data, str) else data
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def estimate_tokens(text: str) -> int:
    """~4 characters per token: usage figures are estimates (the pipeline may call the LLM several times)."""
    return math.ceil(len(text) / 4) if text else 0


# ----------------------------------------------------------------------------- /v1/query
def query_router(service: QueryService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["query"])

    @router.post("/query", response_model=QueryResponse, responses=ERRORS,
                 summary="Run a query pipeline: an answer with its sources, or ranked passages")
    async def query(body: QueryRequest, request: Request) -> Response:
        """JSON by default. With `"stream": true`, server-sent events: `event: token` /
        `data: {"text": ...}` for every generated piece, then exactly one `event: answer` whose data is
        this endpoint's JSON response plus `replaced_by_refusal` (when true, verification replaced the
        streamed draft with the refusal text: discard the streamed tokens), or `event: error` /
        `data: {"error": {...}}`. Comment lines (`: keep-alive`) may arrive while a step runs."""
        rid = request_id(request)
        try:
            service.check_question(body.question, "question", 422)
            pipeline = service.pipeline(body.pipeline, stream=body.stream)
            if body.stream and not service.answers(body.pipeline):
                raise ApiError(400, f"field 'stream': pipeline '{body.pipeline}' returns passages, not generated "
                                    f"text; stream an answer pipeline or leave stream false", param="stream",
                               code="stream_not_supported")
        except ApiError as exc:
            return exc.response()
        query = {"text": body.question, "history": [t.model_dump() for t in body.history], "filters": body.filters}
        if body.stream:
            return StreamingResponse(_sse_query(service, pipeline, query, rid), media_type="text/event-stream",
                                     headers=STREAM_HEADERS)
        try:
            outcome = await service.run(pipeline, query)
        except Exception as exc:  # noqa: BLE001 - classified, logged, never a traceback
            return service.failure(exc, rid).response()
        return JSONResponse(outcome.to_json(body.top_k))

    return router


async def _sse_query(service: QueryService, pipeline: CompiledPipeline, query: dict[str, Any],
                     rid: str) -> AsyncIterator[str]:
    try:
        async for item in service.stream(pipeline, query):
            if isinstance(item, Outcome):
                final = {**item.to_json(), "replaced_by_refusal": item.replaced_by_refusal()}
                if final["replaced_by_refusal"]:
                    final["notice"] = REPLACED_NOTICE
                yield sse("answer", final)
            else:
                yield sse("token", None if item is None else {"text": item})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        yield sse("error", service.failure(exc, rid).body())


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

    page = (files("ragline.flows") / "web" / "index.html").read_text(encoding="utf-8")
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
        ready = all(c.status == "up" for c in checks.values() if c.required)
        if not getattr(request.state, "authorized", True):
            checks = {name: c.model_copy(update={"error": None, "detail": {}}) for name, c in checks.items()}
        down = [name for name, c in checks.items() if c.required and c.status != "up"]
        error = None if ready else ApiError(503, f"not ready: {', '.join(down)} not up (see checks)",
                                            "service_unavailable_error", code="not_ready").body()["error"]
        body = Readiness(status="ready" if ready else "not_ready", checks=checks, error=error,
                         events={"emitted": service.events.emitted, "failed": service.events.failed})
        return JSONResponse(body.model_dump(mode="json"), 200 if ready else 503)

    return router


async def readiness(service: QueryService, require_prefect: bool) -> dict[str, DependencyStatus]:
    """Every check at once, each with its own time limit."""
    resources = service.project.spec.resources
    jobs: dict[str, Any] = {}
    for name, spec in resources.items():
        if spec.type in ("chroma", "bm25"):
            jobs[name] = _check_store(service, name)
        elif spec.type == "openai_compatible":
            jobs[name] = _check_llm(service, name)
    jobs["prefect" if "prefect" not in jobs else "prefect_api"] = _check_prefect(service.events.url, require_prefect)
    jobs["config" if "config" not in jobs else "pipelines_config"] = _check_config(service)
    results = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, results))


async def _check_store(service: QueryService, name: str) -> DependencyStatus:
    """The store against the index state it belongs to, on a thread, with a time limit: Chroma's
    count (and BM25's published count) must be the state's chunk count; a store that is missing,
    unreadable or short while the state holds chunks is down, with the reason and the remedy.
    Read-only, as every query path: nothing is created or rebuilt here."""
    kind = service.project.spec.resources[name].type
    try:
        detail = await asyncio.wait_for(asyncio.to_thread(_store_against_state, service.project, name),
                                        CHECK_TIMEOUT_SECONDS)
    except TimeoutError:
        return DependencyStatus(status="down", required=True, type=kind,
                                error=f"no answer within {CHECK_TIMEOUT_SECONDS:g} s")
    except Exception as exc:  # noqa: BLE001 - reported, redacted
        return DependencyStatus(status="down", required=True, type=kind,
                                error=service.redact(f"{type(exc).__name__}: {exc}"))
    problem = detail.pop("problem", None)
    if problem:
        return DependencyStatus(status="down", required=True, type=kind, detail=detail,
                                error=service.redact(problem))
    return DependencyStatus(status="up", required=True, type=kind, detail=detail)


def _store_against_state(project: Any, name: str) -> dict[str, Any]:
    """{"chunks": what the store holds, "state_chunks": what the state names, "problem": why they
    disagree (absent when they agree)}."""
    from ragline.flows.check import indexes
    from ragline.flows.resources.state import REMEDY, StoreMissing

    store = project.resource(name)
    states = {i.state for i in indexes(project) if name in (i.store, i.sparse)}
    state = project.resource(states.pop()) if len(states) == 1 else None
    try:
        expected = state.counts()[1] if state is not None else None
    except StoreMissing:
        expected = 0
    detail: dict[str, Any] = {} if expected is None else {"state_chunks": expected}
    if store.spec.type == "bm25":
        problem = store.problem(state)
        published = None if problem else store.published_version()
        detail["chunks"] = published.get("count", 0) if published else 0
        if problem:
            detail["problem"] = f"{problem}; {REMEDY}" if REMEDY not in problem else problem
        return detail
    try:
        detail["chunks"] = store.count()
    except StoreMissing as exc:
        detail["chunks"] = 0
        if expected:
            detail["problem"] = f"{exc} while the index state holds {expected} chunks"
        return detail
    if expected is not None and detail["chunks"] != expected:
        detail["problem"] = (f"{store.location} holds {detail['chunks']} vectors, the index state names {expected} "
                             f"chunks; {REMEDY}")
    return detail


async def _check_llm(service: QueryService, name: str) -> DependencyStatus:
    """The endpoint's /health (vLLM), as ``LLMClient.health()`` asks it, else its /models; with the error."""
    import httpx

    from ragline.flows.resources.llm import without_credentials

    from ragline.flows.llm_server import managed

    llm = service.project.resource(name)
    root = llm.spec.base_url.rstrip("/").removesuffix("/v1")
    detail = {"base_url": without_credentials(llm.spec.base_url), "model": llm.spec.model}
    supervised = managed(llm.spec.base_url)  # the packaged LLM `ragline serve` runs: starting, restarting, gone
    problem = supervised.problem() if supervised is not None else None
    if problem:
        return DependencyStatus(status="down", required=True, type="openai_compatible",
                                detail={**detail, "managed": supervised.state}, error=service.redact(problem))
    try:
        async with httpx.AsyncClient(timeout=CHECK_TIMEOUT_SECONDS) as client:
            response = await client.get(f"{root}/health")
            if response.status_code in (404, 405):  # not vLLM: any OpenAI-compatible server lists models
                response = await client.get(f"{llm.spec.base_url.rstrip('/')}/models",
                                            headers={"Authorization": f"Bearer {llm.spec.api_key}"})
    except httpx.HTTPError as exc:
        return DependencyStatus(status="down", required=True, type="openai_compatible", detail=detail,
                                error=f"{llm.location} unreachable: {type(exc).__name__}: {exc or 'no answer'}")
    if response.status_code != 200:
        return DependencyStatus(status="down", required=True, type="openai_compatible", detail=detail,
                                error=f"{llm.location} answered HTTP {response.status_code}")
    return DependencyStatus(status="up", required=True, type="openai_compatible", detail=detail)


async def _check_config(service: QueryService) -> DependencyStatus:
    """The pipelines file this server serves (by digest) and whether the file on disk still says
    the same. Never a reason to be unready: an edit is applied by a restart, not half-way."""
    from ragline.flows.steps import digest_of

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


def _prefect_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


# ----------------------------------------------------------------------------- the guard (ASGI)
class Guard:
    """Request id, Host/Origin (without a token), bearer token, body limit, body checks and
    last-resort 500s, before FastAPI sees a request."""

    def __init__(self, app: Any, *, token: str | None, max_body_bytes: int, protected: str = "/v1",
                 allowed_origins: Iterable[str] = ()):
        self.app, self.max_body_bytes, self.protected = app, max_body_bytes, protected
        self._expected = hashlib.sha256(f"Bearer {token}".encode()).digest() if token else None
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex[:16]
        authorized = self._authorized(scope)
        scope.setdefault("state", {}).update(request_id=rid, authorized=authorized)
        send = _tagged(send, rid)
        if self._expected is None and (refusal := foreign_host(scope["headers"], self.allowed_origins)):
            return await _reply(send, ApiError(403, refusal[1], code=refusal[0]))
        if not authorized and _under(scope["path"], self.protected) and scope["method"] != "OPTIONS":
            return await _reply(send, ApiError(401, "missing or wrong bearer token (send `Authorization: Bearer "
                                                    "<token>`)", code="invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"}))
        body = await self._read_body(scope, receive)
        if body is None:  # the client left before sending its whole body: nothing to answer
            return
        if isinstance(body, ApiError):
            return await _reply(send, body, close=True)
        if body and _json_request(scope):
            try:
                check_json(body)
            except BodyProblem as problem:
                return await _reply(send, _body_error(problem, scope["path"]))
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

        try:
            await self.app(scope, replay, tracking)
        except Exception as exc:
            log.error("request %s (%s %s) failed", rid, scope["method"], scope["path"], exc_info=exc)
            if started:
                raise  # too late for a response: the server closes the connection
            await _reply(send, internal_error(rid))

    def _authorized(self, scope: dict) -> bool:
        """The right bearer token was sent (or none is configured); compared in constant time."""
        if self._expected is None:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self._expected)

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | ApiError | None:
        """The whole body, a 413 as soon as it is known to be too large (declared or sent), or None
        when the client disconnected first (a truncated body must never reach a route)."""
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body too large: the limit is {self.max_body_bytes} bytes",
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


def _tagged(send: Callable, rid: str) -> Callable:
    async def tagged(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
        await send(message)

    return tagged


async def _reply(send: Callable, error: ApiError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
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
               max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS, source: str | None = None) -> FastAPI:
    """The API of one pipelines file, compiled now (an invalid file fails here, not per request).
    ``routers`` are mounted under the same token, body limit and error shapes; ``source``: the
    file's text pinned by ``ragline serve`` (``steps.pin_file``), compiled instead of the file."""
    if token is not None and not token.strip():
        raise ValueError("the API token is empty")
    cors_origins = list(cors_origins)
    project = load_project(project_path, source=source)
    if data_dir:
        project = project.relocated(data_dir)
    if max_question_chars < 1:
        raise ValueError(f"max_question_chars must be at least 1, got {max_question_chars}")
    service = QueryService(project, max_concurrent_runs=max_concurrent_runs, max_question_chars=max_question_chars)
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    app = FastAPI(title="ragline", version="1", description=_description(project, token), lifespan=lifespan,
                  openapi_tags=[{"name": "query"}, {"name": "openai"}, {"name": "health"}])
    app.state.service = service
    secured = [Depends(_bearer)]  # shows the scheme in /docs; Guard enforces it before the body is read
    from ragline.flows.api_openai import openai_router

    app.include_router(query_router(service), dependencies=secured)
    app.include_router(openai_router(service), dependencies=secured)
    for router in routers:
        app.include_router(router, dependencies=secured)
    app.include_router(health_router(service, require_prefect))
    app.include_router(page_router())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_middleware(Guard, token=token, max_body_bytes=max_body_bytes, allowed_origins=cors_origins)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-ID"])
    return app


def _description(project: Project, token: str | None) -> str:
    queries = ", ".join(n for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY) or "none"
    auth = "every /v1 route needs `Authorization: Bearer <token>`" if token else "no token (loopback only)"
    return f"Query pipelines of {project.path.name}: {queries}. Authentication: {auth}."


# ----------------------------------------------------------------------------- serving
class ApiConfigError(ConfigError, ValueError):
    """The API cannot start as asked (e.g. exposed without a token): one clear line."""




def serve_api(project_path: str, host: str = "127.0.0.1", port: int = 8080, token: str | None = None, *,
              data_dir: str | None = None, routers: Iterable[APIRouter] = (), max_body_bytes: int = 1_000_000,
              cors_origins: Iterable[str] = (), log_level: str = "info",
              max_question_chars: int = DEFAULT_MAX_QUESTION_CHARS, limits: Any = None) -> None:
    """Serve the API with uvicorn until stopped. ``token`` defaults to ``RAGLINE_API_TOKEN``; off
    loopback a token is required: anyone who can reach the port could otherwise run queries.
    ``limits`` (``connections.ConnectionLimits``, default: from the environment) bound slow and
    half-sent requests and the number of open connections."""
    from ragline.flows.connections import server_limits

    token = token or settings.get("api_token") or None
    if not is_loopback(host) and not token:
        raise ApiConfigError(f"refusing to serve the API on {host} (not loopback) without a token: pass --token "
                             f"(or set RAGLINE_API_TOKEN), or listen on 127.0.0.1")
    server_settings = server_limits(limits)
    import uvicorn

    from ragline.flows.chroma_server import serve_stores

    app = create_app(project_path, token=token, routers=routers, max_body_bytes=max_body_bytes,
                     cors_origins=cors_origins, data_dir=data_dir, max_question_chars=max_question_chars)
    from ragline.flows.api_discovery import published

    with contextlib.ExitStack() as stack:  # embedded stores get one owner: terminal writers then reach it too
        serve_stores(app.state.service.project, stack, lambda line: print(line, file=sys.stderr, flush=True))
        stack.enter_context(published(app.state.service.project, host, port, token, data_dir))  # for the CLI
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **server_settings)
