"""A query process never writes a store's files (issue 40.3): every query path, each in a fresh
process (the way a terminal or a served API runs it), leaves every file of the index byte for
byte as it found it (sha256), and searches that run while ``ragline index`` writes the store from
another process neither fail nor damage it.

Embedded Chroma writes its folder whenever a process opens it, even to read (``read_snapshot``
says how); the tests that compared bytes inside one process, before the client closed, missed it."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_harness import Script, write_project
from tests.helpers.data import CHROMA_LINES, MILVUS_LINES, write_jsonl
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

RAGLINE = str(Path(sys.executable).with_name("ragline"))
ANIMALS = ["okapi", "giraffe", "zebra", "tortoise", "pangolin", "narwhal", "axolotl", "capybara"]
DEADLINE = 300


def records(animals: list[str], tag: str = "") -> list[dict]:
    return [{"_id": f"{a}{tag}", "title": f"The {a}{tag}",
             "text": f"The {a} is an animal. Field notes {tag} on where the {a} lives, what the {a} eats and "
                     f"how the {a} raises its young, written by a keeper who watched it for years."}
            for a in animals]


def fingerprint(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest): new, gone and changed files
    show. The managed servers' own logs (``logs/``) are not the store and are left out."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] != "logs"}


def ragline(project: Path, *args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
    """One ``ragline`` command in a fresh process, no Prefect."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([RAGLINE, *args, "-f", str(project)], cwd=project.parent, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"ragline {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def llm():
    with ScriptedLLM(Script()) as server:
        yield server


def indexed(folder: Path, llm_url: str, milvus: bool = False) -> Path:
    """A project over 8 short documents, indexed by a fresh ``ragline index``; its data in idx/."""
    write_jsonl(folder / "docs" / "corpus.jsonl", records(ANIMALS))
    project = write_project(folder, llm_url)
    if milvus:
        project.write_text(project.read_text().replace(CHROMA_LINES, MILVUS_LINES))
    ragline(project, "index", "--no-prefect")
    return project


@pytest.fixture(scope="module")
def project(tmp_path_factory, llm) -> Path:
    return indexed(tmp_path_factory.mktemp("readonly"), llm.base_url)


def assert_untouched(project: Path, command: list[str]) -> subprocess.CompletedProcess:
    data = project.parent / "idx"
    before = fingerprint(data)
    done = ragline(project, *command)
    assert fingerprint(data) == before, f"ragline {' '.join(command)} wrote the store's files"
    return done


@pytest.mark.parametrize("pipeline", ["search", "search_dense"])
def test_cli_search_writes_nothing(project, pipeline):
    if pipeline == "search_dense":  # dense alone: only Chroma opened
        text = project.read_text()
        if "search_dense:" not in text:
            project.write_text(text + "  search_dense:\n    kind: query\n    steps:\n"
                                      "      - {id: dense, task: retrieve_dense, with: {k: 5}}\n"
                                      "      - {id: fuse, task: fuse, with: {top_k: 5}}\n")
    for _ in range(2):  # the second run opens what the first one left
        done = assert_untouched(project, ["search", "where does the pangolin live", "-p", pipeline, "--json"])
        assert json.loads(done.stdout)[0]["title"] == "The pangolin"


def test_cli_ask_writes_nothing(project):
    done = assert_untouched(project, ["ask", "What does the okapi eat?", "--json", "--no-prefect", "--no-start-llm"])
    answer = json.loads(done.stdout)
    assert not answer["refused"] and answer["sources"], answer


def test_cli_eval_of_the_own_index_writes_nothing(project, tmp_path):
    """A feedback export (judged against the project's own index) runs every query on the store."""
    dataset = tmp_path / "feedback"
    write_jsonl(dataset / "queries.jsonl", [{"_id": "q1", "text": "where does the narwhal live"}])
    (dataset / "qrels").mkdir()
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tnarwhal\t1\n")
    (dataset / "feedback.json").write_text("{}")
    done = assert_untouched(project, ["eval", "--dataset", str(dataset), "--json", "--no-prefect"])
    assert json.loads(done.stdout)["queries"] == 1


def test_cli_check_writes_nothing(project):
    assert "ok" in assert_untouched(project, ["check"]).stdout


def test_milvus_lite_search_writes_nothing(tmp_path, llm):
    project = indexed(tmp_path, llm.base_url, milvus=True)
    for _ in range(2):
        done = assert_untouched(project, ["search", "where does the axolotl live", "--json"])
        assert json.loads(done.stdout)[0]["title"] == "The axolotl"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def api(project: Path):
    """``ragline api`` (uvicorn) in its own process, until ready; it owns the store through its
    managed Chroma server, so nothing else opens the folder meanwhile."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    port, log = free_port(), open(project.parent / "api.log", "wb")
    process = subprocess.Popen([RAGLINE, "api", "-f", str(project), "--port", str(port)], cwd=project.parent,
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            assert process.poll() is None and time.monotonic() < deadline, (project.parent / "api.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        log.close()


def test_api_and_openai_endpoint_write_nothing(project):
    data = project.parent / "idx"
    with api(project) as url:
        before = fingerprint(data)
        for _ in range(2):
            found = httpx.post(f"{url}/v1/query", json={"pipeline": "search", "question": "where does the zebra live"},
                               timeout=120)
            assert found.status_code == 200 and found.json()["passages"][0]["title"] == "The zebra", found.text
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "ask", "messages": [{"role": "user", "content": "What does the capybara eat?"}]})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
        assert fingerprint(data) == before, "the API's queries wrote the store's files"
    assert not (data / "chroma.server.json").exists()


def test_searches_while_an_index_run_writes(tmp_path, llm):
    """Fresh-process searches in a loop while ``ragline index`` adds documents from another process:
    none fails, and afterwards ``check`` is clean and both retrievers find a document of that run."""
    project = indexed(tmp_path, llm.base_url)
    write_jsonl(tmp_path / "docs" / "more.jsonl", [r for i in range(12) for r in records(ANIMALS, tag=f"-{i}")])
    project.write_text(project.read_text().replace("batch_size: 256", "batch_size: 8"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with open(tmp_path / "index.log", "wb") as log:
        writer = subprocess.Popen([RAGLINE, "index", "--no-prefect", "-f", str(project)], cwd=tmp_path, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        searches = 0
        while writer.poll() is None or searches < 2:
            done = ragline(project, "search", "where does the okapi live", "--json")
            assert json.loads(done.stdout), "a search during the index run found nothing"
            searches += 1
        assert writer.wait(DEADLINE) == 0, (tmp_path / "index.log").read_text()[-3000:]
    assert "ok" in ragline(project, "check").stdout
    for pipeline in ("search_dense", "search_bm25"):
        if f"{pipeline}:" not in project.read_text():
            retriever = "retrieve_dense" if pipeline == "search_dense" else "retrieve_sparse"
            project.write_text(project.read_text() + f"  {pipeline}:\n    kind: query\n    steps:\n"
                                                     f"      - {{id: r, task: {retriever}, with: {{k: 5}}}}\n"
                                                     f"      - {{id: fuse, task: fuse, with: {{top_k: 5}}}}\n")
        hits = json.loads(ragline(project, "search", "The axolotl-11", "-p", pipeline, "--json").stdout)
        assert any(h["source_id"].endswith("more.jsonl#axolotl-11") or h["title"] == "The axolotl-11"
                   for h in hits), (pipeline, [h["title"] for h in hits])
