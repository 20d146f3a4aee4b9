"""When quickstart and serve start the packaged LLM, and when they leave the endpoint alone.

The start itself (setup.sh, serve.sh, waiting, stopping) is the same `start_vllm` that the session's
`vllm_server` fixture uses, so every LLM test exercises it on a real vLLM.
"""
from __future__ import annotations

import contextlib
import http.server
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ragline.flows.ops import llm_server
from ragline.flows.ops.llm_server import ManagedLLM, free_port, local_llm
from tests.fake_vllm import REPO, fake_deploy
from tests.helpers.net import closed_port, serve_in_thread


@pytest.fixture
def healthy_url():
    """A real HTTP server answering /health, as a running vLLM does."""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    serve_in_thread(server)
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture
def starts(monkeypatch) -> list[int]:
    """Record start attempts instead of installing vLLM (the real start is covered by the fixture)."""
    calls: list[int] = []

    def start(port, say=None, **kwargs):
        calls.append(port)
        raise RuntimeError("not in this test")

    monkeypatch.setattr(llm_server, "start_vllm", start)
    monkeypatch.delenv("RAGLINE_START_LLM", raising=False)  # tests/conftest.py opts every test out; these test starting
    return calls


def test_a_local_endpoint_that_is_down_starts_the_packaged_model_on_its_port(starts):
    port = closed_port()
    said: list[str] = []
    with local_llm(f"http://127.0.0.1:{port}/v1", "smollm2", say=said.append) as server:
        assert server is None  # the start failed: reported, and the block still runs (search needs no LLM)
    assert starts == [port]
    assert "--no-start-llm" in said[0] and "could not start the packaged LLM: not in this test" in said[-1]


@pytest.mark.parametrize("case", ["remote", "running", "opted out", "env opt-out", "another model"])
def test_endpoints_that_are_not_ours_to_start_are_left_alone(case, starts, healthy_url, monkeypatch):
    url, model, enabled = f"http://127.0.0.1:{closed_port()}/v1", "smollm2", True
    if case == "remote":
        url = "http://llm.example.internal:8000/v1"
    elif case == "running":
        url = healthy_url
    elif case == "opted out":
        enabled = False
    elif case == "env opt-out":
        monkeypatch.setenv("RAGLINE_START_LLM", "0")
    said: list[str] = []
    if case == "another model":
        model = "qwen2.5-7b"
    with local_llm(url, model, enabled=enabled, say=said.append) as server:
        assert server is None
    assert starts == []
    assert (said == []) != (case == "another model")
    if case == "another model":
        assert "serves 'smollm2', not 'qwen2.5-7b'" in said[0]


def test_a_server_that_exits_while_starting_is_reported_with_its_log(tmp_path, monkeypatch):
    deploy = tmp_path / "deploy" / "vllm"
    deploy.mkdir(parents=True)
    (deploy / "setup.sh").write_text("exit 0\n")
    (deploy / "serve.sh").write_text("echo 'model file missing' >&2; exit 7\n")
    monkeypatch.setenv("RAGLINE_VLLM_DEPLOY", str(deploy))
    monkeypatch.setattr(llm_server, "logs_dir", lambda: tmp_path / "logs")
    with pytest.raises(RuntimeError, match=r"exited with code 7 while starting(.|\n)*model file missing"):
        llm_server.start_vllm(closed_port(), timeout=30)


# ----------------------------------------------------------------------------- a real child on a stand-in deploy
@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """deploy/vllm/ replaced by tests/fake_vllm.py: a real child process that serves like vLLM."""
    def make(**kwargs):
        deploy = fake_deploy(tmp_path, **kwargs)
        monkeypatch.setenv("RAGLINE_VLLM_DEPLOY", str(deploy))
        return deploy

    monkeypatch.setattr(llm_server, "logs_dir", lambda: tmp_path / "logs")
    return make


@pytest.fixture
def other_llm():
    """Another program's LLM server (e.g. another ragline service's): answers /health and lists smollm2."""
    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"data": [{"id": "smollm2"}]}' if self.path == "/v1/models" else b"{}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    serve_in_thread(server)
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _eventually(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


def _server_of(leader: int) -> int:
    """The server process (serve.sh exec'd into it) under the group leader that start_vllm runs."""
    import psutil

    return next(child.pid for child in psutil.Process(leader).children() if "fake_vllm" in " ".join(child.cmdline()))


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_port_another_server_holds_is_refused_not_taken_for_ours(stand_in, other_llm):
    """Issue 15.7: another service on the LLM's port answered the readiness check in place of ours."""
    deploy = stand_in()
    with pytest.raises(RuntimeError, match=f"port {other_llm} is in use by another program"):
        llm_server.start_vllm(other_llm, timeout=20)
    assert not (deploy.parents[1] / "logs" / f"vllm-{other_llm}.log").exists()  # serve.sh never ran


@pytest.mark.integration  # real child process groups, the production stop grace
def test_ready_means_our_child_answers_a_completion(stand_in):
    stand_in(before="export FAKE_VLLM_BROKEN=1\n")  # /health and /v1/models answer, completions fail
    with pytest.raises(TimeoutError, match="not ready after 3 s"):
        llm_server.start_vllm(free_port(), timeout=3)


def test_a_child_that_dies_while_starting_is_one_line_with_its_log(stand_in):
    stand_in(before="echo 'loading weights' >&2; echo 'CUDA out of memory' >&2; exit 7\n")
    with pytest.raises(RuntimeError) as failed:
        llm_server.start_vllm(free_port(), timeout=20)
    assert "\n" not in str(failed.value)
    assert "exited with code 7 while starting; last lines of" in str(failed.value)
    assert "loading weights | CUDA out of memory" in str(failed.value)


@pytest.mark.integration  # real child process groups, the production stop grace
def test_a_killed_managed_llm_is_reported_its_group_ended_and_restarted(stand_in):
    """Issue 15.3: SIGKILL of vLLM's API server left it dead, unreported, with its engine orphaned."""
    deploy = stand_in(engine=True)
    said: list[str] = []
    port = free_port()
    llm = ManagedLLM(f"http://127.0.0.1:{port}/v1", say=said.append, grace=1.0, delays=(0.5,)).start()
    try:
        _eventually(lambda: llm.state == "ready", what="first start")
        first, engine = llm.server.process.pid, int((deploy / "engine.pid").read_text())
        assert _alive(engine)
        os.kill(_server_of(first), signal.SIGKILL)  # vLLM's API server (its group's leader is ragline's)
        _eventually(lambda: llm.problem(), what="the death noticed")
        assert f"pid {first}) exited with signal SIGKILL" in llm.problem()
        assert "fake vLLM starting on port" in llm.problem()  # the log's last lines
        _eventually(lambda: any("exited with signal SIGKILL" in line and "restart 1 of 5" in line for line in said),
                    what="the death reported")
        _eventually(lambda: not _alive(engine), timeout=10, what="the orphaned engine (ignores SIGTERM) ended")
        _eventually(lambda: llm.state == "ready", what="the restart")
        assert llm.server.process.pid != first and llm.starts == 2
        assert llm_server.answers(llm.base_url, "smollm2")
        second_engine = int((deploy / "engine.pid").read_text())
    finally:
        llm.stop()
    assert not _alive(second_engine) and llm_server.port_free(port)
    assert llm_server.managed(llm.base_url) is None


def test_restarts_are_bounded(stand_in, tmp_path):
    counter = tmp_path / "starts"
    stand_in(before=f"echo start >> {counter}; echo 'no model file' >&2; exit 3\n")
    said: list[str] = []
    llm = ManagedLLM(f"http://127.0.0.1:{free_port()}/v1", say=said.append, delays=(0.1, 0.2), max_failures=2).start()
    try:
        _eventually(lambda: llm.state == "failed", what="giving up")
        assert "exited with code 3 while starting" in llm.problem() and "no model file" in llm.problem()
        assert "gave up after 2 restarts in a row" in llm.problem()
        time.sleep(0.5)
        assert counter.read_text().count("start") == 3  # the first start and 2 restarts, then no more
    finally:
        llm.stop()


@pytest.mark.integration  # real child process groups, the production stop grace
def test_a_server_restarted_by_hand_is_used_and_watched(stand_in):
    """Restarting vLLM by hand keeps working: the supervisor does not fight a server on its port."""
    stand_in()
    port = free_port()
    llm = ManagedLLM(f"http://127.0.0.1:{port}/v1", say=lambda line: None, grace=1.0, delays=(3.0,)).start()
    by_hand = None
    try:
        _eventually(lambda: llm.state == "ready", what="first start")
        os.kill(llm.server.process.pid, signal.SIGKILL)
        _eventually(lambda: llm.state == "restarting", what="the death noticed")
        _eventually(lambda: llm_server.port_free(port), what="the port released")
        by_hand = subprocess.Popen([sys.executable, "-m", "tests.fake_vllm", str(port), "smollm2"], cwd=REPO)
        _eventually(lambda: llm.state == "external", what="the hand-started server adopted")
        assert llm.problem() is None and llm.server is None
    finally:
        llm.stop()
        if by_hand is not None:
            by_hand.kill()
            by_hand.wait()


@pytest.mark.integration  # a managed LLM server process
def test_readyz_gives_the_reason_the_managed_llm_is_down(stand_in, tmp_path):
    from ragline.flows.serve.app import create_app
    from tests.helpers.api_harness import AUTH, TOKEN, running, write_project

    stand_in(before="echo 'model file missing' >&2; exit 7\n")
    url = f"http://127.0.0.1:{free_port()}/v1"
    project = write_project(tmp_path / "p", url)
    llm = ManagedLLM(url, say=lambda line: None, delays=(60.0,)).start()
    try:
        _eventually(lambda: llm.state == "restarting", what="the failed start")
        with running(create_app(str(project), token=TOKEN)) as served:
            check = httpx.get(f"{served}/readyz", headers=AUTH, timeout=30).json()["checks"]["llm"]
    finally:
        llm.stop()
    assert check["status"] == "down" and check["detail"]["managed"] == "restarting"
    assert "exited with code 7 while starting" in check["error"] and "model file missing" in check["error"]
    assert "restart 1 of 5 in 60 s" in check["error"]


OWNER = r"""
import os, sys, time
from pathlib import Path
from ragline.flows.ops import llm_server
llm_server.logs_dir = lambda: Path(sys.argv[2])
server = llm_server.start_vllm(int(sys.argv[1]), timeout=30)
print(server.process.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.integration  # real child process groups, the production stop grace
def test_a_killed_ragline_takes_the_llms_whole_group_along(stand_in, tmp_path):
    """kill -9 of the process that started the LLM: the parent-death signal reaches the server, and
    the rest of its group (an engine that ignores SIGTERM) is ended too, SIGKILL after the grace."""
    deploy = stand_in(engine=True)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(port), str(tmp_path / "logs")], env=env,
                             stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids.append(server := int(owner.stdout.readline()))
        pids.append(engine := int((deploy / "engine.pid").read_text()))
        assert _alive(server) and _alive(engine)
        owner.kill()
        owner.wait()
        _eventually(lambda: not _alive(server) and not _alive(engine), timeout=llm_server.STOP_GRACE + 10,
                    what="the server and its engine ended")
        assert llm_server.port_free(port)
    finally:
        owner.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
