"""Who serves an embedded Chroma store: the record (``<store>.server.json``) that a managed
``chroma run`` (``ops.chroma_server``) publishes, read by every ragline process before it opens
the store (``ChromaStore``), so all of them reach the one server instead of opening the files."""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from ragline.flows.processes import same_process

SUFFIX = ".server.json"


@dataclass(frozen=True)
class Endpoint:
    """Where the server that owns a store folder listens."""

    host: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_file(store_path: Path) -> Path:
    """``<store folder>.server.json``, beside the folder (the server owns what is inside it)."""
    store_path = Path(store_path)
    return store_path.with_name(store_path.name + SUFFIX)


def owner_of(store_path: Path) -> Endpoint | None:
    """The live server that owns ``store_path``, or None (no file, or its process is gone).
    Read-only: a stale file is left for the next owner to replace."""
    try:
        info = json.loads(server_file(store_path).read_text())
        endpoint = Endpoint(str(info["host"]), int(info["port"]), int(info["pid"]))
        started = info.get("started")
        host = info.get("hostname")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host is not None and host != socket.gethostname():  # a data folder shared with another machine
        return None
    if not same_process(endpoint.pid, started):
        return None
    return endpoint



