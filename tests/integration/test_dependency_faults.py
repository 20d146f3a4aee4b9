"""Faults in what ragline depends on, provoked for real, end to end (issue 9, item 1): a Chroma
server stopped mid-query behind the HTTP API; the Prefect API on a closed port for queries (CLI in
process, HTTP API); the disk under the data folder full (a small tmpfs) or read-only (a read-only
bind mount) during ingestion. Store-level versions, without models: tests/flows/run/test_dependency_faults.py."""
from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ragline.flows.run import engine
from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from ragline.flows.resources.stores.state import StorageError
from tests.fault_mounts import fill, read_only, tmpfs
from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, Script, running, write_project
from tests.helpers.data import index_and_search_yaml, scifact_records, write_jsonl
from tests.helpers.harness import ChromaServer, run_index, snapshot
from tests.helpers.net import closed_port
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

EMBEDDED_STORE = "{type: chroma, path: idx/chroma, collection: test}"


def search_ids(project: Path, text: str, k: int = 3) -> list[str]:
    return [p.chunk_id for p in engine.run(load_project(project).pipeline("search"), {"query": text},
                                           orchestrate=False)[:k]]


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json=body, headers=AUTH, timeout=timeout)


def assert_consistent(snap: dict) -> None:
    assert snap["chroma"], "nothing indexed"
    assert [c[0] for c in snap["chroma"]] == snap["bm25"] == snap["state_chunks"]


def clean_build(project: Path) -> dict:
    """What a clean run makes of the same documents: the same file with its indexes elsewhere."""
    clean = project.with_name("clean.yaml")
    clean.write_text(project.read_text().replace("idx/", "clean_idx/"))
    run_index(clean)
    snap = snapshot(clean)
    return snap


# ----------------------------------------------------------------------------- (a) Chroma server
@pytest.fixture
def chroma_server(tmp_path):
    server = ChromaServer(tmp_path / "chroma-server")
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # a stopped server cannot take SIGTERM
        server.stop()


@pytest.mark.timeout(300)
def test_chroma_server_stopped_mid_query_is_a_503_naming_it_and_answered_again_once_back(chroma_server, tmp_path):
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(6))
    path = write_project(tmp_path, f"http://127.0.0.1:{closed_port()}/v1")
    store = chroma_server.store_yaml(retry_max_seconds=3, timeout_seconds=2)
    path.write_text(path.read_text().replace(EMBEDDED_STORE, store))
    assert run_index(path).added == 6
    from ragline.flows.serve.app import create_app

    server = f"Chroma server {chroma_server.url} unreachable"
    ask = {"question": QUESTION, "pipeline": "search"}
    with running(create_app(str(path), token=TOKEN)) as url:
        baseline = post(url, ask)
        assert baseline.status_code == 200, baseline.text

        def fails_naming_the_server(response: httpx.Response, seconds: float) -> None:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert server in error["message"] and "step 'dense'" in error["message"], error
            assert error["code"] == "dependency_unavailable" and error["type"] == "service_unavailable_error"
            assert seconds < 30, f"{seconds:.1f} s: not bounded by timeout_seconds and retry_max_seconds"

        # 1. a hung server (SIGSTOP: it accepts, never answers): bounded by timeout_seconds, retried, a 503
        os.kill(chroma_server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        fails_naming_the_server(post(url, ask), time.monotonic() - started)

        # 2. the server killed while a query waits on it
        answer: list[httpx.Response] = []
        job = threading.Thread(target=lambda: answer.append(post(url, ask)))
        started = time.monotonic()
        job.start()
        time.sleep(1.0)  # the dense step's request is on the frozen server's socket (its timeout is 2 s)
        assert job.is_alive(), "the query did not wait on the server"
        chroma_server.process.kill()
        chroma_server.process.wait()
        job.join(60)
        fails_naming_the_server(answer[0], time.monotonic() - started)

        # 3. the API process is up and says what is down
        assert httpx.get(f"{url}/healthz").status_code == 200
        ready = httpx.get(f"{url}/readyz", headers=AUTH, timeout=30)
        assert ready.status_code == 503 and ready.json()["checks"]["store"]["status"] == "down"
        assert chroma_server.url in ready.json()["checks"]["store"]["error"], ready.text

        # 4. the server is back (same data, same port): the next query is answered, as before
        chroma_server.start()
        again = post(url, ask)
        assert again.status_code == 200, again.text
        ids = [p["chunk_id"] for p in again.json()["passages"]]
        assert ids == [p["chunk_id"] for p in baseline.json()["passages"]]


# ----------------------------------------------------------------------------- (b) Prefect API unreachable
@pytest.mark.timeout(300)
def test_queries_answer_with_the_prefect_api_unreachable_and_lost_events_are_reported(tmp_path, monkeypatch,
                                                                                      capsys, caplog):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ragline.flows.serve.app import create_app

    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(6))
    script = Script()
    with ScriptedLLM(script) as llm:
        path = write_project(tmp_path, llm.base_url)
        assert run_index(path).added == 6  # in this process: no Prefect involved
        prefect = f"http://127.0.0.1:{closed_port()}/api"
        monkeypatch.setenv("PREFECT_API_URL", prefect)

        # the CLI in process (no --prefect): nothing is sent to Prefect, so nothing is lost
        assert main(["search", QUESTION, "-f", str(path), "-k", "2"]) == 0
        printed = capsys.readouterr()
        assert printed.out.startswith("1. [") and "Traceback" not in printed.err
        assert main(["ask", QUESTION, "-f", str(path)]) == 0
        printed = capsys.readouterr()
        assert script.answer.split(" [")[0] in printed.out and "Traceback" not in printed.err

        # the HTTP API: answered; each lost event counted; one warning line naming the Prefect API
        with temporary_settings(updates={PREFECT_API_URL: prefect}):
            app = create_app(str(path), token=TOKEN)
        with caplog.at_level(logging.WARNING, logger="ragline.api"), running(app) as url:
            searched = post(url, {"question": QUESTION, "pipeline": "search"})
            asked = post(url, {"question": QUESTION})
            assert searched.status_code == 200 and searched.json()["passages"], searched.text
            assert asked.status_code == 200 and asked.json()["answer"]["text"] == script.answer, asked.text
            deadline = time.monotonic() + 30
            while True:
                ready = httpx.get(f"{url}/readyz", headers=AUTH, timeout=30).json()
                if ready["events"]["failed"] >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert ready["events"] == {"emitted": 0, "failed": 2}, ready
        assert ready["checks"]["prefect"]["status"] == "down" and prefect in ready["checks"]["prefect"]["error"]
        warnings = [r.getMessage() for r in caplog.records if r.name == "ragline.api" and r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and f"Prefect API {prefect} unreachable" in warnings[0], warnings


# ----------------------------------------------------------------------------- (c) disk full, read-only
@pytest.mark.timeout(600)
def test_a_full_disk_during_ingestion_names_the_path_publishes_nothing_and_a_rerun_converges(tmp_path, capsys):
    records = scifact_records(30)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", records[:10])
    project = tmp_path / "pipelines.yaml"
    project.write_text(index_and_search_yaml(batch_size=4))
    titles = [r["title"] for r in records[:3]]
    with tmpfs(tmp_path / "idx", "8m") as idx:
        assert run_index(project).added == 10
        before = snapshot(project)
        answers = {t: search_ids(project, t) for t in titles}
        write_jsonl(tmp_path / "docs" / "corpus.jsonl", records)  # 20 more documents

        # 1. full before the run: refused at the first write (the writer lease), one clear line
        clear_cache()
        filler = fill(idx)
        assert main(["index", "-f", str(project), "--no-prefect"]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"error: index state {idx / 'state.sqlite'}: no space left on device"), line
        filler.unlink()
        assert snapshot(project) == before  # nothing written
        assert {t: search_ids(project, t) for t in titles} == answers

        # 2. full during the run: the store that hits it is named; BM25 keeps its published version
        filler = fill(idx, leave=128 << 10)
        with pytest.raises(OSError) as failed:  # StorageError, or a StepFailed around one
            try:
                run_index(project)
            except engine.StepFailed as exc:
                assert isinstance(exc.__cause__, StorageError), exc
                raise exc.__cause__ from exc
        assert failed.value.errno == errno.ENOSPC and str(idx) in str(failed.value), failed.value
        assert "no space left on device" in str(failed.value)
        filler.unlink()
        after = snapshot(project)
        assert after["bm25"] == before["bm25"]  # not republished: the previous version is the one searched
        for source, indexed in before["sources"].items():
            assert after["sources"][source] == indexed  # the earlier documents are untouched
        assert set(after["state_chunks"]) <= {c[0] for c in after["chroma"]}  # the state names only whole writes
        assert {t: search_ids(project, t)[:1] for t in titles} == {t: ids[:1] for t, ids in answers.items()}

        # 3. room again: a re-run in the same process converges to what a clean build makes
        rerun = run_index(project)
        assert rerun.failed == 0 and rerun.added + rerun.unchanged == 30
        converged = snapshot(project)
        assert_consistent(converged)
    assert converged == clean_build(project)


@pytest.mark.timeout(600)
def test_a_read_only_data_folder_fails_naming_it_changes_nothing_and_a_rerun_converges(tmp_path, capsys):
    records = scifact_records(8)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", records[:5])
    project = tmp_path / "pipelines.yaml"
    project.write_text(index_and_search_yaml(batch_size=4))
    assert run_index(project).added == 5
    before = snapshot(project)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", records)
    clear_cache()  # the stores open anew, through the read-only mount
    with read_only(tmp_path / "idx") as idx:
        assert main(["index", "-f", str(project), "--no-prefect"]) == 1
        err = capsys.readouterr().err
        line = err.strip().splitlines()[-1]
        assert "Traceback" not in err
        assert line.startswith(f"error: index state {idx / 'state.sqlite'}: read-only file system"), line
        # A search reads a private copy of the embedded store (read_snapshot): a read-only folder still answers
        assert main(["search", records[0]["title"], "-f", str(project)]) == 0
        out = capsys.readouterr().out
        assert records[0]["title"][:60] in out, out[:500]
    clear_cache()
    assert snapshot(project) == before
    rerun = run_index(project)
    assert (rerun.added, rerun.unchanged, rerun.failed) == (3, 5, 0)
    assert_consistent(snapshot(project))
