"""Connection limits for the uvicorn servers ragline starts (``ragline api``, ``ragline serve``).

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no deadline for a
request to arrive: a client that sends half a request line or half its headers, or announces a
body and never sends it, holds its socket for good (issue 16: 1,500 half-sent requests were never
closed, and 1,100 under ``ulimit -n 1024`` made ``/healthz`` fail for everyone). uvicorn's
``limit_concurrency`` does not help: it counts those sockets and answers *every* new request 503,
``/healthz`` included.

So the HTTP protocol is uvicorn's own, with three additions:

- a **header deadline**: a request's line and headers must arrive within ``header_timeout_seconds``
  of the connection opening (or of the previous response), and be at most ``max_header_bytes``;
- a **body deadline**: its body within ``body_timeout_seconds`` of the headers;
- a **connection cap**: at most ``max_connections`` open sockets, lowered to fit the process's fd
  limit (a quarter of it kept for files, the store, the LLM and Prefect clients). At the cap a new
  connection closes the one that has waited longest for its request (idle keep-alive first in
  practice: they wait from their last response), as nginx reuses idle connections; a new one is
  refused with 503 only when every open connection is running a request.

A late request is answered ``408`` (in the API's error shape) and closed; an idle one is closed.
A request the HTTP parser rejects is answered 400 in the same shape (uvicorn's is plain text).
Settings: ``ConnectionLimits`` (``serve_api(limits=...)``) or the environment:
``RAGLINE_HEADER_TIMEOUT_SECONDS`` (10), ``RAGLINE_BODY_TIMEOUT_SECONDS`` (30),
``RAGLINE_MAX_CONNECTIONS`` (1000), ``RAGLINE_KEEP_ALIVE_SECONDS`` (5).
"""
from __future__ import annotations

import json
import resource
from typing import Any

from pydantic import ConfigDict, Field

from ragline.flows import settings


class ConnectionLimits(settings.ConnectionFields):
    """The settings' four limits (``RAGLINE_*``) plus the header size uvicorn is given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers, in bytes")

    @classmethod
    def from_env(cls) -> ConnectionLimits:
        """From the ``RAGLINE_*`` settings (``flows.settings``); a bad value is an error naming its variable."""
        return cls(**settings.connections().model_dump())

    def connection_cap(self) -> int:
        """``max_connections``, lowered so that sockets never take the fds the process needs."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(8, min(self.max_connections, soft - max(64, soft // 4)))

    def uvicorn_settings(self) -> dict[str, Any]:
        """Keyword arguments for ``uvicorn.Config``."""
        return {"http": guarded_protocol(self), "timeout_keep_alive": self.keep_alive_seconds,
                "h11_max_incomplete_event_size": self.max_header_bytes}


def server_limits(limits: ConnectionLimits | None = None) -> dict[str, Any]:
    """``uvicorn.Config`` arguments for ragline's servers: the given limits, or the environment's."""
    return (limits or ConnectionLimits.from_env()).uvicorn_settings()


def _refusal(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits, base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``; default httptools when installed, else h11, as uvicorn
    picks) with the deadlines and the cap."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    cap = limits.connection_cap()

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.waiting: str | None = None  # "request" (line, headers), "body", None: being answered
            self.waiting_since = 0.0
            self.received = 0  # bytes of the request awaited
            self._deadline: Any = None

        # -- uvicorn's protocol hooks
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._sync()
            if len(self.connections) > cap:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self.received += len(data)
            super().data_received(data)
            if self.transport.is_closing():
                return
            self._sync()
            if self.waiting == "request" and self.received > limits.max_header_bytes:
                self.refuse(431, "Request Header Fields Too Large", "headers_too_large",
                            f"the request line and headers exceed {limits.max_header_bytes} bytes")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._sync()

        def send_400_response(self, msg: str) -> None:
            """A request the parser rejects: the error shape of every route, not uvicorn's plain text."""
            self.refuse(400, "Bad Request", "invalid_http", f"not a valid HTTP/1.1 request: {msg}")

        # -- the deadlines
        def _phase(self) -> str | None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return "request"
            return "body" if cycle.more_body and not cycle.response_started else None

        def _sync(self) -> None:
            phase = self._phase()
            if phase == self.waiting:
                return
            self._cancel()
            self.waiting, self.waiting_since, self.received = phase, self.loop.time(), 0
            if phase is not None:
                seconds = limits.header_timeout_seconds if phase == "request" else limits.body_timeout_seconds
                self._deadline = self.loop.call_later(seconds, self._expired)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.waiting == "request" and self.received == 0:
                self.transport.close()  # idle: nothing was asked
                return
            seconds = limits.header_timeout_seconds if self.waiting == "request" else limits.body_timeout_seconds
            part = "request line and headers" if self.waiting == "request" else "request body"
            self.refuse(408, "Request Timeout", "request_timeout", f"the {part} did not arrive within {seconds:g} s")

        def refuse(self, status: int, reason: str, code: str, message: str) -> None:
            """Answer in the API's error shape and close (the parser's state is abandoned)."""
            self._cancel()
            self.waiting = None
            self.transport.write(_refusal(status, reason, code, message))
            self.transport.close()

        # -- the cap
        def _make_room(self) -> None:
            """Close the connection that has waited longest for its request; if every other one is
            running a request, refuse this one."""
            open_count, oldest = 0, None
            for other in self.connections:
                transport = getattr(other, "transport", None)
                if transport is None or transport.is_closing():
                    continue
                open_count += 1
                if other is not self and getattr(other, "waiting", None) is not None and \
                        (oldest is None or other.waiting_since < oldest.waiting_since):
                    oldest = other
            if open_count <= cap:
                return
            message = f"the server is at its limit of {cap} connections"
            if oldest is None:
                self.refuse(503, "Service Unavailable", "too_many_connections", message)
            elif oldest.received == 0:
                oldest.transport.close()
            else:
                oldest.refuse(503, "Service Unavailable", "too_many_connections", message)

    return GuardedHTTPProtocol
