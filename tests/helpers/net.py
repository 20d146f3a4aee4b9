"""Local ports for real servers and refused connections."""
from __future__ import annotations

import socket
import socketserver
import threading


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now (the OS picks it): free to listen on,
    refused to connect to."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


closed_port = free_port  # the same port, named where a test wants a refused connection


def serve_in_thread(server: socketserver.BaseServer) -> threading.Thread:
    """``server`` answering on a started daemon thread, polling for ``shutdown`` every 20 ms: at
    socketserver's default 0.5 s each ``shutdown`` waited about 0.25 s, and a suite starts hundreds."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    return thread
