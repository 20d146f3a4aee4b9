"""Local ports for real servers and refused connections."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now (the OS picks it): free to listen on,
    refused to connect to."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


closed_port = free_port  # the same port, named where a test wants a refused connection
