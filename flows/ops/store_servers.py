"""One owner per embedded store while ``ragline serve``/``api`` runs: a managed server for each
Chroma folder (``chroma_server``) and each milvus-lite ``.db`` file (``milvus_server``) of the
project, so the API, every flow-run process and a terminal command reach the one server that holds
the store instead of opening its files (each module says why its engine needs it)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragline.flows.ops.chroma_server import ManagedChroma
from ragline.flows.ops.managed_server import ManagedServer
from ragline.flows.ops.milvus_server import ManagedMilvus
from ragline.flows.resources.stores.state import StorageError, StoreDamaged
from ragline.flows.resources.stores.store_owner import owner_of

MANAGED: dict[str, type[ManagedServer]] = {"chroma": ManagedChroma, "milvus": ManagedMilvus}


def embedded_stores(project: Any) -> list[tuple[type[ManagedServer], Path]]:
    """The project's embedded stores (no server configured), each once, with the server class that
    manages its kind: Chroma folders and milvus-lite files."""
    stores: dict[Path, type[ManagedServer]] = {}
    for name, spec in project.spec.resources.items():
        kind = MANAGED.get(getattr(spec, "type", None))
        if kind is not None and not spec.host:
            stores[project.resource(name).path] = kind
    return [(kind, path) for path, kind in stores.items()]


def serve_stores(project: Any, stack: contextlib.ExitStack, say: Callable[[str], None]) -> list[ManagedServer]:
    """Own every embedded store of ``project`` for the life of ``stack``: start a server for each one
    no live ragline process owns yet (one that does is shared, not replaced)."""
    servers: list[ManagedServer] = []
    stores = embedded_stores(project)
    if not stores:
        return servers
    _wait_for_embedded_writers(project, say)
    for kind, path in stores:
        server = _serve_one(kind, path, say)
        if server is not None:
            stack.callback(server.stop)
            servers.append(server)
    return servers


def _wait_for_embedded_writers(project: Any, say: Callable[[str], None], poll: float = 0.5) -> None:
    """Wait while a run writes the store embedded (a terminal ``ragline index`` holds the state's
    writer lease): a server started under it would never see that writer's vectors. Read-only (the
    API must not write the state); a writer that starts after this check opens the store at its
    first call, inside its lease, and by then finds the published server."""
    for name, spec in project.spec.resources.items():
        if getattr(spec, "type", None) != "index_state":
            continue
        state = project.resource(name)
        told = False
        while (holder := _live_writer(state)) is not None:
            if not told:
                say(f"ragline: waiting for {holder.describe()} to finish writing the index before serving its store")
                told = True
            time.sleep(poll)


def _live_writer(state: Any):
    """The live holder of the state's writer lease (read through its read-only connection), else None."""
    import sqlite3

    try:
        holder = state.lease_holder()
    except (StoreDamaged, StorageError, sqlite3.Error):  # nothing indexed yet, or a damaged state: the
        return None                                       # writer's own run reports that
    return holder if holder is not None and not holder.stale(time.time(), 30.0) else None


def _serve_one(kind: type[ManagedServer], path: Path, say: Callable[[str], None]) -> ManagedServer | None:
    owner = owner_of(path)
    if owner is not None:
        say(f"ragline: the store {path} is already served by the server on {owner.url} (pid {owner.pid}); using it")
        return None
    server = kind(path, say=say).start()
    say(f"ragline: {kind.label} server for {path} on {server.host}:{server.port} (pid {server.process.pid}); "
        f"every ragline process of this project uses it while this one runs")
    return server
