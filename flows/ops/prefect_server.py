"""The local Prefect API that ragline starts when no ``PREFECT_API_URL`` is configured.

Prefect 3.8's own fallback (``SubprocessASGIServer``, started lazily by ``get_client()`` when the
active profile has ``PREFECT_SERVER_EPHEMERAL_ENABLED``) runs uvicorn as a plain child in the
terminal's process group and stops it only from an ``atexit`` hook. So Ctrl-C reaches the server
first (the flow run then retries its crash report against a dead API for minutes), and a
``kill -9`` of ragline leaves the server running for good. ``local_api()`` replaces it:

- it does nothing when an API is configured (``PREFECT_API_URL`` in the environment or the
  active Prefect profile): that server is the user's;
- otherwise it uses ragline's **shared** local server (``RAGLINE_PREFECT_IDLE_SECONDS`` > 0, the
  default 600): Prefect's API app (UI and most services off, as Prefect's ephemeral server) under
  uvicorn on a free loopback port, in **its own session** (the terminal's SIGINT does not reach it),
  started detached by the first command and recorded in ``server.json``; every command holds a
  shared lock on the ``lease`` file while it runs, and the server's watchdog thread stops it (and
  removes the record) once it can lock that file exclusively and the file is older than the idle
  timeout, and at once when the lease or the record is gone or unreadable (its folder deleted). A record whose server is gone, answers no more or serves another database is replaced
  under ``start.lock`` (which also makes two first commands start one server);
- with the idle timeout 0 each command starts a server of its own instead, with a **parent-death
  signal** (``PR_SET_PDEATHSIG``) and a watchdog thread that stops it once ragline's pid is gone
  (``kill -9`` included);
- the database is ``$RAGLINE_HOME/prefect/prefect.db`` (default ``~/.ragline/prefect``), kept
  between runs; ``dashboard_command()`` is the ``prefect server start`` line that shows that history;
- the server requires Prefect's own basic authentication (``PREFECT_SERVER_API_AUTH_STRING``): the
  secret is made on first start and kept, mode 0600, in ``api-auth`` beside the database
  (``auth_string()``), so only this user (and root) can reach the API; every client ragline points
  at it gets ``PREFECT_API_AUTH_STRING`` (settings context and ``os.environ``: runner, flow-run
  processes, the CLI, the HTTP API). ``GET /health`` stays open (Prefect's choice), nothing else;
- it points this process's Prefect client at the server (settings context, process-global
  settings context and ``os.environ``, so threads and child processes agree) and, on exit, drains
  Prefect's log and event workers, then stops its own server (SIGTERM, wait, SIGKILL) or releases
  its lease on the shared one.

Why shared: start-up is 5-12 s on this 2-core machine (45-65 s when it is loaded; about 20 s more
for the very first start, which creates the database), paid by every ``ragline index``. A shared
server is not an orphan: it ends itself when unused, and ``ragline prefect stop`` ends it at once.

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
import secrets
import stat
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from ragline.flows import settings
from ragline.flows.errors import DependencyUnavailable
from ragline.flows.files import write_atomic
from ragline.flows.ops.parent_death import PRELUDE

DEFAULT_STARTUP_TIMEOUT = 180.0  # seconds; a loaded 2-core machine needs far more than Prefect's 20
STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL
DRAIN_TIMEOUT = 5.0  # seconds to flush Prefect's queued logs and events before the server stops
LOG_LIMIT = 5_000_000  # bytes of server.log before it is rotated

# The server process. Owned by one command (no lease arguments): arm the parent-death signal, close
# the fork/prctl race, watch the parent's pid. Shared (a lease file, the record and the idle timeout):
# every few seconds try the lease exclusively; held (no command is running) and either untouched for
# the idle timeout or no longer the recorded server, remove the record (its own only) and stop; the
# lease or the record gone or unreadable (the folder deleted under it), stop at once. Then
# serve Prefect's app on the inherited, already bound socket (no port race).
_CHILD = PRELUDE + r"""
import json, socket, threading, time
parent, fd = int(sys.argv[1]), int(sys.argv[2])
shared = sys.argv[4:]  # ragline-local-prefect-server: [lease, record, idle seconds] when shared

def stop_now():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)

def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    stop_now()

def should_stop(lease, record, idle):
    # Stop when idle, no longer the recorded server, or when the lease or record is gone or
    # unreadable (the working folder deleted: nothing can lease this server any more).
    import fcntl
    try:
        handle = open(lease, "r+")  # never created here: a deleted folder is a reason to stop
    except OSError:
        return True
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a command is using the server
        try:
            with open(record) as recorded:
                mine = json.load(recorded).get("pid") == os.getpid()
        except (OSError, ValueError, AttributeError):
            return True
        if mine and time.time() - os.fstat(handle.fileno()).st_mtime < idle:
            return False
        if mine:
            try:
                os.unlink(record)  # under the lock: no command finds a server that is stopping
            except OSError:
                pass
        return True

def watch_lease(lease, record, idle):
    while True:
        time.sleep(min(2.0, max(idle / 4, 0.2)))
        try:
            stop = should_stop(lease, record, idle)
        except Exception:  # whatever cannot be read: the watchdog must never die and leave the server
            stop = True
        if stop:
            stop_now()

if shared:
    watchdog = threading.Thread(target=watch_lease, args=(shared[0], shared[1], float(shared[2])),
                                name="ragline-idle-watchdog", daemon=True)
else:
    _arm_parent_death(parent, sys.argv[3] == "1")
    watchdog = threading.Thread(target=watch_parent, name="ragline-parent-watchdog", daemon=True)
watchdog.start()
import uvicorn
config = uvicorn.Config("prefect.server.api.server:create_app", factory=True, log_level="error",
                        lifespan="on", timeout_graceful_shutdown=3)
uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd)])
"""
CHILD_MARK = "ragline-local-prefect-server"  # in the server's command line: a recorded pid is still ours


class ServerStartError(DependencyUnavailable):
    """The local Prefect server did not become healthy."""

    error_code = "prefect_unavailable"
    dependency = "prefect"


def ragline_home() -> Path:
    return Path(settings.prefect().home).expanduser()


def prefect_home() -> Path:
    """Folder of the local server's database and log."""
    return ragline_home() / "prefect"


def database_url(home: Path | None = None) -> str:
    return f"sqlite+aiosqlite:///{(home or prefect_home()) / 'prefect.db'}"


def dashboard_command(home: Path | None = None) -> str:
    """The shell command that opens the dashboard on the history ragline's runs left (with the same
    secret: the dashboard asks for it, ``auth_string_path``'s content)."""
    secret = auth_string_path(home)
    return (f"PREFECT_SERVER_DATABASE_CONNECTION_URL={database_url(home)} "
            f"PREFECT_SERVER_API_AUTH_STRING=\"$(cat {secret})\" prefect server start --analytics-off")


AUTH_FILE = "api-auth"  # the local server's basic-auth secret, beside its database, mode 0600


def auth_string_path(home: Path | None = None) -> Path:
    return (home or prefect_home()) / AUTH_FILE


def auth_string(home: Path | None = None) -> str:
    """The secret of the local server of ``home`` (``user:password``, as Prefect's basic auth takes
    it): made on first use, created 0600 (never readable by another user, even for a moment), and
    tightened to 0600 if someone widened it. Raises ServerStartError naming the file it cannot use."""
    path = auth_string_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path)
    except OSError as exc:
        raise ServerStartError(f"cannot create the Prefect API's secret {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(f"ragline:{secrets.token_urlsafe(32)}\n")
    return _read_secret(path)


def _read_secret(path: Path) -> str:
    try:
        with open(path) as handle:
            if stat.S_IMODE(os.fstat(handle.fileno()).st_mode) & 0o077:
                os.fchmod(handle.fileno(), 0o600)
            secret = handle.read().strip()
    except OSError as exc:
        raise ServerStartError(f"cannot read the Prefect API's secret {path}: {exc.strerror or exc}") from None
    if not secret:
        raise ServerStartError(f"the Prefect API's secret {path} is empty: delete it, and stop the server that "
                               f"uses it (`ragline prefect stop`); the next start makes a new one")
    return secret


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
    """One uvicorn process serving Prefect's API on 127.0.0.1, owned by this process, or with
    ``idle_seconds``, shared: detached from this process, it stops itself once no command has held
    the lease file of ``home`` for that long (see ``ensure_local_api``)."""

    def __init__(self, home: Path | None = None, database: str | None = None, idle_seconds: float | None = None,
                 auth: bool = True):
        """``database``, when given, wins over a configured one (a test's own server beside the
        session's test harness, whose settings name the harness's database). ``auth``: require the
        secret of ``home`` (``auth_string``); off only for a test harness's throwaway server."""
        self.home = Path(home) if home is not None else prefect_home()
        self.database = database
        self.auth = auth
        self.idle_seconds = idle_seconds
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

    @property
    def auth_string(self) -> str | None:
        """What a client sends (``PREFECT_API_AUTH_STRING``); None: the server takes anyone."""
        return auth_string(self.home) if self.auth else None

    def _environment(self, secret: bool = True) -> dict[str, str]:
        """The server's environment; ``secret``: with its auth string (off: only to read the rest)."""
        env = dict(os.environ)
        try:  # settings changed in code (temporary_settings) reach the server, as Prefect does it
            from prefect.settings import get_current_settings

            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
        except Exception:
            pass
        for key in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING"):
            env.pop(key, None)
        if self.auth and secret:
            env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string(self.home)
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

    def database_in_use(self) -> str:
        """The database URL the server is (or would be) started with."""
        env = self._environment(secret=False)
        return env.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or env.get("PREFECT_API_DATABASE_CONNECTION_URL", "")

    def start(self, timeout: float | None = None) -> str:
        """Start the server and wait until ``/api/health`` answers; returns the API URL."""
        if self.process is not None:
            return self.api_url
        timeout = startup_timeout() if timeout is None else timeout
        started = time.monotonic()
        self.home.mkdir(parents=True, exist_ok=True)
        # One start at a time per database: concurrent first starts would race on migrations.
        with _file_lock(self.home / "start.lock", timeout):
            self._start_locked(started + timeout)
        self.seconds_to_start = time.monotonic() - started
        return self.api_url

    def _start_locked(self, deadline: float) -> None:
        """Start the server and wait until it answers, holding the start lock."""
        shared = [] if self.idle_seconds is None else [str(self.home / LEASE), str(self.home / RECORD),
                                                         repr(float(self.idle_seconds))]
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
                     "1" if threading.current_thread() is threading.main_thread() else "0", *shared],
                    env=self._environment(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=(sock.fileno(),), start_new_session=True, close_fds=True,
                    cwd=self.home if shared else None)  # a shared server outlives the command's folder
        finally:
            sock.close()
        try:
            self._wait_healthy(deadline, offset)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, deadline: float, log_offset: int) -> None:
        import httpx

        with httpx.Client(trust_env=False, verify=False, timeout=5.0) as client:  # plain HTTP: no TLS context
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


# ----------------------------------------------------------------------------- the shared server
RECORD = "server.json"  # {url, pid, port, started, database} of the shared server, in prefect_home()
LEASE = "lease"  # every command using the shared server holds a shared lock on it and touches it
HEALTH_TIMEOUT = 10.0  # seconds for a recorded server's /health to answer (a loaded machine is slow)


class ServerRecord(BaseModel):
    """What server.json says about the shared server."""

    url: str
    pid: int
    port: int
    started: float  # time.time() of its start
    database: str
    auth: bool = False  # requires the secret of its home (a record without it: a server anyone can use, replaced)


def idle_seconds() -> float | None:
    """How long the shared server waits for the next command; None: no sharing (0, or not POSIX)."""
    seconds = float(settings.prefect().prefect_idle_seconds)
    return seconds if seconds > 0 and _fcntl() is not None else None


def read_record(home: Path | None = None) -> ServerRecord | None:
    """The shared server's record, or None when there is none (or it cannot be read)."""
    try:
        return ServerRecord.model_validate_json(((home or prefect_home()) / RECORD).read_bytes())
    except (OSError, ValueError):
        return None


def healthy_record(home: Path, database: str) -> ServerRecord | None:
    """The record, if its server still runs, is ragline's, serves ``database`` and answers."""
    record = read_record(home)
    if record is None or not record.auth or record.database != database or not _is_our_server(record.pid):
        return None
    import httpx

    try:
        # plain HTTP on loopback: no TLS context to build (its CA bundle costs 0.05-0.3 s per command)
        with httpx.Client(trust_env=False, verify=False, timeout=HEALTH_TIMEOUT) as client:
            return record if client.get(f"{record.url}/health").status_code == 200 else None
    except httpx.HTTPError:
        return None


def _is_our_server(pid: int) -> bool:
    """True while ``pid`` runs ragline's server script (not a zombie, not a reused pid)."""
    if Path("/proc/self/cmdline").exists():
        try:
            return CHILD_MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Lease:
    """A command's hold on the shared server: a shared lock on the lease file for the command's
    whole run (the server's watchdog stops only when it can lock the file exclusively), and the
    file's time touched at both ends (the idle timeout counts from the last command's end)."""

    def __init__(self, home: Path):
        self.path = home / LEASE
        self.handle = open(self.path, "a+")
        _fcntl().flock(self.handle, _fcntl().LOCK_SH)
        self.touch()

    def touch(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def release(self) -> None:
        self.touch()
        self.handle.close()


def _fcntl():
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    return fcntl


def _use_shared_server(idle: float, timeout: float | None) -> tuple[_Lease, str, str]:
    """Lease ragline's shared server of ``prefect_home()``, starting it if none answers; returns
    the lease, the API URL and the line that says which happened."""
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    lease = _Lease(home)  # first: a server found below cannot stop while this command runs
    try:
        server = LocalPrefectServer(home, idle_seconds=idle)
        database = server.database_in_use()
        record = healthy_record(home, database)
        if record is None:
            timeout = startup_timeout() if timeout is None else timeout
            started = time.monotonic()
            with _file_lock(home / "start.lock", timeout):
                record = healthy_record(home, database)  # a concurrent first command started it
                if record is None:
                    server._start_locked(started + timeout)
                    record = ServerRecord(url=server.api_url, pid=server.pid, port=server.port,
                                          started=time.time(), database=database, auth=True)
                    write_atomic(home / RECORD, record.model_dump_json())
                    _detached.append(server.process)  # it outlives this process: never stopped from here
                    return lease, record.url, (
                        f"Prefect API: started ragline's local server at {record.url} in "
                        f"{time.monotonic() - started:.1f} s; it stops after {_duration(idle)} unused "
                        f"(`ragline prefect stop` stops it now)")
        return lease, record.url, (f"Prefect API: reusing ragline's local server at {record.url} "
                                   f"(idle timeout {_duration(idle)})")
    except BaseException:
        lease.release()
        raise


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"


def stop_shared_server(home: Path | None = None) -> str:
    """``ragline prefect stop``: stop the shared server (SIGTERM, then SIGKILL) and remove its
    record; a command running on it loses its API. Returns what happened, in one line."""
    home = Path(home) if home is not None else prefect_home()
    if not home.is_dir():
        return "no local Prefect server is running"
    with _file_lock(home / "start.lock", startup_timeout()):  # not while one starts
        record = read_record(home)
        (home / RECORD).unlink(missing_ok=True)
        if record is None or not _is_our_server(record.pid):
            return "no local Prefect server is running"
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _is_our_server(record.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _is_our_server(record.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
    return f"stopped ragline's local Prefect server (pid {record.pid}, {record.url})"


def describe_shared_server(home: Path | None = None) -> str:
    """``ragline prefect status``: which Prefect API the next command uses, in one line."""
    configured = configured_api_url()
    if configured:
        return f"Prefect API: {configured} (configured: PREFECT_API_URL or the Prefect profile)"
    idle = idle_seconds()
    if idle is None:
        return "each command starts its own local Prefect server (RAGLINE_PREFECT_IDLE_SECONDS=0)"
    home = Path(home) if home is not None else prefect_home()
    record = healthy_record(home, LocalPrefectServer(home).database_in_use())
    if record is None:
        return f"no local Prefect server is running; the next flow run starts one (idle timeout {_duration(idle)})"
    up = int(time.time() - record.started) // 60
    return (f"ragline's local Prefect server: {record.url} (pid {record.pid}, up {up} min); it stops after "
            f"{_duration(idle)} unused (`ragline prefect stop` stops it now)")


# ----------------------------------------------------------------------------- process-wide state
_server: LocalPrefectServer | None = None  # the server this process owns (idle timeout 0)
_lease: _Lease | None = None  # this process's lease on the shared server
_api_url: str | None = None  # the local API this process's client points at
_restore: contextlib.ExitStack | None = None
_lock = threading.RLock()
_atexit_registered = False
_detached: list[subprocess.Popen] = []  # shared servers this process started (kept: no "still running" warning)


def active_server() -> LocalPrefectServer | None:
    """The server this process started and owns (None when none runs, it is shared or an API is configured)."""
    return _server


def ensure_local_api(timeout: float | None = None) -> str:
    """Make sure this process's Prefect client has an API: the configured one, or ragline's local
    server. With ``RAGLINE_PREFECT_IDLE_SECONDS`` > 0 that is the shared server (reused, or
    started detached and left running for the next command); with 0 a server of this process's own
    (stopped by ``shutdown_local_api()`` or at exit, and with this process, kill -9 included).
    Returns the API URL. Call it outside any ``temporary_settings`` block."""
    return _ensure(timeout)[0]


def _ensure(timeout: float | None) -> tuple[str, str | None]:
    """``ensure_local_api``, and the line that says which server is used (None: nothing to say)."""
    global _server, _lease, _api_url, _restore, _atexit_registered
    with _lock:
        if _api_url is not None:
            return _api_url, None
        configured = configured_api_url()
        if configured:
            return configured, None
        idle = idle_seconds()
        server = lease = line = None
        if idle is None:
            server = LocalPrefectServer()
            url = server.start(timeout)
        else:
            lease, url, line = _use_shared_server(idle, timeout)
        stack = contextlib.ExitStack()
        try:
            _point_prefect_at(url, stack, auth_string(server.home if server is not None else prefect_home()))
        except BaseException:
            stack.close()
            if server is not None:
                server.stop()
            if lease is not None:
                lease.release()
            raise
        _server, _lease, _api_url, _restore = server, lease, url, stack
        if not _atexit_registered:  # after Prefect's own hooks are registered: runs before them
            atexit.register(shutdown_local_api)
            _atexit_registered = True
        return url, line


def shutdown_local_api() -> None:
    """Flush Prefect's queued logs and events to the local server, restore the settings, then stop
    the server this process owns or release the lease on the shared one. Does nothing when this
    process uses no local server."""
    global _server, _lease, _api_url, _restore
    with _lock:
        server, lease, restore = _server, _lease, _restore
        _server = _lease = _api_url = _restore = None
        if server is None and lease is None:
            return
        try:
            _drain_prefect_workers(DRAIN_TIMEOUT)
        finally:
            try:
                if restore is not None:
                    with contextlib.suppress(Exception):  # e.g. called from another thread's context
                        restore.close()
            finally:
                if server is not None:
                    server.stop()
                if lease is not None:
                    lease.release()


@contextlib.contextmanager
def local_api(timeout: float | None = None, announce: bool = False) -> Iterator[str]:
    """Run the body with a Prefect API (see the module docstring); yields its URL. On exit the
    server this block started is stopped, or its lease on the shared one released (also on
    KeyboardInterrupt). ``announce``: print to stderr whether the shared server was started or reused."""
    started_here = _api_url is None
    try:
        url, line = _ensure(timeout)
        if announce and line:
            print(line, file=sys.stderr, flush=True)
        yield url
    finally:
        if started_here:
            shutdown_local_api()


def _point_prefect_at(url: str, stack: contextlib.ExitStack, auth: str | None = None) -> None:
    """Make every reader of Prefect's settings see ``url`` (and ``auth``, the server's secret, as
    ``PREFECT_API_AUTH_STRING``): this context (temporary_settings), the process-global settings
    context (threads started without a copied context, e.g. Prefect's event and log workers) and
    os.environ (child processes, fresh ``Settings()``)."""
    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    values = {"PREFECT_API_URL": url, **({"PREFECT_API_AUTH_STRING": auth} if auth else {})}  # else: the user's
    previous = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        _set_environ(name, value)
    stack.callback(lambda: [_set_environ(name, value) for name, value in previous.items()])
    updates = {PREFECT_API_URL: url, **({PREFECT_API_AUTH_STRING: auth} if auth else {})}
    stack.enter_context(temporary_settings(updates=updates))
    global_context = prefect.context.GLOBAL_SETTINGS_CONTEXT
    prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.get_settings_context()

    def restore_global() -> None:
        prefect.context.GLOBAL_SETTINGS_CONTEXT = global_context

    stack.callback(restore_global)


def _set_environ(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


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
            if _api_url is not None:
                _CrashReport.ready(run_ids)
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
    """Report the interrupted flow run, stop the server this process owns, exit 130 (143 after SIGTERM) now."""
    server = _server
    if run_ids and _api_url is not None:
        (_CrashReport.pending or _CrashReport.ready(run_ids)).send(2.0)
    code = interrupted_exit()
    if server is not None:
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)
    os._exit(code)


class _CrashReport:
    """The interrupted flow run's Crashed state, for when the process must end before Prefect's engine
    reports it. Readied at the interrupt: its thread imports Prefect's client and opens it while the
    run unwinds, so the report at the deadline is two requests (a CI run under load spent its whole
    2 s budget getting there, and the run stayed Running)."""

    pending: "_CrashReport | None" = None

    def __init__(self, run_ids: list[object]):
        self.run_ids, self.go, self.done = run_ids, threading.Event(), threading.Event()

    @classmethod
    def ready(cls, run_ids: list[object]) -> "_CrashReport":
        cls.pending = report = cls(run_ids)
        threading.Thread(target=report._run, name="ragline-crash-report", daemon=True).start()
        return report

    def send(self, wait_seconds: float) -> None:
        self.go.set()
        self.done.wait(wait_seconds)

    def _run(self) -> None:
        try:
            with contextlib.suppress(Exception):
                from prefect.client.orchestration import get_client
                from prefect.states import Crashed

                with get_client(sync_client=True) as client:
                    self.go.wait()  # only if the process is ended: Prefect's engine reports an orderly unwinding
                    for run_id in list(self.run_ids):
                        state = client.read_flow_run(run_id).state
                        if state is None or not state.is_final():
                            client.set_flow_run_state(
                                run_id, Crashed(message="Execution was aborted by an interrupt signal."), force=True)
        finally:
            self.done.set()


def main(argv: list[str] | None = None) -> int:
    """``python -m ragline.flows.ops.prefect_server``: run a local server in the foreground until Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # stop the server on the way out
    server = LocalPrefectServer()
    try:
        server.start()
        print(f"PREFECT_API_URL={server.api_url} (pid {server.pid}, started in {server.seconds_to_start:.1f} s); "
              f"its clients need PREFECT_API_AUTH_STRING=\"$(cat {auth_string_path(server.home)})\"", flush=True)
        while server.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
