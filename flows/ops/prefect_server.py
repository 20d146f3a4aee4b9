"""The local Prefect API that ragline starts when no ``PREFECT_API_URL`` is configured.

Prefect 3.8's own fallback (``SubprocessASGIServer``, started lazily by ``get_client()`` when the
active profile has ``PREFECT_SERVER_EPHEMERAL_ENABLED``) runs uvicorn as a plain child in the
terminal's process group and stops it only from an ``atexit`` hook. So Ctrl-C reaches the server
first (the flow run then retries its crash report against a dead API for minutes), and a
``kill -9`` of ragline leaves the server running for good. ``local_api()`` replaces it:

- it does nothing when an API is configured (``PREFECT_API_URL`` in the environment or the
  active Prefect profile): that server is the user's;
- otherwise it starts Prefect's API app (UI and most services off, as Prefect's ephemeral server)
  under uvicorn on a free loopback port, in **its own session** (the terminal's SIGINT does not
  reach it), with a **parent-death signal** (``PR_SET_PDEATHSIG``) and a watchdog thread that
  stops it once ragline's pid is gone (``kill -9`` included);
- the database is ``$RAGLINE_HOME/prefect/prefect.db`` (default ``~/.ragline/prefect``), kept
  between runs; ``dashboard_command()`` is the ``prefect server start`` line that shows that history;
- it points this process's Prefect client at the server (settings context, process-global
  settings context and ``os.environ``, so threads and child processes agree) and, on exit, drains
  Prefect's log and event workers, then stops the server (SIGTERM, wait, SIGKILL).

One server per ragline process, never shared: a server that outlived the command that started it
(to be reused by the next) is exactly the orphan this module exists to prevent, and start-up is
5-12 s on this 2-core machine (about 20 s for the very first start, which creates the database).

``interrupt_guard()`` bounds Ctrl-C: the first SIGINT raises KeyboardInterrupt as usual, and if
the process has not ended ``INTERRUPT_GRACE`` seconds later (a task thread inside an embedding
batch, which Prefect's task runner joins) it exits 130 at once. SIGTERM is handled alike (``terminated``,
exit 143). The CLI::

    with prefect_server.interrupt_guard():                  # main thread, outermost
        try:
            with prefect_server.local_api() if orchestrated else contextlib.nullcontext():
                return args.handler(args)
        except KeyboardInterrupt:
            return prefect_server.interrupted_exit()        # prints "interrupted" once, returns 130

Run ``python -m ragline.flows.ops.prefect_server`` to start one in the foreground (prints its URL).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from ragline.flows import settings
from ragline.flows.errors import DependencyUnavailable
from ragline.flows.ops.parent_death import PRELUDE

DEFAULT_STARTUP_TIMEOUT = 180.0  # seconds; a loaded 2-core machine needs far more than Prefect's 20
STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL
DRAIN_TIMEOUT = 5.0  # seconds to flush Prefect's queued logs and events before the server stops
LOG_LIMIT = 5_000_000  # bytes of server.log before it is rotated

# The server process: arm the parent-death signal, close the fork/prctl race, watch the parent's
# pid, then serve Prefect's app on the inherited, already bound socket (no port race).
_CHILD = PRELUDE + r"""
import socket, threading, time
parent, fd = int(sys.argv[1]), int(sys.argv[2])
_arm_parent_death(parent, sys.argv[3] == "1")

def watchdog():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)

threading.Thread(target=watchdog, name="ragline-parent-watchdog", daemon=True).start()
import uvicorn
config = uvicorn.Config("prefect.server.api.server:create_app", factory=True, log_level="error",
                        lifespan="on", timeout_graceful_shutdown=3)
uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd)])
"""


class ServerStartError(DependencyUnavailable):
    """The local Prefect server did not become healthy."""

    error_code = "prefect_unavailable"
    dependency = "prefect"


def ragline_home() -> Path:
    return Path(settings.get("home")).expanduser()


def prefect_home() -> Path:
    """Folder of the local server's database and log."""
    return ragline_home() / "prefect"


def database_url(home: Path | None = None) -> str:
    return f"sqlite+aiosqlite:///{(home or prefect_home()) / 'prefect.db'}"


def dashboard_command(home: Path | None = None) -> str:
    """The shell command that opens the dashboard on the history ragline's runs left."""
    return f"PREFECT_SERVER_DATABASE_CONNECTION_URL={database_url(home)} prefect server start --analytics-off"


def configured_api_url() -> str | None:
    """The API URL the user configured (environment or active Prefect profile), or None."""
    if os.environ.get("PREFECT_API_URL", "").strip():
        return os.environ["PREFECT_API_URL"].strip()
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def startup_timeout() -> float:
    value = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "")
    try:
        return max(float(value), 1.0) if value.strip() else DEFAULT_STARTUP_TIMEOUT
    except ValueError:
        return DEFAULT_STARTUP_TIMEOUT


class LocalPrefectServer:
    """One uvicorn process serving Prefect's API on 127.0.0.1, owned by this process."""

    def __init__(self, home: Path | None = None, database: str | None = None):
        """``database``, when given, wins over a configured one (a test's own server beside the
        session's test harness, whose settings name the harness's database)."""
        self.home = Path(home) if home is not None else prefect_home()
        self.database = database
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path = self.home / "server.log"
        self.seconds_to_start: float | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        try:  # settings changed in code (temporary_settings) reach the server, as Prefect does it
            from prefect.settings import get_current_settings

            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        except Exception:
            pass
        for key in ("PREFECT_API_URL", "PREFECT_API_KEY"):
            env.pop(key, None)
        if not any(env.get(k) for k in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")):
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url(self.home)
        if self.database:
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database
        env.update({
            "PREFECT_UI_ENABLED": "0",          # as Prefect's ephemeral server: API only,
            "PREFECT__SERVER_EPHEMERAL": "1",   # only the services an ephemeral server runs
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start(self, timeout: float | None = None) -> str:
        """Start the server and wait until ``/api/health`` answers; returns the API URL."""
        if self.process is not None:
            return self.api_url
        timeout = startup_timeout() if timeout is None else timeout
        started = time.monotonic()
        self.home.mkdir(parents=True, exist_ok=True)
        # One start at a time per database: concurrent first starts would race on migrations.
        with _file_lock(self.home / "start.lock", timeout):
            with contextlib.suppress(OSError):  # keep one previous log, not an ever-growing one
                if self.log_path.stat().st_size > LOG_LIMIT:
                    self.log_path.replace(self.log_path.with_suffix(".log.1"))
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", 0))
                self.port = sock.getsockname()[1]
                with open(self.log_path, "ab") as log:
                    log.write(f"--- ragline pid {os.getpid()}: server on port {self.port} at "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
                    log.flush()
                    offset = log.tell()
                    self.process = subprocess.Popen(
                        [sys.executable, "-c", _CHILD, str(os.getpid()), str(sock.fileno()),
                         "1" if threading.current_thread() is threading.main_thread() else "0"],
                        env=self._environment(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                        pass_fds=(sock.fileno(),), start_new_session=True, close_fds=True)
            finally:
                sock.close()
            try:
                self._wait_healthy(started + timeout, offset)
            except BaseException:
                self.stop()
                raise
        self.seconds_to_start = time.monotonic() - started
        return self.api_url

    def _wait_healthy(self, deadline: float, log_offset: int) -> None:
        import httpx

        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(f"the local Prefect server exited with code {code} while starting: "
                                           f"{self._log_tail(log_offset)}")
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"the local Prefect server did not answer on {self.api_url} in time "
                        f"(raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set PREFECT_API_URL "
                        f"to a running server): {self._log_tail(log_offset)}")
                time.sleep(0.2)

    def _log_tail(self, offset: int, limit: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode("utf-8", "replace").strip()
        except OSError:
            return f"see {self.log_path}"
        return (text[-limit:] if text else "no output") + f" (log: {self.log_path})"

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    deadline = time.monotonic() + timeout
    with open(path, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerStartError(f"another ragline process held {path} too long") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- process-wide state
_server: LocalPrefectServer | None = None
_restore: contextlib.ExitStack | None = None
_lock = threading.RLock()
_atexit_registered = False


def active_server() -> LocalPrefectServer | None:
    """The server this process started (None when none runs or an API is configured)."""
    return _server


def ensure_local_api(timeout: float | None = None) -> str:
    """Make sure this process's Prefect client has an API: the configured one, or ragline's local
    server (started once per process, stopped by ``shutdown_local_api()`` or at exit). Returns
    the API URL. Call it outside any ``temporary_settings`` block."""
    global _server, _restore, _atexit_registered
    with _lock:
        if _server is not None:
            return _server.api_url
        configured = configured_api_url()
        if configured:
            return configured
        server = LocalPrefectServer()
        server.start(timeout)
        stack = contextlib.ExitStack()
        try:
            _point_prefect_at(server.api_url, stack)
        except BaseException:
            stack.close()
            server.stop()
            raise
        _server, _restore = server, stack
        if not _atexit_registered:  # after Prefect's own hooks are registered: runs before them
            atexit.register(shutdown_local_api)
            _atexit_registered = True
        return server.api_url


def shutdown_local_api() -> None:
    """Flush Prefect's queued logs and events to the local server, restore the settings and stop
    the server. Does nothing when this process did not start one."""
    global _server, _restore
    with _lock:
        server, restore = _server, _restore
        _server = _restore = None
        if server is None:
            return
        try:
            _drain_prefect_workers(DRAIN_TIMEOUT)
        finally:
            try:
                if restore is not None:
                    with contextlib.suppress(Exception):  # e.g. called from another thread's context
                        restore.close()
            finally:
                server.stop()


@contextlib.contextmanager
def local_api(timeout: float | None = None) -> Iterator[str]:
    """Run the body with a Prefect API (see the module docstring); yields its URL. The server, if
    this block started one, is stopped on exit (also on KeyboardInterrupt)."""
    started_here = _server is None
    try:
        url = ensure_local_api(timeout)
        yield url
    finally:
        if started_here:
            shutdown_local_api()


def _point_prefect_at(url: str, stack: contextlib.ExitStack) -> None:
    """Make every reader of Prefect's settings see ``url``: this context (temporary_settings), the
    process-global settings context (threads started without a copied context, e.g. Prefect's
    event and log workers) and os.environ (child processes, fresh ``Settings()``)."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url

    def restore_environ() -> None:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous

    stack.callback(restore_environ)
    stack.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))
    global_context = prefect.context.GLOBAL_SETTINGS_CONTEXT
    prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.get_settings_context()

    def restore_global() -> None:
        prefect.context.GLOBAL_SETTINGS_CONTEXT = global_context

    stack.callback(restore_global)


def _drain_prefect_workers(timeout: float) -> None:
    """Send what Prefect's log and event workers still hold while the server is up (otherwise
    their at-exit flush retries against a stopped server)."""
    if "prefect" not in sys.modules:
        return
    try:
        from prefect._internal.concurrency.services import QueueService
    except Exception:
        return
    import logging

    # Each worker warns "Still processing items" while it drains a non-empty queue: expected here.
    quiet = [logging.getLogger(name) for name in ("EventsWorker", "APILogWorker")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.suppress(Exception):
            QueueService.drain_all(timeout=timeout, at_exit=False)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


# ----------------------------------------------------------------------------- Ctrl-C
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what shells report for a job stopped by Ctrl-C
TERMINATED_EXIT = 143  # 128 + SIGTERM (kill, systemd stop, docker stop): handled like Ctrl-C
INTERRUPT_GRACE = 5.0  # seconds a Ctrl-C'd process may take to unwind before it is ended at once

_interrupt_lock = threading.Lock()
_interrupt_reported = False
_interrupt_signal = signal.SIGINT  # the signal that interrupted this process (SIGTERM: "terminated", 143)


def interrupted_exit(message: str | None = None) -> int:
    """Print ``message`` (default ``interrupted``, or ``terminated`` after SIGTERM) to stderr once per
    process and return 130 (143 after SIGTERM): the CLI's ``except KeyboardInterrupt`` clause returns this."""
    global _interrupt_reported
    terminated = _interrupt_signal == signal.SIGTERM
    with _interrupt_lock:
        first, _interrupt_reported = not _interrupt_reported, True
    if first:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        _write_stderr(message or ("terminated" if terminated else "interrupted"))
    return TERMINATED_EXIT if terminated else INTERRUPTED_EXIT


def _write_stderr(message: str) -> None:
    prefix = "\r\x1b[K" if _isatty(2) else ""  # over a progress bar's half-drawn line
    with contextlib.suppress(OSError):
        os.write(2, f"{prefix}{message}\n".encode())


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


@contextlib.contextmanager
def interrupt_guard(grace_seconds: float = INTERRUPT_GRACE, quiet: bool = True) -> Iterator[None]:
    """Make Ctrl-C end the process within ``grace_seconds``, whatever it is doing.

    The first SIGINT raises KeyboardInterrupt as usual (the flow run reports itself Crashed to the
    still running local server, the CLI prints ``interrupted`` via ``interrupted_exit()``) and, with
    ``quiet``, silences logging so Prefect's crash reports do not follow that line. A step that cannot
    be interrupted (a task thread inside a torch batch: Prefect's ThreadPoolTaskRunner joins its
    worker threads on exit) would hold the process for as long as the batch takes, so if the process
    still runs ``grace_seconds`` later, or at a second Ctrl-C, it reports the flow run Crashed
    (best effort), prints ``interrupted``, stops the local server and exits 130 at once
    (``os._exit``: for the indexes this is a kill -9, which ingestion is built to survive).

    SIGTERM is handled the same way (it prints ``terminated`` and exits 143).

    Enter it in the main thread (elsewhere it does nothing), outside ``local_api()``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    armed = threading.Event()
    run_ids: list[object] = []

    def on_sigint(signum, frame):
        global _interrupt_signal
        if armed.is_set():  # second Ctrl-C: no more waiting
            _hard_exit(run_ids)
        armed.set()
        _interrupt_signal = signum
        if quiet:
            import logging

            logging.disable(logging.CRITICAL)
        run_id = _current_flow_run_id()
        if run_id is not None:
            run_ids.append(run_id)
        threading.Thread(target=_deadline, args=(grace_seconds, run_ids), name="ragline-interrupt-deadline",
                         daemon=True).start()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_term = signal.signal(signal.SIGTERM, on_sigint)
    try:
        yield
    finally:
        # Once interrupted the deadline stays armed until the process ends: interpreter shutdown
        # joins non-daemon threads (task workers) too.
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous_term if previous_term is not None else signal.SIG_DFL)


def _current_flow_run_id():
    if "prefect.context" not in sys.modules:
        return None
    with contextlib.suppress(Exception):
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is not None and context.flow_run is not None:
            return context.flow_run.id
    return None


def _deadline(grace_seconds: float, run_ids: list[object]) -> None:
    time.sleep(grace_seconds)
    _hard_exit(run_ids)


def _hard_exit(run_ids: list[object]) -> None:
    """Report the interrupted flow run, stop the local server, exit 130 (143 after SIGTERM) now."""
    server = _server
    if run_ids and server is not None:
        reporter = threading.Thread(target=_report_crashed, args=(list(run_ids),), daemon=True)
        reporter.start()
        reporter.join(2.0)
    code = interrupted_exit()
    if server is not None:
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)
    os._exit(code)


def _report_crashed(run_ids: list[object]) -> None:
    with contextlib.suppress(Exception):
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        with get_client(sync_client=True) as client:
            for run_id in run_ids:
                state = client.read_flow_run(run_id).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(run_id, Crashed(message="Execution was aborted by an interrupt signal."),
                                              force=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m ragline.flows.ops.prefect_server``: run a local server in the foreground until Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # stop the server on the way out
    server = LocalPrefectServer()
    try:
        server.start()
        print(f"PREFECT_API_URL={server.api_url} (pid {server.pid}, started in {server.seconds_to_start:.1f} s)",
              flush=True)
        while server.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
