"""Start and stop a real vLLM OpenAI-compatible server for tests (HTTP only: vLLM lives in its own
venv, .venv-vllm/, because its pins differ from ragline's).

    server = start_vllm()          # runs deploy/vllm/setup.sh if needed, then deploy/vllm/serve.sh
    OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(model=server.model, ...)
    server.stop()

Set RAGLINE_LLM_BASE_URL=http://HOST:PORT/v1 to use a server that is already running (e.g. a GPU
box running `vllm serve MODEL`); nothing is started or stopped then. RAGLINE_LLM_MODEL names its
model (default: the first one it lists). RAGLINE_VLLM_AUTO_SETUP=0 turns the automatic install off.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "deploy" / "vllm" / "setup.sh"
SERVE = REPO / "deploy" / "vllm" / "serve.sh"
LOGS = REPO / ".ragline" / "logs"
MODEL_NAME = "smollm2"


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
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        # Also after a clean exit: an engine worker could outlive the API server.
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        # Killed workers linger briefly as zombies until init reaps them; wait so that "nothing
        # left running" holds when stop() returns.
        for _ in range(50):
            if not _signal_group(proc, 0):
                break
            time.sleep(0.1)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_vllm(port: int | None = None, timeout: float = 600) -> VllmServer:
    """Start deploy/vllm/serve.sh on a free port and wait until it answers; or use RAGLINE_LLM_BASE_URL."""
    external = os.environ.get("RAGLINE_LLM_BASE_URL")
    if external:
        return _external(external.rstrip("/"), timeout)

    _ensure_installed()
    port = port or _free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"vllm-{port}.log"
    env = {**os.environ, "VLLM_PORT": str(port)}
    with open(log_path, "wb") as log:
        # New session = new process group, so stop() reaches the engine workers too and a Ctrl-C
        # in the terminal does not hit the server before the test's own teardown does.
        proc = subprocess.Popen(["bash", str(SERVE)], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}/v1", MODEL_NAME, log_path, proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {proc.returncode} before it was "
                                   f"ready; log {log_path}:\n{_tail(log_path)}")
            if _ready(server.base_url, MODEL_NAME):
                return server
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server not ready after {timeout:.0f} s; log {log_path}:\n"
                                   f"{_tail(log_path)}")
            time.sleep(1.0)
    except BaseException:
        server.stop()
        raise


def _ensure_installed() -> None:
    """Run the (idempotent, stamp-guarded) setup script: ~3 min the first time, instant after."""
    if os.environ.get("RAGLINE_VLLM_AUTO_SETUP", "1") == "0":
        if not (REPO / ".venv-vllm" / "bin" / "python").exists():
            raise RuntimeError(f"vLLM is not installed: run `bash {SETUP.relative_to(REPO)}` "
                               "(or set RAGLINE_LLM_BASE_URL to a running server)")
        return
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / "vllm-setup.log"
    with open(log_path, "wb") as log:
        code = subprocess.call(["bash", str(SETUP)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"`bash {SETUP.relative_to(REPO)}` failed ({code}); log {log_path}:\n"
                           f"{_tail(log_path)}")


def _external(base_url: str, timeout: float) -> VllmServer:
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    deadline = time.monotonic() + timeout
    while True:
        try:
            models = _get_json(base_url + "/models")["data"]
            break
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RAGLINE_LLM_BASE_URL={base_url}: no /models answer") from None
            time.sleep(2.0)
    model = os.environ.get("RAGLINE_LLM_MODEL") or models[0]["id"]
    return VllmServer(base_url, model)


def _ready(base_url: str, model: str) -> bool:
    try:
        root = base_url[: -len("/v1")]
        with urllib.request.urlopen(root + "/health", timeout=5) as resp:
            if resp.status != 200:
                return False
        return any(m["id"] == model for m in _get_json(base_url + "/models")["data"])
    except (OSError, ValueError, KeyError):  # URLError, refused, reset, half-started server
        return False


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Signal the server's process group; False when no process of it is left."""
    try:
        os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session
        return True
    except ProcessLookupError:
        return False


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
