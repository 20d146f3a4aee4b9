"""Socket exhaustion (issue 16 item 12), with real sockets against ``serve_api`` in a subprocess,
as ``ragline api`` runs it: half-sent requests are closed after the header deadline, half-sent
bodies after the body deadline, ``/healthz`` answers all along, also when the server's fd limit
(``ulimit -n 1024``) is lower than the number of hostile sockets."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers.slow_clients import half_sent, healthz_meanwhile, wait_closed

pytestmark = pytest.mark.integration

DEADLINE = 3.0  # header and body deadlines of the server under test
SERVER = """
import resource, sys
project, port, soft, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if soft:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ragline.flows.serve.app import serve_api
from ragline.flows.serve.connections import ConnectionLimits
serve_api(project, port=port, log_level="error",
          limits=ConnectionLimits(header_timeout_seconds=deadline, body_timeout_seconds=deadline))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def api_process(project: Path, fd_limit: int = 0) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(project), str(port), str(fd_limit), str(DEADLINE)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the API did not start"
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("fd_limit, count", [(0, 1500), (1024, 1100)], ids=["1500-sockets", "ulimit-1024"])
def test_half_sent_requests_are_closed_and_healthz_answers_meanwhile(api_project, many_fds, fd_limit, count):
    with api_process(api_project, fd_limit) as port:
        started = time.monotonic()
        sockets = half_sent(port, count, b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        latencies = healthz_meanwhile(port, DEADLINE - 0.5)
        closed, statuses = wait_closed(sockets, DEADLINE + 10)
        elapsed = time.monotonic() - started
        assert closed == count, f"{count - closed} half-sent requests still open after {elapsed:.1f} s"
        assert statuses.get(408, 0) + statuses.get(503, 0) == count, statuses  # each told why
        assert max(latencies) < 3.0, latencies
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    print(f"\n{count} half-sent requests (fd limit {fd_limit or 'default'}): all closed in {elapsed:.1f} s "
          f"({statuses}); /healthz meanwhile: max {max(latencies) * 1000:.0f} ms over {len(latencies)} calls")


def test_a_half_sent_body_is_closed_with_408_and_oversized_headers_with_431(api_project):
    with api_process(api_project) as port:
        bodies = half_sent(port, 50, b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 1000\r\n\r\n{\"question\": \"")
        huge = half_sent(port, 1, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 70_000)
        assert wait_closed(huge, 5) == (1, {431: 1})
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        started = time.monotonic()
        closed, statuses = wait_closed(bodies, DEADLINE + 10)
        assert (closed, statuses) == (50, {408: 50})
        assert time.monotonic() - started < DEADLINE + 5
        # a slow but steady client within the deadline is answered
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(DEADLINE / 5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_limits_come_from_the_environment_and_a_bad_value_names_its_variable(monkeypatch):
    from ragline.flows.serve.connections import ConnectionLimits

    monkeypatch.setenv("RAGLINE_HEADER_TIMEOUT_SECONDS", "2.5")
    monkeypatch.setenv("RAGLINE_MAX_CONNECTIONS", "50")
    limits = ConnectionLimits.from_env()
    assert limits.header_timeout_seconds == 2.5 and limits.connection_cap() == 50
    monkeypatch.setenv("RAGLINE_BODY_TIMEOUT_SECONDS", "-1")
    with pytest.raises(ValueError, match="RAGLINE_BODY_TIMEOUT_SECONDS"):
        ConnectionLimits.from_env()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert ConnectionLimits().connection_cap() == 768  # a quarter of the fds kept for the process
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert os.environ.get("RAGLINE_MAX_CONNECTIONS") == "50"


@pytest.mark.parametrize("implementation", ["h11", "httptools"])
def test_both_http_implementations_get_the_deadlines_and_the_cap(implementation):
    """uvicorn picks httptools when it is installed, else h11: the protocol works on either."""
    import threading

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from ragline.flows.serve.connections import ConnectionLimits, guarded_protocol

    if implementation == "httptools":
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        base = H11Protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while True:  # the whole body first, as the API's guard reads it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = ConnectionLimits(header_timeout_seconds=1, body_timeout_seconds=1, max_connections=40)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off", http=guarded_protocol(limits, base),
                                           timeout_keep_alive=limits.keep_alive_seconds))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    try:
        heads = half_sent(port, 30, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
        bodies = half_sent(port, 5, b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\nabc")
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"
        more = half_sent(port, 20, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-B: ")  # past the cap of 40
        closed, statuses = wait_closed(heads + bodies + more, 6)
        assert closed == 55 and statuses.get(408, 0) + statuses.get(503, 0) == 55, statuses
        assert statuses.get(503, 0) >= 15  # the oldest waiting ones made room for the newer
        silent = half_sent(port, 10, b"")  # connect, send nothing
        chunked = half_sent(port, 3, b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                     b"1\r\na\r\n")
        assert wait_closed(silent + chunked, 5) == (13, {0: 10, 408: 3})  # silent ones just closed
        garbage = half_sent(port, 1, b"NOT HTTP AT ALL\r\n\r\n")
        assert wait_closed(garbage, 5) == (1, {400: 1})
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
