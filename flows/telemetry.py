"""Metrics (Prometheus) and traces (OpenTelemetry), recorded once where things happen: the API's
guard (HTTP requests), the query service (a query's outcome and step timings), the step runner
(``flows/run/steps.execute``: one span per step), the LLM client (tokens, queue wait, a span per
call). Why one module: every layer records into it, so it sits at the bottom and imports nothing
of ragline's but the settings.

Metrics live in one registry (``REGISTRY``), served by the API at ``/metrics``; every label value
comes from the compiled pipelines file (pipeline, step, model names) or a fixed set (status,
reason, lane), never from a request, so a client cannot grow the series. ``RAGLINE_METRICS=0``
turns recording off.

Traces are off unless an OTLP/HTTP endpoint is configured (``RAGLINE_OTLP_ENDPOINT``, else the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``). ragline keeps its
own tracer provider (the global one is left to the application). A step runs in any process: its
parent travels with the step as a W3C ``traceparent`` string (``carrier``/``step_span``). Question,
prompt and answer text go on spans only with ``RAGLINE_TRACE_CONTENT=1``.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector

from ragline.flows import settings

# ----------------------------------------------------------------------------- metrics
REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)  # CPU, memory, open fds of the API process
GCCollector(registry=REGISTRY)

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNMATCHED = "<unmatched>"  # the route label of a request no route matched (any path: one series)
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

HTTP_REQUESTS = Counter("ragline_http_requests", "HTTP requests answered, by route template, method and status",
                        ["route", "method", "status"], registry=REGISTRY)
HTTP_DURATION = Histogram("ragline_http_request_duration_seconds", "HTTP request time to the last body byte",
                          ["route", "method"], buckets=SECONDS, registry=REGISTRY)
QUERIES = Counter("ragline_queries", "queries run, by pipeline and outcome (answered, refused, failed)",
                  ["pipeline", "status"], registry=REGISTRY)
QUERY_ERRORS = Counter("ragline_query_errors", "failed queries, by pipeline, failed step ('-': none) and error code",
                       ["pipeline", "step", "code"], registry=REGISTRY)
QUERY_DURATION = Histogram("ragline_query_duration_seconds", "a query's whole run", ["pipeline"], buckets=SECONDS,
                           registry=REGISTRY)
STEP_DURATION = Histogram("ragline_step_duration_seconds", "one step of a query", ["pipeline", "step"],
                          buckets=SECONDS, registry=REGISTRY)
REFUSALS = Counter("ragline_refusals", "answers replaced by the refusal text, by pipeline and reason",
                   ["pipeline", "reason"], registry=REGISTRY)
LLM_TOKENS = Counter("ragline_llm_tokens", "LLM tokens by model and kind (prompt, completion)", ["model", "kind"],
                     registry=REGISTRY)
LLM_DURATION = Histogram("ragline_llm_request_duration_seconds", "one LLM call in its slot, retries included",
                         ["model", "call"], buckets=SECONDS, registry=REGISTRY)
LLM_QUEUE_WAIT = Histogram("ragline_llm_queue_wait_seconds", "wait for a concurrency slot of the LLM client, by lane",
                           ["lane"], buckets=(0.001,) + SECONDS, registry=REGISTRY)
INFO = Gauge("ragline_build_info", "1, labelled with the served pipelines file's digest", ["config_digest"],
             registry=REGISTRY)

# refusal reasons (free text, from verify/generate) to a fixed set of labels, by their start
REFUSAL_REASONS = (("low confidence", "low_confidence"), ("degenerate answer", "degenerate"),
                   ("the answer cites no reference", "no_citation"), ("fact check", "fact_check"),
                   ("the references do not contain", "not_in_references"), ("ungrounded", "ungrounded"),
                   ("no passage", "no_passages"))


def metrics_on() -> bool:
    return bool(settings.telemetry().metrics)


def refusal_reason(text: str) -> str:
    """A refusal's reason as one of a fixed set of labels ('other' for the rest)."""
    lowered = (text or "").strip().lower()
    return next((label for start, label in REFUSAL_REASONS if lowered.startswith(start)), "other")


def query_done(pipeline: str, status: str, seconds: float, steps: list[tuple[str, float]] | None = None,
               *, refusal: str | None = None, error: BaseException | None = None) -> None:
    """A finished query's outcome and step timings (the ones the ``ragline.query.completed`` event carries)."""
    if not metrics_on():
        return
    QUERIES.labels(pipeline, status).inc()
    QUERY_DURATION.labels(pipeline).observe(seconds)
    for step, step_seconds in steps or ():
        STEP_DURATION.labels(pipeline, step).observe(step_seconds)
    if refusal is not None:
        REFUSALS.labels(pipeline, refusal_reason(refusal)).inc()
    if error is not None:
        step = getattr(error, "step", None) or "-"  # a StepFailed names its step; by its cause's code, as the API
        code = getattr(getattr(error, "cause", None), "error_code", None) or getattr(error, "error_code", None)
        QUERY_ERRORS.labels(pipeline, step, code or "internal_error").inc()


def http_done(route: str, method: str, status: int, seconds: float) -> None:
    if not metrics_on():
        return
    method = method if method in METHODS else "OTHER"
    HTTP_REQUESTS.labels(route, method, str(status)).inc()
    HTTP_DURATION.labels(route, method).observe(seconds)


def llm_call_done(model: str, call: str, seconds: float, prompt_tokens: int | None,
                  completion_tokens: int | None) -> None:
    if not metrics_on():
        return
    LLM_DURATION.labels(model, call).observe(seconds)
    if prompt_tokens:
        LLM_TOKENS.labels(model, "prompt").inc(prompt_tokens)
    if completion_tokens:
        LLM_TOKENS.labels(model, "completion").inc(completion_tokens)


def queue_waited(lane: str, seconds: float) -> None:
    if metrics_on():
        LLM_QUEUE_WAIT.labels(lane).observe(seconds)


# ----------------------------------------------------------------------------- traces
_providers: dict[str, Any] = {}  # endpoint -> TracerProvider (one per endpoint this process exported to)
_providers_lock = threading.Lock()
MAX_LISTED = 20  # retrieved ids and scores put on a span (the top: encoding each costs ~10 µs)
MAX_ATTRIBUTE_CHARS = 4000


def traces_endpoint() -> str | None:
    """Where spans go (the full ``.../v1/traces`` URL), None when tracing is off."""
    base = settings.telemetry().otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return base.rstrip("/") + "/v1/traces" if not base.rstrip("/").endswith("/v1/traces") else base
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None


def content_on() -> bool:
    return bool(settings.telemetry().trace_content)


_tracers: dict[Any, Any] = {}  # the endpoint variables' texts -> tracer (None: off); asked per span


def tracer() -> Any:
    """ragline's tracer for the configured endpoint, None when tracing is off."""
    key = (os.environ.get(settings.env_name("otlp_endpoint")), os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
           os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    try:
        return _tracers[key]
    except KeyError:
        pass
    endpoint = traces_endpoint()
    if endpoint is None:
        _tracers[key] = None
        return None
    with _providers_lock:
        provider = _providers.get(endpoint) or _new_provider(endpoint)
        _providers[endpoint] = provider
        _tracers[key] = provider.get_tracer("ragline")
    return _tracers[key]


def _new_provider(endpoint: str) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME") or "ragline"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    # batches every 5 s (OTel's default): one export per batch costs ~5 ms of CPU here, so exporting
    # every second cost a lightly loaded API ~1 ms per query (bench/observability_overhead.py)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
    return provider


def flush(timeout_seconds: float = 10.0) -> None:
    """Send every finished span now (a flow run's process may exit next)."""
    for provider in list(_providers.values()):
        provider.force_flush(int(timeout_seconds * 1000))


def carrier() -> str:
    """The current span as a W3C ``traceparent`` ("" without one): a step's parent, as plain data."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def parent_context(traceparent: str) -> Any:
    """An OTel context whose current span is the one ``traceparent`` names (None: the current context).
    Parsed here, once per run's parent (a query's steps share it), not by the W3C propagator per step."""
    if not traceparent:
        return None
    try:
        return _PARENTS[traceparent]
    except KeyError:
        pass
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    try:
        version, trace_hex, span_hex, flags = traceparent.split("-")
        parsed = SpanContext(int(trace_hex, 16), int(span_hex, 16), is_remote=True,
                             trace_flags=TraceFlags(int(flags, 16)))
    except ValueError:
        version, parsed = "", None
    if parsed is None or version != "00" or not parsed.is_valid:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract({"traceparent": traceparent})  # what the W3C rules make of it
    if len(_PARENTS) >= 256:  # about one per query in flight: a bound, never a leak
        _PARENTS.clear()
    _PARENTS[traceparent] = found = trace.set_span_in_context(NonRecordingSpan(parsed))
    return found


_PARENTS: dict[str, Any] = {}
_KINDS: dict[str, Any] = {}


@contextlib.contextmanager
def span(name: str, attributes: dict[str, Any] | Callable[[], dict[str, Any] | None] | None = None, *,
         parent: str = "", kind: str = "INTERNAL") -> Iterator[Any]:
    """A span made current for the block (None when tracing is off); an exception marks it failed.
    ``attributes`` may be a function: called only when the span records (a sampler may drop it).
    What ``start_as_current_span`` does, without its layers of wrappers."""
    tracer_ = tracer()
    if tracer_ is None:
        yield None
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    kind_ = _KINDS.get(kind) or _KINDS.setdefault(kind, getattr(SpanKind, kind))
    current = tracer_.start_span(name, context=parent_context(parent), kind=kind_)
    if current.is_recording():
        values = attributes() if callable(attributes) else attributes
        if values:
            current.set_attributes(clean(values))
    token = otel_context.attach(trace.set_span_in_context(current))
    try:
        yield current
    except Exception as exc:  # as use_span: recorded and marked failed, then raised
        if current.is_recording():
            current.record_exception(exc)
            current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
        current.end()


def trace_id(span_: Any) -> str | None:
    """The span's trace id as 32 hex digits."""
    if span_ is None:
        return None
    context = span_.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


def traceparent(span_: Any) -> str | None:
    if span_ is None:
        return None
    context = span_.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}" if context.is_valid else None


def clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes OTel accepts: None dropped, long text clipped, dicts as JSON."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, dict):
            value = json.dumps(value, default=str, sort_keys=True)
        if isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS:
            value = value[:MAX_ATTRIBUTE_CHARS] + "…"
        if isinstance(value, (list, tuple)):
            value = [v if isinstance(v, (str, bool, int, float)) else str(v) for v in value]
        out[key] = value
    return out


def describe_value(prefix: str, value: Any, listed: bool = True) -> dict[str, Any]:
    """Size, and for passages the ids and scores of the first ``MAX_LISTED`` (unless ``listed`` is
    false: a step's inputs are its upstream steps' outputs, listed there), of a step's input or
    output as span attributes; rankings and an inserted context count their passages; no text
    without ``trace_content``."""
    attributes: dict[str, Any] = {}
    passages = _passages(value)
    if passages is not None:
        attributes[f"{prefix}.size"] = len(passages)
        if isinstance(value, (list, tuple)) and value and hasattr(value[0], "passages"):
            attributes[f"{prefix}.rankings"] = len(value)
        if not listed:
            return attributes
        listed = passages[:MAX_LISTED]
        attributes[f"{prefix}.ids"] = [str(p.chunk_id) for p in listed]
        scores = [getattr(p, "score", None) for p in listed]
        if all(isinstance(s, (int, float)) for s in scores):
            attributes[f"{prefix}.scores"] = [float(s) for s in scores]
    elif isinstance(value, (list, tuple)):
        attributes[f"{prefix}.size"] = len(value)
    elif value is not None:
        attributes[f"{prefix}.type"] = type(value).__name__
        for field in ("refused", "verdict", "confidence", "added", "updated", "deleted", "failed",
                      "chunks_written"):
            found = getattr(value, field, None)
            if isinstance(found, (str, bool, int, float)):
                attributes[f"{prefix}.{field}"] = found
        if content_on():
            text = getattr(value, "text", None)
            if isinstance(text, str):
                attributes[f"{prefix}.text"] = text
    return attributes


def _passages(value: Any) -> list[Any] | None:
    """The passages a value holds: a list of them, of rankings, or an inserted context's documents."""
    if isinstance(value, (list, tuple)):  # lists are of one type: the first element says which
        if value and hasattr(value[0], "chunk_id"):
            return list(value)
        if value and hasattr(value[0], "passages"):
            return [p for ranking in value for p in ranking.passages]
        return None
    documents = getattr(value, "documents", None)
    if isinstance(documents, list) and documents and all(hasattr(d, "passage") for d in documents):
        return [d.passage for d in documents]
    return None
