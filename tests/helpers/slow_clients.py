"""Slow clients against a real server: half-sent requests, waiting for the server to close them,
and /healthz latency meanwhile."""
from __future__ import annotations

import selectors
import socket
import time

import httpx


def half_sent(port: int, count: int, payload: bytes) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(payload)
        sockets.append(sock)
    return sockets


def wait_closed(sockets: list[socket.socket], seconds: float) -> tuple[int, dict[int, int]]:
    """How many the server closed within ``seconds``, and the HTTP statuses it sent before closing."""
    watcher = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        watcher.register(sock, selectors.EVENT_READ, b"")
    deadline = time.monotonic() + seconds
    closed, statuses = 0, {}
    while closed < len(sockets) and time.monotonic() < deadline:
        for key, _ in watcher.select(0.2):
            try:
                data = key.fileobj.recv(65536)
            except OSError:
                data = b""
            if data:
                watcher.modify(key.fileobj, selectors.EVENT_READ, key.data + data)
                continue
            closed += 1
            status = int(key.data.split(b" ", 2)[1]) if key.data.startswith(b"HTTP/1.1 ") else 0
            statuses[status] = statuses.get(status, 0) + 1
            watcher.unregister(key.fileobj)
    watcher.close()
    for sock in sockets:
        sock.close()
    return closed, statuses


def healthz_meanwhile(port: int, seconds: float) -> list[float]:
    """Latency of /healthz on a new connection, once every 0.3 s (each must answer 200)."""
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert response.status_code == 200, response.text
        latencies.append(time.monotonic() - started)
        time.sleep(0.3)
    return latencies
