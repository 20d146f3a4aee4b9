"""Who serves an embedded store: the record (``<store>.server.json``) that a managed server (a
``chroma run`` for a Chroma folder, ``ops.chroma_server``; milvus-lite's engine for a ``.db`` file,
``ops.milvus_server``) publishes, read by every ragline process before it opens the store
(``ChromaStore``, ``MilvusStore``), so all of them reach the one server instead of opening the files."""
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


class Owned:
    """For a store resource a managed server may own (``ChromaStore``, ``MilvusStore``: ``spec.host``,
    ``path`` and ``_lock``): the owner is looked up once per process, at its first call, so a process
    keeps the way it connected; while a ``ragline serve``/``api`` owns the store, every process goes
    through that server instead of opening the files itself."""

    _owner: Endpoint | None = None  # the managed server that owned the store when this process connected
    _owner_resolved = False

    def _served_by(self) -> Endpoint | None:
        if self.spec.host:
            return None
        with self._lock:
            if not self._owner_resolved:
                self._owner = owner_of(self.path)
                self._owner_resolved = True
            return self._owner
