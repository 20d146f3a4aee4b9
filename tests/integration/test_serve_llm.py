"""Issue 15.3: the packaged LLM that `ragline serve` starts is supervised. A real serve process
against a real Prefect server; deploy/vllm/ is tests/fake_vllm.py (a real child that serves like
vLLM, with an "engine" process in its group that ignores SIGTERM, as vLLM's EngineCore does)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ragline.flows.ops.llm_server import free_port, port_free
from tests.fake_vllm import fake_deploy
from tests.helpers.api_harness import write_project
from tests.integration.serving import AUTH, TOKEN, _stop

pytestmark = pytest.mark.integration

SERVE = ("import sys; from ragline.flows.serve.supervise.service import serve; "
         "sys.exit(serve(sys.argv[1], port=int(sys.argv[2]), token=sys.argv[3], start_llm=True))")


def _until(check, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_restarts_a_killed_llm_ends_its_group_and_says_why_in_readyz(prefect_api, tmp_path):
    deploy = fake_deploy(tmp_path / "stand-in", engine=True)
    llm_port, api_port = free_port(), free_port()
    project = write_project(tmp_path / "p", f"http://127.0.0.1:{llm_port}/v1")
    log = tmp_path / "serve.log"
    env = dict(os.environ, PREFECT_API_URL=prefect_api, RAGLINE_VLLM_DEPLOY=str(deploy), PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(tmp_path / "prefect-client"))
    env.pop("RAGLINE_START_LLM", None)
    with open(log, "ab") as out:
        serve = subprocess.Popen([sys.executable, "-c", SERVE, str(project), str(api_port), TOKEN], cwd=project.parent,
                                 env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{api_port}"

    def llm_check() -> dict:
        return httpx.get(f"{url}/readyz", headers=AUTH, timeout=30).json()["checks"]["llm"]

    def ready_pid(after: int = 0) -> int | None:
        if serve.poll() is not None:
            raise AssertionError(f"serve exited with {serve.returncode}: {log.read_text(errors='replace')[-2000:]}")
        pids = [int(pid) for pid in re.findall(r"LLM ready in \d+ s \(pid (\d+),", log.read_text(errors="replace"))]
        return pids[-1] if len(pids) > after else None

    try:
        first = _until(ready_pid, 180, "the packaged LLM started by serve", every=0.3)
        engine = int((deploy / "engine.pid").read_text())
        assert llm_check()["status"] == "up"
        server = next(child.pid for child in psutil.Process(first).children()  # vLLM's API server
                      if "fake_vllm" in " ".join(child.cmdline()))
        os.kill(server, signal.SIGKILL)
        # Down with the reason once the supervisor reaps it; until then the port is merely refused (a loaded
        # machine can show that in between: CI saw one such poll), which is down too, without the reason yet.
        reason = f"pid {first}) exited with signal SIGKILL"
        down = _until(lambda: (c := llm_check())["status"] == "down" and reason in c["error"] and c, 30,
                      "/readyz saw it down and said why")
        down = _until(lambda: (c := llm_check())["detail"].get("managed") == "restarting" and c, 30, "restarting")
        assert f"pid {first}) exited with signal SIGKILL" in down["error"] and "restart 1 of 5" in down["error"]
        _until(lambda: _gone(engine), 20, "its engine process (ignores SIGTERM) ended with it")
        second = _until(lambda: ready_pid(after=1), 60, "the restart", every=0.3)
        assert second != first and llm_check()["status"] == "up"
        assert "exited with signal SIGKILL" in log.read_text()
        second_engine = int((deploy / "engine.pid").read_text())
    finally:
        _stop(serve)
    assert serve.returncode == 0
    assert _gone(second) and _gone(second_engine) and port_free(llm_port)
