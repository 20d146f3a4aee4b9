"""A stand-in OpenTelemetry collector: a real OTLP/HTTP receiver on loopback that accepts
``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``, gzip or not) and keeps the spans,
decoded with opentelemetry-proto, as plain dicts."""
from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.helpers.net import serve_in_thread

KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in Span.SpanKind.items()}


def _value(any_value: Any) -> Any:
    field = any_value.WhichOneof("value")
    if field == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, field) if field else None


class OtlpReceiver:
    """``spans``: every span received, as {name, trace_id, span_id, parent_id, kind, attributes, status}."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.posts += 1
            for resource_spans in request.resource_spans:
                service = {a.key: _value(a.value) for a in resource_spans.resource.attributes}.get("service.name")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex() or None, "kind": KINDS[span.kind],
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "status": span.status.code, "service": service,
                            "seconds": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9})

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, ready: Callable[[], Any], timeout: float = 30.0) -> Any:
        from ragline.flows import telemetry

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            telemetry.flush()
            found = ready()
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"the receiver never got what was waited for ({len(self.spans)} spans received)")

    def __enter__(self) -> "OtlpReceiver":
        self.thread = serve_in_thread(self.httpd)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
