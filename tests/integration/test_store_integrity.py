"""Stores that vanish or break behind ragline's back (issue 16, items 1, 2 and 4): every ingestion run
checks them against the state and repairs them, queries never write, `ragline check` compares all.
Real Chroma, BM25, SQLite state and embeddings; each test failed on 52d263b."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.api_harness import ASK, running
from tests.helpers.data import REPO, index_and_search_yaml, scifact_records, write_jsonl
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

ONLY = """
  search_dense:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 20}}
      - {id: fuse,  task: fuse, with: {top_k: 20}}
  search_bm25:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 20}}
      - {id: fuse,   task: fuse, with: {top_k: 20}}
  tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries, with: {n: 12}}
      - {id: tune,  task: tune_retrieval, with: {depths: [10], rrf_k: [60], dense_weights: [0.5], bm25_k1: [1.2],
                                                 bm25_b: [0.75], bm25_stemmer: [english], write: false}}
"""


@pytest.fixture
def project(make_project, tmp_path):
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(12))
    path = make_project(index_and_search_yaml() + ONLY)
    assert index(path) == 0
    yield path
    clear_cache()


def index(project: Path, *extra: str) -> int:
    clear_cache()  # each command is a new process
    return main(["index", "-f", str(project), "--no-prefect", *extra])


def search(project: Path, capsys, pipeline: str = "search", text: str = "cells") -> tuple[int, list[str], str]:
    clear_cache()
    capsys.readouterr()
    code = main(["search", text, "-p", pipeline, "-f", str(project), "--json"])
    out, err = capsys.readouterr()
    return code, [h["chunk_id"] for h in json.loads(out)] if code == 0 else [], err


def fingerprint(folder: Path) -> dict[str, tuple]:
    """Every file's bytes and every entry's mtime under ``folder`` (Chroma's own folder apart: see below)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        found[str(path.relative_to(folder))] = (digest, stat.st_mtime_ns, stat.st_size)
    return found


def ragline_files(folder: Path) -> dict[str, tuple]:
    """The state and BM25 files byte for byte with mtimes; Chroma's folder as its list of entries.
    Embedded Chroma itself rewrites chroma.sqlite3 (a row of its `acquire_write` table) and the HNSW
    `length.bin` whenever a client opens it (chromadb 1.5.9, measured): its content is compared below."""
    return {k: (v if k != "chroma" and not k.startswith("chroma/") else "present") for k, v in fingerprint(folder).items()}


def chroma_content(project: Path) -> tuple:
    clear_cache()
    got = load_project(project).resource("store").collection.get(include=["documents", "metadatas", "embeddings"])
    clear_cache()
    return tuple(sorted((i, d, json.dumps(m, sort_keys=True), tuple(round(float(x), 6) for x in e))
                        for i, d, m, e in zip(got["ids"], got["documents"], got["metadatas"], got["embeddings"])))


# ----------------------------------------------------------------------------- item 1: lost or damaged stores
def test_a_deleted_chroma_store_fails_dense_warns_hybrid_and_the_next_run_re_embeds(project, capsys, caplog):
    code, before, _ = search(project, capsys, "search_dense")
    assert code == 0 and before
    shutil.rmtree(project.parent / "idx" / "chroma")

    code, _, err = search(project, capsys, "search_dense")
    assert code == 1 and "there is no store at" in err and "ragline index" in err
    assert not (project.parent / "idx" / "chroma").exists()  # the query created nothing
    caplog.clear()
    code, hybrid, _ = search(project, capsys, "search")
    assert code == 0 and hybrid  # BM25 answers, with one warning naming the store
    assert any("there is no store at" in r.getMessage() and "answering from the other retrievers only"
               in r.getMessage() for r in caplog.records)

    caplog.clear()
    assert index(project) == 0
    assert any("repairing chroma" in r.getMessage() and "holds 49 chunks" in r.getMessage() for r in caplog.records)
    assert search(project, capsys, "search_dense")[1] == before
    capsys.readouterr()
    assert index(project) == 0 and "unchanged 12" in capsys.readouterr().out


def test_a_truncated_chroma_database_is_named_with_its_remedy(project, capsys):
    sqlite = project.parent / "idx" / "chroma" / "chroma.sqlite3"
    os.truncate(sqlite, 4096)
    code, _, err = search(project, capsys, "search_dense")
    assert code == 1 and "is unreadable" in err and "move it aside" in err
    assert index(project) == 1
    assert f"mv {sqlite.parent} {sqlite.parent}.damaged" in capsys.readouterr().err
    sqlite.parent.rename(sqlite.parent.with_name("chroma.damaged"))  # the remedy it gave
    assert index(project) == 0 and search(project, capsys, "search_dense")[1]


def test_an_unchanged_run_does_not_open_a_store_whose_files_did_not_change(project, monkeypatch, caplog):
    """Opening an embedded store imports Chroma (~1 s of CPU, most of an unchanged run's): a store whose
    files are as they were after the last sound check is not opened. Anything done to them (a copy put
    in its place, a vector deleted behind ragline's back) makes the next run open and check it again."""
    from ragline.flows.resources.stores.chroma import ChromaStore

    opened: list[int] = []
    count = ChromaStore.count
    monkeypatch.setattr(ChromaStore, "count", lambda self: opened.append(1) or count(self))
    assert index(project) == 0 and opened  # the first check after the build opens it, and records its files
    opened.clear()
    assert index(project) == 0 and not opened
    store = project.parent / "idx" / "chroma"
    shutil.copytree(store, store.with_name("restored"), copy_function=shutil.copy2)  # times kept, new inodes
    shutil.rmtree(store)
    store.with_name("restored").rename(store)
    assert index(project) == 0 and opened
    opened.clear()
    assert index(project) == 0 and not opened

    clear_cache()
    collection = load_project(project).resource("store").collection
    collection.delete(ids=collection.get(limit=1)["ids"])
    clear_cache()
    caplog.clear()
    assert index(project) == 0 and opened
    assert any("repairing chroma" in r.getMessage() for r in caplog.records)
    # a run that wrote (the repair) is checked by the next one; Chroma may still save its HNSW files
    # when that one's process ends (vectors under sync_threshold), so the files settle a run later
    settled = []
    for _ in range(3):
        opened.clear()
        assert index(project) == 0
        settled.append(not opened)
    assert settled[0] is False and settled[-1] is True, settled


def test_a_deleted_bm25_version_and_a_garbled_pointer_are_rebuilt(project, capsys, caplog):
    bm25 = project.parent / "idx" / "bm25"
    _, before, _ = search(project, capsys, "search_bm25")
    for version in bm25.glob("v-*"):
        shutil.rmtree(version)
    code, _, err = search(project, capsys, "search_bm25")
    assert code == 1 and "the published version" in err and "is missing" in err
    caplog.clear()
    assert index(project) == 0
    assert any("repairing bm25" in r.getMessage() for r in caplog.records)
    assert search(project, capsys, "search_bm25")[1] == before

    (bm25 / "CURRENT").write_text("garbage{")
    code, _, err = search(project, capsys, "search_bm25")
    assert code == 1 and f"bm25 pointer {bm25 / 'CURRENT'} is unreadable" in err
    assert index(project) == 0 and search(project, capsys, "search_bm25")[1] == before


def test_a_damaged_state_names_the_file_and_says_to_move_it_aside(project, capsys):
    state = project.parent / "idx" / "state.sqlite"
    os.truncate(state, 8192)
    capsys.readouterr()
    assert index(project) == 1
    err = capsys.readouterr().err
    assert f"index state {state} is damaged" in err and f"mv {state} {state}.damaged" in err
    clear_cache()
    assert main(["check", "-f", str(project)]) == 1
    assert f"index state {state} is damaged" in capsys.readouterr().out
    state.rename(state.with_name("state.sqlite.damaged"))
    assert index(project) == 0 and search(project, capsys, "search_dense")[1]


def test_check_compares_everything_and_repairs(project, capsys):
    def check(*extra: str) -> tuple[int, str]:
        clear_cache()
        capsys.readouterr()
        code = main(["check", "-f", str(project), *extra])
        return code, capsys.readouterr().out

    assert check() == (0, "ok: every store agrees with the index state\n")
    shutil.rmtree(project.parent / "idx" / "chroma")
    for version in (project.parent / "idx" / "bm25").glob("v-*"):
        shutil.rmtree(version)
    code, out = check()
    assert code == 1 and out.count("\n") == 2 and out.startswith("chroma: ") and "\nbm25: " in out
    code, out = check("--repair")
    assert code == 0 and "re-indexing with pipeline 'index'" in out and out.endswith("ok: every store agrees "
                                                                                      "with the index state\n")
    assert check()[0] == 0
    clear_cache()
    assert main(["check", "-f", str(project.parent / "missing.yaml")]) == 2


def test_readyz_compares_the_stores_with_the_state(project):
    from ragline.flows.serve.app import create_app

    clear_cache()
    with running(create_app(str(project))) as url:
        checks = httpx.get(f"{url}/readyz").json()["checks"]
        assert checks["store"]["status"] == "up" and checks["store"]["detail"]["chunks"] == 49
        assert checks["sparse"]["status"] == "up"
    shutil.rmtree(project.parent / "idx" / "chroma")
    for version in (project.parent / "idx" / "bm25").glob("v-*"):
        shutil.rmtree(version)
    clear_cache()
    with running(create_app(str(project))) as url:
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503, ready.text
        checks = ready.json()["checks"]
        assert checks["store"]["status"] == "down" and "while the index state holds 49 chunks" in \
            checks["store"]["error"]
        assert checks["sparse"]["status"] == "down" and "is missing" in checks["sparse"]["error"]
        failed = httpx.post(f"{url}/v1/query", json={"question": "cells", "pipeline": "search_dense"})
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "index_damaged"
    assert not (project.parent / "idx" / "chroma").exists()


# ----------------------------------------------------------------------------- item 2: queries never write
def test_no_query_path_changes_a_byte_of_the_index_even_without_its_state(project, capsys):
    data = project.parent / "idx"
    (data / "state.sqlite").unlink()
    files, vectors = ragline_files(data), chroma_content(project)
    pointer = (data / "bm25" / "CURRENT").read_text()

    assert search(project, capsys, "search")[0] == 0
    assert search(project, capsys, "search_bm25")[1]  # the published version still answers
    assert search(project, capsys, "search_dense")[1]
    with ScriptedLLM(lambda prompt: "Yes" if "Statement:" in prompt else "Cells [1].") as llm:
        text = project.read_text() + ASK
        text = text.replace("resources:\n", f'resources:\n  llm: {{type: openai_compatible, base_url: '
                                            f'"{llm.base_url}", max_retries: 0}}\n', 1)
        project.write_text(text)
        shutil.copytree(REPO / "prompts", project.parent / "prompts", dirs_exist_ok=True)
        clear_cache()
        assert main(["ask", "cells", "-f", str(project)]) == 0
        from ragline.flows.serve.app import create_app

        clear_cache()
        with running(create_app(str(project))) as url:
            for pipeline in ("search", "ask"):
                assert httpx.post(f"{url}/v1/query", json={"question": "cells", "pipeline": pipeline}).status_code \
                    == 200
            chat = httpx.post(f"{url}/v1/chat/completions",
                              json={"model": "ask", "messages": [{"role": "user", "content": "cells"}]})
            assert chat.status_code == 200, chat.text
            httpx.get(f"{url}/readyz")
    clear_cache()
    assert ragline_files(data) == files and not (data / "state.sqlite").exists()
    assert (data / "bm25" / "CURRENT").read_text() == pointer
    assert chroma_content(project) == vectors


def test_tunes_read_side_changes_nothing(project, capsys):
    data = project.parent / "idx"
    files, vectors = ragline_files(data), chroma_content(project)
    clear_cache()
    assert main(["tune", "-f", str(project), "--no-prefect", "--json"]) == 0
    clear_cache()
    assert ragline_files(data) == files and chroma_content(project) == vectors


# ----------------------------------------------------------------------------- item 4: tune reads one generation
def test_tune_waits_for_a_writer_and_records_the_generation_it_read(project, capsys):
    from ragline.flows.contracts import Document

    clear_cache()
    state = load_project(project).resource("state")
    holding, done = threading.Event(), threading.Event()
    extra = [Document(source_id=f"late-{i}", text=f"Late document {i} about cells.", title=f"Late {i}",
                      content_hash=f"h{i}") for i in range(3)]

    def writer() -> None:
        from ragline.flows.contracts import Chunk

        with state.lease("a slow ingestion run"):
            holding.set()
            time.sleep(1.5)
            state.record("index", "fp", extra, [Chunk(chunk_id=f"late-{i}", source_id=f"late-{i}", ordinal=0,
                                                      text=d.text, title=d.title) for i, d in enumerate(extra)])
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert holding.wait(30)
    try:
        assert main(["tune", "-f", str(project), "--no-prefect", "--json", "--set", "tune.write=true"]) == 0
    finally:
        thread.join()
    overlay = yaml.safe_load((project.parent / "pipelines.tuned.yaml").read_text())
    assert overlay["tuned"]["index"] == {"chunks": 52, "generation": state.generation}
