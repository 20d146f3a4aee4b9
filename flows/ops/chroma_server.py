"""One owner for an embedded Chroma store while ragline serves it: a managed ``chroma run``.

Why: Chroma's embedded mode (``PersistentClient``) assumes one process per folder. It keeps each
collection's HNSW index in memory, so a process that opened the store never sees vectors another
process wrote afterwards (``ragline serve``'s API answered from the index as it was when the API
first read it, or failed with "Error creating hnsw segment reader: Nothing found on disk" when it
was empty then), and a chunk deleted elsewhere comes back as an empty passage. ``ragline serve``
is several processes by design (its API, and a new process for every flow run), and a terminal
``ragline index`` is one more.

So while ``ragline serve`` or ``ragline api`` runs, it starts a Chroma server for each embedded
store it uses (``chroma run --path <the store's folder>``: the same files, nothing to migrate) on a
free loopback port and publishes it in ``<store folder>.server.json``. Every ragline process that
opens that folder (the API, flow runs, a terminal ``ragline index`` or ``search``) finds the file
and talks to the server instead of opening the folder itself; the server is the only process
that touches the files, so every reader sees every write as soon as it is made. Without a live
owner (serve stopped, or killed: the server dies with it) processes open the folder embedded, as
before. A server that dies is restarted on the same port, with a bounded backoff.

The alternatives were weaker: re-opening the embedded client whenever the state's generation
moves still has two processes reading and writing one folder, which Chroma does not support
(mid-write reads fail), and running ingestion inside the API process would not cover a terminal
``ragline index``. The server costs ~130 MB and ~1.5 s to start; flow-run processes no longer load
the HNSW index each.

The port is loopback-only and unauthenticated (``chroma run`` has no token option): any local user
could reach it, as they could read the store's files if the folder's permissions allowed. On a
shared host, run your own Chroma server with authentication (``host:`` and ``auth_token_env`` on
the store) or keep the data folder private.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ragline.flows.ops.managed_server import ManagedServer


def chroma_command() -> str:
    """The ``chroma`` CLI of this environment (beside the interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name("chroma")
    return str(beside) if beside.exists() else "chroma"


class ManagedChroma(ManagedServer):
    """A ``chroma run`` over one store folder, owned by this process (``ManagedServer``)."""

    label = "Chroma"

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def program(self) -> list[str]:
        return [chroma_command(), "run", "--path", str(self.path), "--host", self.host, "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "1"}

    def answering(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/api/v2/heartbeat", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False
