"""What every HTTP surface of a project shares: the query service (a project's query pipelines
run in-process on driver threads, tokens streamed to the event loop), the request and response
models, and one error shape (``ApiError``, OpenAI-shaped, with a code). ``app`` (``/v1/query``,
health, the page), the ``routers/`` build their routes on it."""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragline.flows import settings, telemetry
from ragline.flows.access import checked, without_acl
from ragline.flows.run import engine
from ragline.flows.spec.compile import CompiledPipeline, Project
from ragline.flows.contracts import DEFAULT_MAX_QUESTION_CHARS, Answer, EvidenceAnswer, Passage, PipelineKind
from ragline.flows.resources import warm_up as warm_up_resources
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.serve.query_log import QueryLog, describe_run, index_generations, now_iso
from ragline.flows.serve.redact import Redactor
from ragline.flows.errors import InputError, RaglineError
from ragline.flows.resources.stores.filters import validate
from ragline.flows.run.steps import digest_of
from ragline.flows.run.steps import StepFailed
from ragline.flows.run.check import indexes
from ragline.flows.run.query_runner import STEP_OUTPUTS

log = logging.getLogger("ragline.api")

KEEPALIVE_SECONDS = 15.0  # an SSE comment while a long step (retrieval, a slow LLM) sends nothing
CHECK_TIMEOUT_SECONDS = 5.0
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPENAI_PATHS = ("/v1/chat/", "/v1/models")
REPLACED_NOTICE = ("verification replaced the streamed draft with the refusal text: discard the streamed tokens "
                   "and show answer.text")
EVIDENCE_NOTICE = ("the streamed draft was replaced by the evidence answer (answer.reason says why): discard the "
                   "streamed tokens and show answer.text")
ANSWER_ID_HEADER = "X-Answer-ID"  # also `answer_id` in the body: what POST /v1/feedback names


# ----------------------------------------------------------------------------- access
def access_for(groups: Iterable[str] | None) -> frozenset[str] | None:
    """The ``Query.access`` of a caller with these groups (flows/access.py): public documents and
    theirs; None reads every document (an operator, or no principal: today's behaviour). The only
    way a surface sets it: put it in the query dict it runs (``query["access"] = access_for(...)``),
    never from the request body. A bad group name is a ValueError (the server's, not the client's)."""
    return None if groups is None else frozenset(checked(groups, "principal"))


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
    stream: bool = Field(False, description="answer as server-sent events: an `evidence` event first (pipelines "
                                            "with an evidence step), `token` events, then one `answer` event "
                                            "(answer pipelines only)")
    top_k: int | None = Field(None, ge=1, description="return at most this many passages (search pipelines)")
    collections: list[str] | None = Field(None, min_length=1, description="the named collections to search "
                                          "(pipelines.yaml `collections`); default: all this credential may query")

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value

    @field_validator("filters")
    @classmethod
    def _valid_filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:

        validate(value)  # FilterError is a ValueError: reported as field 'filters'
        return value


class QueryResponse(BaseModel):
    answer_id: str | None = Field(None, description="this answer's id (also the X-Answer-ID header): rate it with "
                                                    "POST /v1/feedback")
    pipeline: str
    answer: Answer | None = Field(None, description="for pipelines that answer (the output is an Answer); "
                                                    "`answer.evidence` is the extractive evidence answer")
    passages: list[Passage] | None = Field(None, description="for search pipelines (the output is passages)")
    timings: dict[str, float] = Field(description="milliseconds spent in each step")
    latency_ms: float = Field(description="the whole run, milliseconds")
    replaced_by_refusal: bool | None = Field(None, description="streaming only: verification replaced the streamed "
                                                               "draft with the refusal text; discard the tokens")
    replaced_by_evidence: bool | None = Field(None, description="streaming only: the streamed draft was replaced by "
                                                                "the evidence answer; discard the tokens")


class DependencyStatus(BaseModel):
    status: Literal["up", "degraded", "down", "not_configured"] = Field(
        description="degraded: serving, not at full speed or not with everything (e.g. a model not loaded yet)")
    required: bool = Field(description="whether readiness depends on it (degraded counts as serving)")
    type: str = Field(description="the resource's type (chroma, openai_compatible, ...), prefect or config")
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
    answer_id: str | None = None
    redact: Redactor | None = None  # the server's: no server path in what a client is shown

    @property
    def is_answer(self) -> bool:
        return isinstance(self.value, Answer)

    def status(self) -> str:
        return "refused" if self.is_answer and self.value.refused else "answered"

    def replaced_by_refusal(self) -> bool:
        """Streamed text was shown that the final answer no longer stands behind."""
        return bool(self.tokens) and self.is_answer and self.value.refused and bool(self.value.draft)

    def replaced_by_evidence(self) -> bool:
        """Streamed text was shown, and the answer is the evidence answer instead (verification did
        not ground the draft in the evidence, or the LLM failed half-way)."""
        return bool(self.tokens) and self.is_answer and self.value.answered_by == "evidence"

    def answer_json(self) -> dict[str, Any]:
        """The Answer as a client sees it (redacted: its sources and evidence show no server path)."""
        body = self.value.model_dump(mode="json")
        return self.redact.answer(body) if self.redact is not None else body

    def to_json(self, top_k: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"answer_id": self.answer_id} if self.answer_id else {}
        body["pipeline"] = self.pipeline
        if self.is_answer:
            body["answer"] = self.answer_json()
        else:
            items = list(self.value)[:top_k] if top_k else list(self.value)
            body["passages"] = [_shown(p.model_dump(mode="json") if hasattr(p, "model_dump") else p) for p in items]
        return {**body, "timings": self.timings, "latency_ms": self.latency_ms}

    def returned_ids(self, limit: int = 50) -> list[str]:
        """The documents this outcome shows (cited sources, or ranked passages): the audit's record,
        ids and never text."""
        items = self.value.sources if self.is_answer else self.value
        return list(dict.fromkeys(_source_ids(items)))[:limit]


@dataclass
class EarlyEvidence:
    """The evidence answer of a streamed run, as soon as its step finished: redacted JSON, and the
    milliseconds since the run started (the time to the first cited answer)."""

    step: str
    evidence: dict[str, Any]
    latency_ms: float


def _source_ids(items: Any) -> Iterator[str]:
    """The source ids in what a pipeline returned: passages, sources, rankings of passages (a lone
    retriever's output), or their JSON forms."""
    for item in items or ():
        data = item.model_dump() if hasattr(item, "model_dump") else item
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("passages"), list):
            yield from _source_ids(data["passages"])
        elif data.get("source_id"):
            yield str(data["source_id"])


def _shown(passage: Any) -> Any:
    """A passage as a client sees it: without the access keys (which groups may read a document is
    the server's business, not its readers')."""
    if isinstance(passage, dict) and isinstance(passage.get("passages"), list):  # a ranking
        return {**passage, "passages": [_shown(p) for p in passage["passages"]]}
    if isinstance(passage, dict) and isinstance(passage.get("metadata"), dict):
        return {**passage, "metadata": without_acl(passage["metadata"])}
    return passage


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
                   question_chars: int, surface: str, error: str | None = None, *, principal: str | None = None,
                   answer_id: str | None = None, returned: list[str] | None = None) -> None:
        """One event per query: how it went and how many documents it returned; never the question's
        or the answer's text. Who asked (the principal's id) and the ids of the documents returned
        only with the ``event_documents`` setting: every client of the Prefect API reads every event,
        whatever documents its holder may read (the query log keeps that audit trail by default)."""
        if self._pool is None:
            return
        payload = {"pipeline": pipeline, "status": status, "latency_ms": latency_ms, "timings": timings,
                   "question_chars": question_chars, "surface": surface, "answer_id": answer_id,
                   "returned_count": len(returned or [])}
        if settings.telemetry().event_documents:
            payload.update(principal=principal, returned=returned or [])
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
        self.project = project
        self.max_question_chars = max_question_chars
        self.redact = Redactor(project)
        self.queries = {n: p for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY}
        self.streaming = {n: _streaming(p) for n, p in self.queries.items()}
        self.drivers = ThreadPoolExecutor(max_workers=max_concurrent_runs, thread_name_prefix="ragline-api")
        self.events = Events(_prefect_url(), contextvars.copy_context())
        self.query_log = QueryLog.from_settings(data_dir_of(project))
        self.states_read = {n: _states_read(project, p) for n, p in self.queries.items()}
        self.started = int(time.time())

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
    @staticmethod
    def new_answer_id() -> str:
        """An answer's id, made before its run (a stream's headers carry it before the answer exists)."""
        return uuid.uuid4().hex

    async def run(self, pipeline: CompiledPipeline, query: dict[str, Any], *, surface: str = "query",
                  on_token: Callable[[str], None] | None = None, answer_id: str | None = None,
                  request_id: str | None = None, principal: str | None = None,
                  on_step: Callable[[str, Any], None] | None = None) -> Outcome:
        """The pipeline on a driver thread; the event loop only awaits it. ``on_token`` and
        ``on_step`` (each step's output when ready) are called on the run's threads."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        outputs: dict[str, Any] | None = {} if self.query_log is not None else None
        answer_id = answer_id or self.new_answer_id()
        logged = _LogContext(pipeline.name, surface, on_token is not None, answer_id, request_id, query, principal) \
            if self.query_log is not None else None
        try:  # in this request's context: the run's span is a child of the request's
            value, trace = await loop.run_in_executor(self.drivers, contextvars.copy_context().run, _run, pipeline,
                                                      query, on_token, outputs, on_step)
        except Exception as exc:
            seconds = time.perf_counter() - started
            self.events.query_done(pipeline.name, "failed", _ms(seconds), {}, len(query["text"]), surface,
                                   type(exc).__name__, principal=principal, answer_id=answer_id)
            telemetry.query_done(pipeline.name, "failed", seconds, error=exc)
            self._log(logged, "failed", _ms(seconds), {}, None, {}, error=type(exc).__name__)
            raise
        seconds = time.perf_counter() - started
        outcome = Outcome(pipeline.name, value, {step: _ms(s) for step, s in trace}, _ms(seconds), answer_id=answer_id,
                          redact=self.redact)
        self.events.query_done(pipeline.name, outcome.status(), outcome.latency_ms, outcome.timings,
                               len(query["text"]), surface, principal=principal, answer_id=answer_id,
                               returned=outcome.returned_ids())
        refused = outcome.is_answer and value.refused
        telemetry.query_done(pipeline.name, outcome.status(), seconds, trace, refusal=value.reason if refused else None)
        self._log(logged, outcome.status(), outcome.latency_ms, outcome.timings, value, outputs or {})
        return outcome

    def _log(self, logged: "_LogContext | None", status: str, latency_ms: float, timings: dict[str, float], value: Any,
             outputs: dict[str, Any], error: str | None = None) -> None:
        """Hands the query log its entry (when the log is on); the writer thread completes it."""
        query_log = self.query_log
        if query_log is None or logged is None:
            return
        entry = logged.entry(status, latency_ms, timings, query_log.text, error)
        question, states = logged.question, self.states_read.get(logged.pipeline, [])

        def build(entry: dict[str, Any]) -> None:  # on the log's thread
            if value is not None:
                describe_run(entry, value, outputs, question, query_log.text)
            entry["index"] = index_generations(self.project, states)

        query_log.record(entry, build)

    async def stream(self, pipeline: CompiledPipeline, query: dict[str, Any], *, surface: str = "query",
                     answer_id: str | None = None, request_id: str | None = None, principal: str | None = None
                     ) -> AsyncIterator[str | None | EarlyEvidence | Outcome]:
        """The evidence answer as soon as its step finishes (an ``EarlyEvidence``, before any
        generated piece: the generating step waits for it), generated pieces as they come (``None``
        now and then while nothing does), then the Outcome. The run goes on to the end (and emits
        its event) if the client leaves."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        listening = threading.Event()
        listening.set()
        done = object()
        started = time.perf_counter()
        evidence_sent = threading.Event()

        def hand_over(item: Any) -> None:  # from the run's threads to the loop, in order
            if listening.is_set():
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the loop is closed: the server is stopping
                    listening.clear()

        def on_step(step: str, value: Any) -> None:  # in the finished step's thread
            if isinstance(value, EvidenceAnswer) and not evidence_sent.is_set():
                evidence_sent.set()  # the first evidence step's: what the client sees first
                hand_over(EarlyEvidence(step, self.redact.evidence(value.model_dump(mode="json")),
                                        _ms(time.perf_counter() - started)))

        job = asyncio.ensure_future(self.run(pipeline, query, surface=surface, on_token=hand_over,
                                             answer_id=answer_id, request_id=request_id, principal=principal,
                                             on_step=on_step))
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
                if isinstance(item, str):
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

    def warm_up(self) -> dict[str, str]:
        """Load every resource a query pipeline uses; returns those that failed (name -> error):
        they are reported by /readyz, and the first query that needs one says why."""
        names = dict.fromkeys(name for p in self.queries.values() for s in p.steps for name in _bound(s))
        started = time.perf_counter()
        failed = warm_up_resources((name, self.project.resource(name)) for name in names)
        log.info("warmed up %d resource(s) in %.1f s", len(names) - len(failed), time.perf_counter() - started)
        return failed

    def close(self) -> None:
        self.drivers.shutdown(wait=False, cancel_futures=True)
        self.events.close()
        if self.query_log is not None:
            self.query_log.close()


@dataclass
class _LogContext:
    """What the query log needs to know of a request besides its outcome."""

    pipeline: str
    surface: str
    stream: bool
    answer_id: str
    request_id: str | None
    query: dict[str, Any]
    principal: str | None = None  # who asked (an API key's id, a token's subject): the audit trail
    time: str = field(default_factory=now_iso)
    trace_id: str | None = field(default_factory=lambda: _trace_id())

    @property
    def question(self) -> str:
        return self.query["text"]

    def entry(self, status: str, latency_ms: float, timings: dict[str, float], text: bool,
              error: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"answer_id": self.answer_id, "time": self.time, "pipeline": self.pipeline,
                                 "surface": self.surface, "stream": self.stream, "status": status,
                                 "latency_ms": latency_ms, "timings": timings, "request_id": self.request_id,
                                 "principal": self.principal, "restricted": self.query.get("access") is not None,
                                 "trace_id": self.trace_id, "history_turns": len(self.query.get("history") or []),
                                 "filtered": bool(self.query.get("filters"))}
        if self.query.get("collections") is not None:  # which named collections it searched (audit)
            entry["collections"] = list(self.query["collections"])
        if text:
            entry["question"] = self.question
        if error:
            entry["error"] = error
        return entry


def _trace_id() -> str | None:
    """The current trace's id (the request's span), None untraced."""
    if telemetry.tracer() is None:
        return None
    parent = telemetry.carrier()
    return parent.split("-")[1] if parent else None


def _states_read(project: Project, pipeline: CompiledPipeline) -> list[str]:
    """The index states whose stores a query pipeline searches (their generation is logged)."""
    used = {name for step in pipeline.steps for name in _bound(step)}
    return sorted({index.state for index in indexes(project) if {index.store, index.sparse} & used})


def _bound(step: Any) -> list[str]:
    """The resources a step may use: its own, or those of every collection it searches."""
    return [name for bound in (list(step.collections.values()) or [step.resources]) for name in bound.values()]


def _run(pipeline: CompiledPipeline, query: dict[str, Any], on_token: Callable[[str], None] | None,
         outputs: dict[str, Any] | None = None, on_step: Callable[[str, Any], None] | None = None
         ) -> tuple[Any, list[tuple[str, float]]]:
    trace: list[tuple[str, float]] = []
    if outputs is not None:
        STEP_OUTPUTS.set(outputs)  # in this run's own context copy
    value = engine.run(pipeline, {"query": query}, orchestrate=False, on_token=on_token, trace=trace, on_step=on_step)
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


def sse(event: str | None, data: Any) -> bytes:
    """One server-sent event, framed by FastAPI; ``None`` data makes a keep-alive comment. Data is
    compact JSON (a string is sent as it is: the OpenAI client's ``[DONE]``)."""
    if data is None:
        return format_sse_event(comment="keep-alive")
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return format_sse_event(event=event, data_str=text)


def estimate_tokens(text: str) -> int:
    """~4 characters per token: usage figures are estimates (the pipeline may call the LLM several times)."""
    return math.ceil(len(text) / 4) if text else 0


# ----------------------------------------------------------------------------- /v1/query


def _prefect_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None
