"""When quickstart and serve start the packaged LLM, and when they leave the endpoint alone.

The start itself (setup.sh, serve.sh, waiting, stopping) is the same `start_vllm` that the session's
`vllm_server` fixture uses, so every LLM test exercises it on a real vLLM.
"""
from __future__ import annotations

import http.server
import threading

import pytest

from ragline.flows import llm_server
from ragline.flows.llm_server import local_llm
from tests.flows.resources.test_llm_faults import closed_port


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
    threading.Thread(target=server.serve_forever, daemon=True).start()
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
