"""Unit tests of flows/serve/supervise/service.py that need no Prefect server (tests/integration/test_serve.py has one)."""
from __future__ import annotations

import http.server
import os
import re
import socket
import time
from urllib.parse import urlsplit

import pytest

from ragline.flows.ops import llm_server
from ragline.flows.cli import main
from ragline.flows.ops.llm_server import free_port
from ragline.flows.serve.supervise.service import ServeError, _check_api, prune_results
from tests.fake_vllm import REPO, fake_deploy
from tests.helpers.api_harness import write_project
from tests.helpers.net import closed_port, serve_in_thread


def test_old_results_are_pruned_and_recent_ones_kept(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    now = time.time()
    for name, age_days in (("old.json", 31), ("older.json", 400), ("recent.json", 29), ("new.json", 0)):
        path = folder / name
        path.write_text("{}")
        os.utime(path, (now - age_days * 86400, now - age_days * 86400))
    (folder / "sub").mkdir()  # not a result file: left alone
    assert prune_results(folder, 30, now=now) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["new.json", "recent.json", "sub"]
    assert prune_results(folder, None, now=now + 1e9) == 0  # keep all
    assert prune_results(tmp_path / "absent", 30) == 0


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_keep_results_days_must_be_a_number_of_days(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--keep-results-days", value])
    assert exited.value.code == 2 and "--keep-results-days" in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 15.2: checks before children
@pytest.fixture
def llm_project(tmp_path, monkeypatch):
    """A project whose LLM endpoint is local, down and the packaged model (so serve would start it),
    with deploy/vllm/ a stand-in whose every start leaves a log in ``logs``."""
    monkeypatch.setenv("RAGLINE_VLLM_DEPLOY", str(fake_deploy(tmp_path)))
    monkeypatch.setattr(llm_server, "logs_dir", lambda: tmp_path / "logs")
    monkeypatch.delenv("RAGLINE_START_LLM", raising=False)
    llm_port = free_port()
    project = write_project(tmp_path / "p", f"http://127.0.0.1:{llm_port}/v1")
    return project, llm_port, tmp_path / "logs"


def _serve(project, *args) -> int:
    return main(["serve", "-f", str(project), "--start-prefect", *args])


def _nothing_started(logs, err: str) -> bool:
    return not list(logs.glob("vllm-*.log")) and "starting a local Prefect server" not in err


def test_an_open_host_without_a_token_is_refused_before_the_llm_starts(llm_project, capsys, monkeypatch):
    project, _, logs = llm_project
    monkeypatch.delenv("RAGLINE_API_TOKEN", raising=False)
    code = _serve(project, "--host", "0.0.0.0", "--port", str(free_port()))
    err = capsys.readouterr().err
    assert code == 2 and "needs a token" in err
    assert _nothing_started(logs, err)


def test_the_api_on_the_llm_endpoints_port_is_refused_before_anything_starts(llm_project, capsys):
    project, llm_port, logs = llm_project
    code = _serve(project, "--port", str(llm_port))
    err = capsys.readouterr().err
    assert code == 2 and f"the API's port {llm_port} is the LLM endpoint's" in err and "default is 8080" in err
    assert _nothing_started(logs, err)


@pytest.mark.integration  # `ragline serve` checks a managed LLM's port and the API's
def test_every_problem_is_reported_at_once_in_one_line(llm_project, capsys, monkeypatch):
    project, llm_port, logs = llm_project
    monkeypatch.delenv("RAGLINE_API_TOKEN", raising=False)
    with socket.socket() as api_port, socket.socket() as busy:  # a program (not an LLM) on each port
        api_port.bind(("0.0.0.0", 0))
        api_port.listen()
        busy.bind(("127.0.0.1", llm_port))
        busy.listen()
        code = _serve(project, "--host", "0.0.0.0", "--port", str(api_port.getsockname()[1]))
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert code == 2 and line.startswith("error: ")
    assert "needs a token" in line and "cannot listen on 0.0.0.0" in line
    assert f"its port {llm_port} is in use by another program" in line
    assert _nothing_started(logs, err)


@pytest.mark.parametrize("args, message", [(["--port", "0"], "a port number"), (["--port", "70000"], "a port number"),
                                           (["--poll-seconds", "0"], "above 0"), (["--limit", "-1"], "above 0")])
def test_numbers_are_checked_by_the_parser(args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RAGLINE_START_LLM", "0")  # (were a check missing: nothing to start, no file to serve)
    for command in (["serve"], ["api"]) if args[0] == "--port" else (["serve"],):
        with pytest.raises(SystemExit) as exited:
            main([*command, "-f", str(tmp_path / "absent.yaml"), *args])
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_api_and_the_llm_have_different_default_ports():
    from ragline.flows.cli import _parser
    from ragline.flows.resources.models.llm import LLMSpec

    llm_port = urlsplit(LLMSpec.model_fields["base_url"].default).port
    assert _parser().parse_args(["serve"]).port == _parser().parse_args(["api"]).port == 8080 != llm_port == 8000


def test_documented_examples_reach_the_api_on_its_port_not_the_llms():
    """README.md, docs/ and deploy/README.md: the API's examples use 8080; 8000 is the LLM's (and Chroma's)."""
    docs = sorted((REPO / "docs").glob("*.md"))
    assert docs, "docs/ has no pages"
    for doc in (REPO / "README.md", *docs, REPO / "deploy" / "README.md"):
        text = doc.read_text()
        for match in re.finditer(r"127\.0\.0\.1:(\d+)(/v1/(?:query|runs|ingest|chat)|/readyz|/healthz)", text):
            assert match.group(1) == "8080", f"{doc.name}: {match.group(0)}"
        for match in re.finditer(r"ragline (?:serve|api)\b[^\n]*--port (\d+)", text):
            assert match.group(1) != "8000", f"{doc.name}: {match.group(0)}"


# ----------------------------------------------------------------------------- issue 16.11: runs left behind
def test_a_recorded_flow_run_process_is_gone_only_when_it_is_on_this_host_and_not_running():
    import datetime
    import subprocess
    import sys

    from ragline.flows.serve.supervise.service import process_gone

    host = socket.gethostname()
    started = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    assert process_gone(f"{host}:{exited.pid}", started)
    assert not process_gone(f"{host}:{os.getpid()}", started)  # alive, and older than the run
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3650)
    assert process_gone(f"{host}:{os.getpid()}", long_ago)  # alive, but it started after the run: a reused pid
    assert not process_gone(f"elsewhere.example:{exited.pid}", started)  # another host: cannot tell
    assert not process_gone(None, started) and not process_gone(f"{host}:not-a-pid", started)


def test_the_audit_record_of_an_outcome_is_document_ids_without_access_keys():
    """Issue 19.4: a query's event names the documents returned, never text; a client never sees
    the access keys of a passage's metadata."""
    from ragline.flows.contracts import Answer, Passage, Source
    from ragline.flows.serve.query_service import Outcome

    passages = [Passage(chunk_id=f"c{i}", source_id=f"kb/doc{i % 2}", text="secret text",
                        metadata={"ragline_acl.hr": True, "ragline_acl_public": False, "year": 2020})
                for i in range(3)]
    ranked = Outcome("search", passages, {}, 1.0)
    assert ranked.returned_ids() == ["kb/doc0", "kb/doc1"]
    assert [p["metadata"] for p in ranked.to_json()["passages"]] == [{"year": 2020}] * 3
    from ragline.flows.contracts import Ranking
    rankings = Outcome("dense", [Ranking(retriever="dense", query="q", passages=passages)], {}, 1.0)
    assert rankings.returned_ids() == ["kb/doc0", "kb/doc1"]  # a lone retriever's rankings
    assert [p["metadata"] for p in rankings.to_json()["passages"][0]["passages"]] == [{"year": 2020}] * 3
    answer = Answer(question="q", text="t [1]", sources=[Source(number=1, chunk_id="c1", source_id="kb/doc1")])
    assert Outcome("ask", answer, {}, 1.0).returned_ids() == ["kb/doc1"]


def test_a_configured_apis_auth_string_reaches_the_flow_run_processes(monkeypatch):
    """Issue 39.1: a Prefect server the user runs with PREFECT_SERVER_API_AUTH_STRING is reached with
    the user's PREFECT_API_AUTH_STRING; pointing serve's clients at it keeps that for the flow-run
    processes (os.environ), and the secret of a server serve started wins for that one."""
    import contextlib
    import os

    from prefect.settings import PREFECT_API_AUTH_STRING

    from ragline.flows.serve.supervise.service import use_prefect_api

    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:the-users-own")
    with contextlib.ExitStack() as stack:
        use_prefect_api("http://127.0.0.1:4200/api", stack)
        assert os.environ["PREFECT_API_AUTH_STRING"] == "admin:the-users-own"
    with contextlib.ExitStack() as stack:
        use_prefect_api("http://127.0.0.1:4201/api", stack, "ragline:started-here")
        assert os.environ["PREFECT_API_AUTH_STRING"] == "ragline:started-here"
        assert PREFECT_API_AUTH_STRING.value() == "ragline:started-here"
    assert os.environ["PREFECT_API_AUTH_STRING"] == "admin:the-users-own"


# -- the Prefect API preflight: nothing listening fails fast, a busy server is waited for
class _SlowHealth(http.server.BaseHTTPRequestHandler):
    """/health that answers 200 only after the server has been up ``healthy_after`` seconds; before,
    it holds the request past the check's timeout (0.3 s here), as a server whose SQLite is busy does."""
    healthy_after = 0.0
    started = 0.0

    def do_GET(self):  # noqa: N802 (http.server's name)
        if time.monotonic() - self.started < self.healthy_after:
            time.sleep(1)
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


def _slow_prefect(healthy_after: float) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (_SlowHealth,), {"healthy_after": healthy_after, "started": time.monotonic()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    serve_in_thread(server)
    return server


def test_an_api_nothing_listens_on_is_refused_after_a_short_wait():
    url = f"http://127.0.0.1:{closed_port()}/api"  # "within 1 s": the busy wait (30 s) never began
    said: list[str] = []
    with pytest.raises(ServeError, match=r"does not answer within 1 s; is `prefect server start` running\?"):
        _check_api(url, said.append, absent_for=1, busy_for=30)
    assert said == []


def test_a_busy_api_is_waited_for_until_it_answers():
    server, said = _slow_prefect(healthy_after=1), []
    try:
        _check_api(f"http://127.0.0.1:{server.server_address[1]}/api", said.append, absent_for=0.2, busy_for=30,
                   request_timeout=0.3)
    finally:
        server.shutdown()
    assert len(said) == 1 and "is slow to answer; waiting up to 30 s" in said[0]


def test_an_api_that_never_answers_is_refused_after_the_busy_wait():
    server = _slow_prefect(healthy_after=3600)
    try:
        with pytest.raises(ServeError, match="within 1.5 s; it took the connection but gave no healthy answer"):
            _check_api(f"http://127.0.0.1:{server.server_address[1]}/api", lambda line: None, absent_for=0.2,
                       busy_for=1.5, request_timeout=0.3)
    finally:
        server.shutdown()
