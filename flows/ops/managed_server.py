"""The lifecycle every managed store server shares (a ``chroma run`` over a Chroma folder,
``chroma_server``; milvus-lite's engine over a ``.db`` file, ``milvus_server``): started on a free
loopback port by ``ragline serve``/``api``, published in ``<store>.server.json`` (``store_owner``)
once it answers, watched and restarted on the same port with a bounded backoff when it dies,
unpublished and stopped with its owner, and never outliving it (the parent-death prelude).

A subclass names the program (``program``), the prelude script that ends in ``exec`` of it
(``script``), its environment and how to tell that it answers (``answering``)."""
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
from typing import Any, ClassVar

from ragline.flows.ops.parent_death import PRELUDE
from ragline.flows.processes import start_time
from ragline.flows.resources.stores.store_owner import Endpoint, server_file

log = logging.getLogger("ragline.store_server")

START_TIMEOUT = 60.0  # seconds for the server to answer
MAX_RESTARTS = 5  # within RESTART_WINDOW; past that the server is left down and readiness says so
RESTART_WINDOW = 600.0
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0

# Arm the parent-death signal (it survives exec), then become the server's program.
EXEC_WITH_PARENT = PRELUDE + r"""
_arm_parent_death(int(sys.argv[1]), sys.argv[2] == "1")
os.execvp(sys.argv[3], sys.argv[3:])
"""


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ManagedServer:
    """A server over one store, owned by this process: started, published, supervised (restarted on
    the same port when it dies) and stopped with it."""

    label: ClassVar[str] = "store"  # what messages call it ("Chroma", "Milvus")
    script: ClassVar[str] = EXEC_WITH_PARENT

    def __init__(self, store_path: Path, *, say: Callable[[str], None] | None = None, host: str = "127.0.0.1",
                 logs: Path | None = None):
        self.path = Path(store_path).resolve()
        self.host = host
        self.port: int | None = None
        self.say = say or (lambda line: log.warning("%s", line))
        self.log_path = (logs or self.path.parent / "logs") / f"{self.label.lower()}-{self.path.name}.log"
        self.process: subprocess.Popen | None = None
        self.restarts: list[float] = []
        self.last_exit: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    # -- what a subclass says
    def program(self) -> list[str]:
        """The server's command line (exec'd by ``script`` after its own arguments)."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def answering(self) -> bool:
        """Whether the server answers on its port."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Make what the server needs before it starts (the folder its store lives in)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def script_arguments(self) -> list[str]:
        """Arguments ``script`` reads before the program (none for the plain exec)."""
        return []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> Endpoint | None:
        proc = self.process
        if proc is None or self.port is None or proc.poll() is not None:
            return None
        return Endpoint(self.host, self.port, proc.pid)

    # -- start and stop
    def start(self, timeout: float = START_TIMEOUT) -> ManagedServer:
        """Start the server, wait until it answers, publish it; then watch it in a thread."""
        self.prepare()
        self.port = self.port or free_port(self.host)
        self._launch(timeout)
        self._watcher = threading.Thread(target=self._watch, name=f"ragline-{self.label.lower()}-{self.port}",
                                         daemon=True)
        self._watcher.start()
        return self

    def _launch(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        main = threading.current_thread() is threading.main_thread()  # PDEATHSIG fires when the thread ends
        command = [sys.executable, "-c", self.script, str(os.getpid()), "1" if main else "0",
                   *self.script_arguments(), *self.program()]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=self.environment(),
                                            cwd=str(self.path.parent))
        deadline = time.monotonic() + timeout
        while not self.answering():
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.label} server for {self.path} exited with code "
                                   f"{self.process.returncode} while starting; log {self.log_path}:\n"
                                   f"{tail(self.log_path)}")
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"the {self.label} server for {self.path} did not answer on {self.url} within "
                                   f"{timeout:.0f} s; log {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.1)
        self._publish()

    def _publish(self) -> None:
        """Write the server file atomically, readable by this user only."""
        info = {"host": self.host, "port": self.port, "pid": self.process.pid, "owner": os.getpid(),
                "started": start_time(self.process.pid), "path": str(self.path),
                "hostname": socket.gethostname(), "kind": self.label.lower()}
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
            self.say(f"ragline: the {self.label} server for {self.path} {self.last_exit}; it was restarted "
                     f"{len(self.restarts)} times in {RESTART_WINDOW:g} s, so it stays down (log {self.log_path})")
            self.process = None
            self._stop.set()
            return
        wait = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** len(self.restarts))
        self.say(f"ragline: the {self.label} server for {self.path} {self.last_exit}; restarting it in {wait:g} s "
                 f"(log {self.log_path})")
        self.restarts.append(now)
        if self._stop.wait(wait):
            return
        try:
            self._launch(START_TIMEOUT)
        except (RuntimeError, OSError) as exc:
            self.say(f"ragline: could not restart the {self.label} server for {self.path}: {exc}")
            return
        self.say(f"ragline: the {self.label} server for {self.path} is back on {self.host}:{self.port}")

    def health(self) -> dict[str, Any]:
        """For readiness: up, or why not."""
        if self.endpoint is None:
            return {"up": False, "error": f"the managed {self.label} server for {self.path} is down"
                                          + (f" ({self.last_exit})" if self.last_exit else "")}
        return {"up": True, "error": None}


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
