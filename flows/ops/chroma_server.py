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

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragline.flows.ops.parent_death import PRELUDE
from ragline.flows.processes import start_time
from ragline.flows.resources.chroma_owner import Endpoint, owner_of, server_file
from ragline.flows.resources.state import StorageError, StoreDamaged

log = logging.getLogger("ragline.chroma_server")

START_TIMEOUT = 60.0  # seconds for `chroma run` to answer its heartbeat
MAX_RESTARTS = 5  # within RESTART_WINDOW; past that the server is left down and readiness says so
RESTART_WINDOW = 600.0
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0

# Arm the parent-death signal (it survives exec), then become `chroma run`.
_WITH_PARENT = PRELUDE + r"""
_arm_parent_death(int(sys.argv[1]), sys.argv[2] == "1")
os.execvp(sys.argv[3], sys.argv[3:])
"""


def chroma_command() -> str:
    """The ``chroma`` CLI of this environment (beside the interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name("chroma")
    return str(beside) if beside.exists() else "chroma"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _heartbeat(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/api/v2/heartbeat", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class ManagedChroma:
    """A ``chroma run`` over one store folder, owned by this process: started, published,
    supervised (restarted on the same port when it dies) and stopped with it."""

    def __init__(self, store_path: Path, *, say: Callable[[str], None] | None = None, host: str = "127.0.0.1",
                 logs: Path | None = None):
        self.path = Path(store_path).resolve()
        self.host = host
        self.port: int | None = None
        self.say = say or (lambda line: log.warning("%s", line))
        self.log_path = (logs or self.path.parent / "logs") / f"chroma-{self.path.name}.log"
        self.process: subprocess.Popen | None = None
        self.restarts: list[float] = []
        self.last_exit: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def endpoint(self) -> Endpoint | None:
        proc = self.process
        if proc is None or self.port is None or proc.poll() is not None:
            return None
        return Endpoint(self.host, self.port, proc.pid)

    # -- start and stop
    def start(self, timeout: float = START_TIMEOUT) -> ManagedChroma:
        """Start the server, wait for its heartbeat, publish it; then watch it in a thread."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.port = self.port or _free_port(self.host)
        self._launch(timeout)
        self._watcher = threading.Thread(target=self._watch, name=f"ragline-chroma-{self.port}", daemon=True)
        self._watcher.start()
        return self

    def _launch(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "1"}
        main = threading.current_thread() is threading.main_thread()  # PDEATHSIG fires when the thread ends
        command = [sys.executable, "-c", _WITH_PARENT, str(os.getpid()), "1" if main else "0", chroma_command(),
                   "run", "--path", str(self.path), "--host", self.host, "--port", str(self.port)]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        url = f"http://{self.host}:{self.port}"
        while not _heartbeat(url):
            if self.process.poll() is not None:
                raise RuntimeError(f"the Chroma server for {self.path} exited with code {self.process.returncode} "
                                   f"while starting; log {self.log_path}:\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"the Chroma server for {self.path} did not answer on {url} within {timeout:.0f} s;"
                                   f" log {self.log_path}:\n{_tail(self.log_path)}")
            time.sleep(0.1)
        self._publish()

    def _publish(self) -> None:
        """Write the server file atomically, readable by this user only."""
        info = {"host": self.host, "port": self.port, "pid": self.process.pid, "owner": os.getpid(),
                "started": start_time(self.process.pid), "path": str(self.path),
                "hostname": socket.gethostname()}
        target = server_file(self.path)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(info, out)
        os.replace(tmp, target)

    def stop(self, grace: float = 10.0) -> None:
        """Unpublish, then SIGTERM the server's process group (SIGKILL after ``grace``)."""
        self._stop.set()
        with self._lock:
            self._unpublish()
            self._kill(grace)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)

    def _unpublish(self) -> None:
        """Remove the server file if it still names this server (another owner may have replaced it)."""
        target = server_file(self.path)
        with contextlib.suppress(OSError, ValueError):
            if self.process is not None and json.loads(target.read_text()).get("pid") == self.process.pid:
                target.unlink()

    def _kill(self, grace: float = 10.0) -> None:
        proc = self.process
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # -- supervision
    def _watch(self, every: float = 1.0) -> None:
        while not self._stop.wait(every):
            proc = self.process
            if proc is None or proc.poll() is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._restart(proc.returncode)

    def _restart(self, code: int) -> None:
        self.last_exit = f"exited with code {code}"
        self._unpublish()
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
        if len(self.restarts) >= MAX_RESTARTS:
            self.say(f"ragline: the Chroma server for {self.path} {self.last_exit}; it was restarted "
                     f"{len(self.restarts)} times in {RESTART_WINDOW:g} s, so it stays down (log {self.log_path})")
            self.process = None
            self._stop.set()
            return
        wait = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** len(self.restarts))
        self.say(f"ragline: the Chroma server for {self.path} {self.last_exit}; restarting it in {wait:g} s "
                 f"(log {self.log_path})")
        self.restarts.append(now)
        if self._stop.wait(wait):
            return
        try:
            self._launch(START_TIMEOUT)
        except (RuntimeError, OSError) as exc:
            self.say(f"ragline: could not restart the Chroma server for {self.path}: {exc}")
            return
        self.say(f"ragline: the Chroma server for {self.path} is back on {self.host}:{self.port}")

    def health(self) -> dict[str, Any]:
        """For readiness: up, or why not."""
        if self.endpoint is None:
            return {"up": False, "error": f"the managed Chroma server for {self.path} is down"
                                          + (f" ({self.last_exit})" if self.last_exit else "")}
        return {"up": True, "error": None}


def embedded_stores(project: Any) -> list[Path]:
    """The folders of the project's embedded Chroma stores (no ``host``), each once."""
    folders: dict[Path, None] = {}
    for name, spec in project.spec.resources.items():
        if getattr(spec, "type", None) == "chroma" and not spec.host:
            folders[project.resource(name).path] = None
    return list(folders)


def serve_stores(project: Any, stack: contextlib.ExitStack, say: Callable[[str], None]) -> list[ManagedChroma]:
    """Own every embedded store of ``project`` for the life of ``stack``: start a server for each one
    no live ragline process owns yet (one that does is shared, not replaced)."""
    servers: list[ManagedChroma] = []
    folders = embedded_stores(project)
    if not folders:
        return servers
    _wait_for_embedded_writers(project, say)
    for folder in folders:
        server = _serve_one(folder, say)
        if server is not None:
            stack.callback(server.stop)
            servers.append(server)
    return servers


def _wait_for_embedded_writers(project: Any, say: Callable[[str], None], poll: float = 0.5) -> None:
    """Wait while a run writes the store embedded (a terminal ``ragline index`` holds the state's
    writer lease): a server started under it would never see that writer's vectors. Read-only (the
    API must not write the state); a writer that starts after this check opens the store at its
    first Chroma call, inside its lease, and by then finds the published server."""
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


def _serve_one(folder: Path, say: Callable[[str], None]) -> ManagedChroma | None:
    owner = owner_of(folder)
    if owner is not None:
        say(f"ragline: the store {folder} is already served by the Chroma server on {owner.url} "
            f"(pid {owner.pid}); using it")
        return None
    server = ManagedChroma(folder, say=say).start()
    say(f"ragline: Chroma server for {folder} on {server.host}:{server.port} (pid {server.process.pid}); "
        f"every ragline process of this project uses it while this one runs")
    return server


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
