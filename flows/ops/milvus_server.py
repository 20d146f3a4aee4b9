"""One owner for an embedded milvus-lite file while ragline serves it: milvus-lite's own engine
binary, listening on a loopback port (the gRPC API a Milvus server speaks).

Why: milvus-lite serves one process per ``.db`` file (its engine runs beside the process that opened
the file, which holds the file's lock), and every process that opens it loads every collection
whole before its first request. ``ragline serve`` is several processes by design (its API, a
process per flow run) and a terminal ``ragline index`` is one more: the second opener failed ("the
file has been opened by another program"), and each scheduled run paid the load (39 s and 2 GB at
100,000 documents, docs/results.md). So while ``ragline serve``/``api`` runs, it starts the engine
for each embedded file once, publishes it in ``<file>.server.json`` (``store_owner``), and every
ragline process of the project talks to it over gRPC, the collection loaded once, as the managed
``chroma run`` does for Chroma (``chroma_server``). Without a live owner, processes open the file
embedded, as before.

The engine takes the file's lock (``.<file>.lock``, milvus-lite's own) before it starts and holds
it for its life (a POSIX lock survives ``exec``), so an embedded opener in another process is
refused instead of writing the same files, and a server never starts over a file a process has
open: it waits ``LOCK_WAIT`` seconds for it, then fails naming the file.

The port is loopback-only and unauthenticated, as the managed Chroma server's.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from ragline.flows.ops.managed_server import ManagedServer
from ragline.flows.ops.parent_death import PRELUDE

LOCK_WAIT = 30.0  # seconds to wait for a process that has the file open embedded
LOCKED_EXIT = 75  # EX_TEMPFAIL: the file's lock is held by another process

# Arm the parent-death signal, take the file's lock on a descriptor the engine inherits, become the engine
# (its bundled libraries on LD_LIBRARY_PATH for it alone: they break this Python).
EXEC_LOCKED = PRELUDE + r"""
_arm_parent_death(int(sys.argv[1]), sys.argv[2] == "1")
import fcntl, time
lock_path, wait, libraries, program = sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6:]
fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
os.set_inheritable(fd, True)
deadline = time.monotonic() + wait
while True:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
    except OSError:
        if time.monotonic() > deadline:
            print(f"ragline: {program[1]} is open in another process (milvus-lite serves one process per "
                  f"file; its lock {lock_path}); stop that process, then start again", file=sys.stderr, flush=True)
            sys.exit(75)  # LOCKED_EXIT
        time.sleep(0.2)
inherited = os.environ.get("LD_LIBRARY_PATH")  # the engine's libraries, for it alone (not this Python)
os.execve(program[0], program, {**os.environ, "LD_LIBRARY_PATH": libraries + (":" + inherited if inherited else "")})
"""


def engine_binary() -> Path:
    """milvus-lite's engine (``milvus_lite/lib/milvus``) and the folder of its libraries."""
    import milvus_lite

    return Path(milvus_lite.__file__).resolve().parent / "lib" / "milvus"


class ManagedMilvus(ManagedServer):
    """milvus-lite's engine over one ``.db`` file, on a loopback port, owned by this process."""

    label = "Milvus"
    script = EXEC_LOCKED

    @property
    def lock_path(self) -> Path:
        """milvus-lite's own lock file of the database (``milvus_lite.server.Server``'s)."""
        return self.path.with_name(f".{self.path.name}.lock")

    def script_arguments(self) -> list[str]:
        return [str(self.lock_path), str(LOCK_WAIT), str(engine_binary().parent)]

    def program(self) -> list[str]:
        return [str(engine_binary()), str(self.path), f"{self.host}:{self.port}", os.environ.get("LOG_LEVEL", "ERROR")]

    def answering(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=1.0).close()
            return True
        except OSError:
            return False
