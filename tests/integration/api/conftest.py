"""Session fixtures of the HTTP API tests in this folder: one indexed project, one scripted LLM and
one served app for all of them."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import TOKEN, Script, running, without_prefect, write_project
from tests.helpers.data import scifact_records, write_jsonl
from tests.scripted_llm import ScriptedLLM


@pytest.fixture(scope="session")
def script() -> Script:
    return Script()


@pytest.fixture(scope="session")
def scripted_llm(script) -> Iterator[ScriptedLLM]:
    with ScriptedLLM(script, chunk_delay=0.002) as llm:
        yield llm


@pytest.fixture(scope="session")
def api_project(tmp_path_factory, scripted_llm) -> Path:
    """A small SciFact corpus, indexed once for every API test."""
    folder = tmp_path_factory.mktemp("api")
    write_jsonl(folder / "docs" / "corpus.jsonl", scifact_records(24))
    path = write_project(folder, scripted_llm.base_url)
    report = engine.run(load_project(path).pipeline("index"), orchestrate=False)
    assert report.added == 24
    return path


@pytest.fixture(scope="session")
def served(api_project) -> Iterator[str]:
    from ragline.flows.serve.app import create_app

    with without_prefect():  # its health check says "not_configured" whatever ran before on the worker
        app = create_app(str(api_project), token=TOKEN)
    with running(app) as url:
        yield url


@pytest.fixture(scope="session")
def down_project(api_project) -> Iterator[Path]:
    """The same indexes, with the LLM at a closed port: bound, never listening, for the whole
    session, so no server another test starts can take the port (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
        yield write_project(api_project.parent, f"http://127.0.0.1:{closed}/v1", name="down.yaml")


@pytest.fixture
def fresh_script(script):
    saved = script.answer, script.verdict
    yield script
    script.answer, script.verdict = saved
