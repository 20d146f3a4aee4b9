"""Chroma in client/server mode against a real `chroma run` (deploy/chroma/serve.sh): the same index as
embedded, incremental re-runs, and a server that goes away mid-ingest, briefly or for good."""
from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Chunk
from ragline.flows.run.engine import StepFailed
from ragline.flows.resources import clear_cache
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.state import StoreMissing
from tests.helpers.data import index_and_search_yaml
from tests.helpers.harness import ChromaServer, default_corpus, run_index, snapshot

pytestmark = pytest.mark.integration

EMBEDDED_STORE = "{type: chroma, path: idx/chroma, collection: test}"


@pytest.fixture
def chroma_server(tmp_path):
    """A fresh server on a free port, data in tmp_path/chroma-server; stopped (SIGTERM) at the end."""
    server = ChromaServer(tmp_path / "chroma-server")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def server_project(make_project, server: ChromaServer, batch_size: int = 4, **store_options) -> Path:
    """The standard index/search project, its store on the server and its other indexes in idx_srv/
    (same folder as the embedded project, so both read the same docs and make the same chunk ids)."""
    text = index_and_search_yaml(batch_size)
    assert EMBEDDED_STORE in text
    text = text.replace(EMBEDDED_STORE, server.store_yaml(**store_options)).replace("idx/", "idx_srv/")
    return make_project(text, name="server.yaml")


def vec_chunk(cid: str, vector, source: str = "src", **metadata) -> Chunk:
    return Chunk(chunk_id=cid, source_id=source, ordinal=0, text=f"text of {cid}", title=f"title {source}",
                 metadata={"chunk": 0, **metadata}, embedding=list(vector))


def server_store(server: ChromaServer, **spec) -> ChromaStore:
    return ChromaStore(ChromaSpec(type="chroma", host=server.host, port=server.port, collection="test", **spec))


def search(project, text: str, k: int = 5):
    return engine.run(load_project(project).pipeline("search"), {"query": text}, orchestrate=False)[:k]


def assert_consistent(snap: dict) -> None:
    assert snap["chroma"], "nothing indexed"
    assert [c[0] for c in snap["chroma"]] == snap["bm25"] == snap["state_chunks"]


def count_writes(monkeypatch) -> list[int]:
    """Sizes of every non-empty upsert/delete the index stage sends to Chroma."""
    writes: list[int] = []
    for name in ("upsert", "delete"):
        original = getattr(ChromaStore, name)

        def spy(self, items, _original=original):
            items = list(items)
            if items:
                writes.append(len(items))
            return _original(self, items)

        monkeypatch.setattr(ChromaStore, name, spy)
    return writes


def after_first_upsert(monkeypatch, action) -> None:
    """Call ``action`` once, right after the first batch's vectors are written."""
    original = ChromaStore.upsert
    fired = threading.Event()

    def upsert(self, chunks):
        original(self, chunks)
        if chunks and not fired.is_set():
            fired.set()
            action()

    monkeypatch.setattr(ChromaStore, "upsert", upsert)


def clean_build(project, tmp_path) -> dict:
    """What a clean run builds from the same corpus: empty collection, state and BM25, then one run."""
    clear_cache()
    load_project(project).resource("store").reset()
    shutil.rmtree(tmp_path / "idx_srv", ignore_errors=True)
    clear_cache()
    run_index(project)
    return snapshot(project)


# ----------------------------------------------------------------------------- store level
def test_store_operations_match_embedded(chroma_server, tmp_path):
    rng = np.random.default_rng(0)
    chunks = [vec_chunk(f"c{i}", rng.standard_normal(8).tolist(), source=f"s{i % 3}", lang="en" if i % 2 else "de")
              for i in range(30)]
    queries = rng.standard_normal((3, 8)).astype(np.float32)
    stores = {"embedded": ChromaStore(ChromaSpec(type="chroma", path="emb", collection="test"), base_dir=tmp_path),
              "server": server_store(chroma_server, write_batch_size=7)}
    seen = {}
    for mode, store in stores.items():
        with pytest.raises(StoreMissing):  # never written: a read creates nothing, in both modes
            store.query(queries[:2], k=4)
        store.collection  # a writer opens it
        assert store.query(queries[:2], k=4) == [[], []]  # empty collection: no error, no count()
        store.upsert(chunks)
        store.delete(["c0", "c1", "absent"])
        seen[mode] = (store.all_ids(), store.query(queries, k=100), store.query(queries, k=5, where={"lang": "en"}),
                      store.collection.configuration["hnsw"]["ef_search"])
    emb, srv = seen["embedded"], seen["server"]
    assert srv[0] == emb[0] == {f"c{i}" for i in range(2, 30)}
    for got, want in zip(srv[1] + srv[2], emb[1] + emb[2]):
        assert [p.chunk_id for p in got] == [p.chunk_id for p in want]
        assert [p.text for p in got] == [p.text for p in want]
        assert np.allclose([p.score for p in got], [p.score for p in want], atol=1e-5)
    assert len(srv[1][0]) == 28  # k above the collection size: everything, no error
    assert srv[3] == emb[3] == 200
    stores["server"].reset()
    with pytest.raises(StoreMissing, match="the collection does not exist"):
        stores["server"].count()


def test_auth_token_is_sent_and_never_logged(chroma_server, monkeypatch, caplog):
    monkeypatch.setenv("RAGLINE_TEST_CHROMA_TOKEN", "tok-123456")
    store = server_store(chroma_server, auth_token_env="RAGLINE_TEST_CHROMA_TOKEN")
    with caplog.at_level(logging.DEBUG):
        store.upsert([vec_chunk("a", [1.0, 0.0])])
        assert store.count() == 1
    assert store.client._server._session.headers["Authorization"] == "Bearer tok-123456"
    assert "tok-123456" not in caplog.text + store.location


def test_restart_keeps_the_collection_and_a_wiped_server_gets_a_new_one(chroma_server, tmp_path, caplog):
    store = server_store(chroma_server, retry_max_seconds=60)
    store.upsert([vec_chunk("a", [1.0, 0.0])])
    chroma_server.restart()
    assert store.all_ids() == {"a"}  # same path: the cached handle still names a live collection
    chroma_server.stop()
    chroma_server.path = tmp_path / "wiped"  # a server that lost its data: the cached handle is stale
    chroma_server.start()
    with caplog.at_level(logging.WARNING, logger="ragline.chroma"):
        store.upsert([vec_chunk("b", [0.0, 1.0])])
    assert store.all_ids() == {"b"}
    assert "stale" in caplog.text


# ----------------------------------------------------------------------------- pipelines
def test_server_index_matches_embedded_and_reruns_write_nothing(chroma_server, make_project, index_project,
                                                                 tmp_path, monkeypatch):
    records = default_corpus(tmp_path / "docs")
    remote = server_project(make_project, chroma_server)
    first = run_index(remote)
    assert (first.added, first.updated, first.deleted, first.failed) == (12, 0, 0, 0)
    remote_snap = snapshot(remote)
    assert_consistent(remote_snap)
    top = search(remote, records[0]["title"])[0]
    assert records[0]["_id"] in top.source_id

    writes = count_writes(monkeypatch)
    again = run_index(remote)
    assert (again.added, again.updated, again.unchanged, again.chunks_written) == (0, 0, 12, 0)
    assert writes == []  # unchanged: nothing sent to the server
    assert snapshot(remote) == remote_snap
    monkeypatch.undo()

    local = index_project(batch_size=4)
    run_index(local)
    local_snap = snapshot(local)
    assert remote_snap["chroma"] == local_snap["chroma"]  # same chunk ids, texts and metadata
    assert remote_snap["bm25"] == local_snap["bm25"] and remote_snap["sources"] == local_snap["sources"]
    for question in (records[3]["title"], "zebrafish regeneration"):
        assert [p.chunk_id for p in search(remote, question)] == [p.chunk_id for p in search(local, question)]


def test_server_restart_mid_ingest_is_survived(chroma_server, make_project, tmp_path, monkeypatch, caplog):
    default_corpus(tmp_path / "docs")
    project = server_project(make_project, chroma_server, batch_size=2, retries=30, retry_max_seconds=60)
    stopped, problems = threading.Event(), []

    def bounce():
        try:
            chroma_server.stop()
            stopped.set()
            time.sleep(2)
            chroma_server.start()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            problems.append(exc)
            stopped.set()

    def outage():
        threading.Thread(target=bounce, daemon=True).start()
        stopped.wait(30)  # the next batch's write finds the server down

    after_first_upsert(monkeypatch, outage)
    with caplog.at_level(logging.WARNING, logger="ragline.chroma"):
        report = run_index(project)
    assert not problems
    assert (report.added, report.failed) == (12, 0)
    assert "retry" in caplog.text and chroma_server.url in caplog.text
    monkeypatch.undo()
    survived = snapshot(project)
    assert_consistent(survived)
    assert survived == clean_build(project, tmp_path)


def test_server_down_past_the_deadline_fails_clearly_then_a_rerun_converges(chroma_server, make_project,
                                                                            tmp_path, monkeypatch):
    default_corpus(tmp_path / "docs")
    project = server_project(make_project, chroma_server, batch_size=2, retries=50, retry_max_seconds=2)
    after_first_upsert(monkeypatch, chroma_server.stop)
    started = time.monotonic()
    with pytest.raises(StepFailed) as err:
        run_index(project)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert f"Chroma server {chroma_server.url} unreachable" in message and "step 'write'" in message
    monkeypatch.undo()
    clear_cache()

    chroma_server.start()
    report = run_index(project)
    assert report.failed == 0 and report.added + report.unchanged == 12
    recovered = snapshot(project)
    assert_consistent(recovered)
    assert recovered == clean_build(project, tmp_path)
