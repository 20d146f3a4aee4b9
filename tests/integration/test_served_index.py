"""`ragline serve` answers from the index its own runs write (issue 15, item 1).

The default, embedded store, served as users run it: one `ragline serve` subprocess with a real
Prefect server; ingestion as real flow runs in child processes (POST /v1/ingest, a Prefect REST
trigger) and as a terminal `ragline index`; the API's next query must see exactly the new index on
both retrievers, with no restart, and 50 queries during an ingestion must all succeed."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers.data import scifact_records, write_jsonl
from tests.integration.served_index import (AXOLOTL, OKAPI, PIPELINES, ZEBRAFISH, documents, ingest, query,
                                            sources, the, write_project)
from tests.integration.serving import (AUTH, FINAL, TOKEN as AUTH_TOKEN, _create_flow_run, _deployment, serving,
                                          _wait_flow_run, _wait_status)

pytestmark = pytest.mark.integration




@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("served-index"), PIPELINES)


@pytest.fixture(scope="module")
def served(project, prefect_api):
    """`ragline serve` on a project that was never indexed."""
    with serving(project, prefect_api) as url:
        yield url


def assert_agree(served: str, project: Path) -> set[str]:
    """Dense search sees every indexed document and nothing else; no passage is empty."""
    expected = documents(project)
    dense = query(served, "dense", "cells")
    assert sources(dense) == expected
    assert all(p["text"].strip() and p["source_id"] for p in dense)
    return expected


def test_first_ingestion_into_an_empty_project_is_seen_by_both_retrievers(served, project):
    assert httpx.get(f"{served}/readyz", timeout=30).json()["checks"]["store"]["status"] == "up"
    ingest(served)
    expected = assert_agree(served, project)
    assert len(expected) == 13
    assert the("zebrafish.md", sources(query(served, "dense", "fish that regrow fins")))
    assert the("zebrafish.md", sources(query(served, "bm25", "zebrafish fins")))
    assert the("zebrafish.md", sources(query(served, "search", "zebrafish fins")))


def test_an_update_with_50_queries_during_it(served, project):
    before = documents(project)
    (project.parent / "docs" / "zebrafish.md").write_text(AXOLOTL)
    write_jsonl(project.parent / "docs" / "more.jsonl", scifact_records(150, offset=12))
    started = httpx.post(f"{served}/v1/ingest", json={"pipeline": "index"}, headers=AUTH, timeout=30)
    assert started.status_code == 202, started.text

    def ask(i: int) -> set[str]:
        return sources(query(served, ("search", "dense", "bm25")[i % 3], f"cells and proteins {i}"))

    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(ask, range(50)))  # every one answers 200 (asserted in query)
    status = _wait_status(served, started.json()["run_id"], FINAL, timeout=600)
    assert status["state"] == "COMPLETED", status
    after = assert_agree(served, project)
    assert len(after) == 13 + 150
    for found in seen:  # old or new documents, nothing else
        assert found <= before | after
    dense = query(served, "dense", "salamanders regrow limbs")
    assert the("zebrafish.md", sources(dense[:3]))
    assert not any("fins" in p["text"] for p in dense if p["source_id"].endswith("zebrafish.md"))
    assert the("zebrafish.md", sources(query(served, "bm25", "axolotl salamanders")))


def test_a_deletion_by_a_prefect_triggered_run(served, prefect_api, project):
    (project.parent / "docs" / "zebrafish.md").unlink()
    run = _wait_flow_run(prefect_api, _create_flow_run(prefect_api, _deployment(prefect_api, "index")["id"], {}),
                         timeout=600)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    found = assert_agree(served, project)
    assert the("zebrafish.md", found) is None
    for pipeline in ("dense", "bm25", "search"):
        passages = query(served, pipeline, "axolotl salamanders zebrafish")
        assert the("zebrafish.md", sources(passages)) is None
        assert all(p["text"].strip() for p in passages)


def test_a_terminal_index_beside_the_service(served, project):
    """A user's `ragline index` in another terminal goes through the service's Chroma server."""
    (project.parent / "docs" / "okapi.md").write_text(OKAPI)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    ragline = Path(sys.executable).with_name("ragline")
    done = subprocess.run([str(ragline), "index", "-f", str(project), "--no-prefect"], cwd=project.parent,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "added 1" in done.stdout
    assert_agree(served, project)
    assert the("okapi.md", sources(query(served, "dense", "striped forest giraffe")[:3]))
    assert the("okapi.md", sources(query(served, "bm25", "okapi congo")))


def test_served_runs_list_what_changed_from_the_folder_journal(served, project):
    """`ragline serve` watches `docs/`: its runs read the journal of changed paths (a path leaves
    it only through a run that listed from it and found the index agreeing), not the whole folder."""
    from ragline.flows.sources.journal import Journal, journal_file
    from ragline.flows.sources.local import RACY_SECONDS

    journal = Journal(journal_file(project.parent, "index", str(project.parent / "docs")))
    assert journal.watch() is not None and journal.watch().live()
    ingest(served)  # the runs so far may not have vouched for the journal (one finished after the watch began)
    (project.parent / "docs" / "tapir.md").write_text("# Tapir\n\nTapirs browse the forests of Malaysia.\n")
    deadline = time.monotonic() + 30
    while not any(p.endswith("tapir.md") for p in journal.changes()):
        assert time.monotonic() < deadline, journal.changes()
        time.sleep(0.1)
    ingest(served)
    assert the("tapir.md", sources(query(served, "bm25", "tapirs malaysia")))
    time.sleep(RACY_SECONDS)  # the new file's signal is trusted from now: the next run finds it as indexed
    for _ in range(5):  # (a run that found the heartbeat late on a starved machine lists in full instead)
        ingest(served)
        if not journal.changes():
            break
    assert journal.changes() == {}  # only a run listing from the journal settles a path
    assert_agree(served, project)


def test_the_chroma_server_is_supervised(served, project):
    """Killed, it is reported and restarted on the same port; the next queries are answered."""
    from ragline.flows.resources.stores.store_owner import owner_of

    owner = owner_of(project.parent / "idx" / "chroma")
    assert owner is not None
    os.kill(owner.pid, 9)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        again = owner_of(project.parent / "idx" / "chroma")
        if again is not None and again.pid != owner.pid:
            break
        time.sleep(0.5)
    assert again is not None and again.pid != owner.pid and again.port == owner.port
    assert the("okapi.md", sources(query(served, "dense", "striped forest giraffe")[:3]))
    log = (project.parent / "serve.log").read_text()
    assert "exited with code" in log and "restarting it" in log


def test_ragline_api_beside_a_terminal_index_that_adds_and_deletes(tmp_path):
    """`ragline api` (no Prefect) and a user's `ragline index` in another terminal: the API's next
    query finds the added file and never returns the deleted one (it came back as an empty passage)."""
    from tests.helpers.harness import free_port, run_index

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "zebrafish.md").write_text(ZEBRAFISH)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(6))
    project = tmp_path / "pipelines.yaml"
    project.write_text(textwrap.dedent(PIPELINES))
    run_index(project)
    ragline = Path(sys.executable).with_name("ragline")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    port = free_port()
    log = open(tmp_path / "api.log", "wb")
    api = subprocess.Popen([str(ragline), "api", "-f", str(project), "--port", str(port), "--token", AUTH_TOKEN],
                           cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert api.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        assert the("zebrafish.md", sources(query(url, "dense", "fish that regrow fins")[:3]))
        (tmp_path / "docs" / "zebrafish.md").unlink()
        (tmp_path / "docs" / "okapi.md").write_text(OKAPI)
        done = subprocess.run([str(ragline), "index", "-f", str(project), "--no-prefect"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "added 1" in done.stdout and "deleted 1" in done.stdout
        assert_agree(url, project)
        for pipeline in ("dense", "search"):
            passages = query(url, pipeline, "fish that regrow fins; striped forest giraffe")
            assert the("zebrafish.md", sources(passages)) is None and all(p["text"].strip() for p in passages)
            assert the("okapi.md", sources(passages))
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(60)
        log.close()
    assert owner_of_gone(project)


def owner_of_gone(project: Path) -> bool:
    from ragline.flows.resources.stores.store_owner import owner_of, server_file

    folder = project.parent / "idx" / "chroma"
    return owner_of(folder) is None and not server_file(folder).exists()
