"""The milvus index engine (type: milvus, embedded milvus-lite: Milvus's own engine) behind the same
pipelines as Chroma + BM25, with only the resource lines changed: incremental runs, kill -9 at every
write boundary of the crash-safety suite and at random moments (embedded, and through the managed
engine that `ragline serve` runs), a lost store repaired, queries that create nothing, and the filter
translation checked against ``filters.matches`` on the real engine (a quote in a value must not widen
the match). The data-safety suite runs its store cases on milvus too (test_data_safety.py)."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import time

import numpy as np
import pytest

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from ragline.flows.access import restrict  # noqa: E402
from ragline.flows.cli import main  # noqa: E402
from ragline.flows.contracts import Chunk  # noqa: E402
from ragline.flows.resources import clear_cache  # noqa: E402
from ragline.flows.resources.stores.filters import matches  # noqa: E402
from ragline.flows.resources.stores.milvus import (ACCESS_COLUMN, PHASE_READ_SECONDS, MilvusSpec, MilvusStore,  # noqa: E402
                                            expression)
from ragline.flows.run import engine  # noqa: E402
from ragline.flows.spec.compile import load_project  # noqa: E402
from tests.helpers.crash import FAILPOINTS as CRASH_FAILPOINTS  # noqa: E402
from tests.helpers.data import milvus_yaml  # noqa: E402
from tests.helpers.harness import default_corpus, kill_at_random, run_child, run_index, write_corpus  # noqa: E402

pytestmark = pytest.mark.integration

# The crash-safety suite's failpoints that a milvus run passes (BM25's own files are not written).
FAILPOINTS = [f for f in CRASH_FAILPOINTS if not f.startswith("bm25.")]


def snapshot(project) -> dict:
    """What the engine and the state hold (fresh process view): chunks with text and metadata, the
    state's chunks and sources, the recorded generation, and the chunks a BM25 query matches."""
    clear_cache()
    loaded = load_project(project)
    store = sparse = loaded.resource("store")
    state = loaded.resource("state")
    ids = sorted(store.all_ids())
    rows = store.rows(ids, ["text", "metadata"])
    chunks = [(cid, rows[cid]["text"], json.dumps({k: v for k, v in rows[cid]["metadata"].items() if k != "modified"},
                                                  sort_keys=True)) for cid in ids]
    published = sparse.published_version()
    snap = {"chunks": chunks, "state_chunks": sorted(c[0] for c in state.chunk_rows()), "sources": state.sources(),
            "in_step": published is not None and published["generation"] == state.generation,
            "bm25_matches": sorted(h[0] for h in sparse.search(["stem cells telomerase"], 1000)[0])}
    clear_cache()
    return snap


def change_corpus(docs, records):
    """An edit, a deletion and an addition in each kind of source (JSONL records, markdown files)."""
    records = records[1:]
    records[1] = dict(records[1], text=records[1]["text"] + " An added closing sentence.")
    write_corpus(docs, records, {"beta": (docs / "beta.md").read_text(),  # alpha.md deleted
                                 "gamma": "# Gamma\n\nNew notes on CRISPR screens.\n"})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """One project indexed once on milvus, copied aside (``before``) with its corpus changed since,
    the snapshot of that first index, and the snapshot of a clean build of the changed corpus."""
    root = tmp_path_factory.mktemp("milvus")
    site = root / "site"
    (site / "prompts").mkdir(parents=True)
    project = site / "pipelines.yaml"
    project.write_text(milvus_yaml(batch_size=1))  # two batches of work: a kill can follow a commit
    records = default_corpus(site / "docs", n=4)
    first = run_index(project)
    assert (first.added, first.failed) == (6, 0)
    first_snap = snapshot(project)
    change_corpus(site / "docs", records)
    shutil.copytree(site, root / "before")
    shutil.rmtree(site / "idx")
    run_index(project)
    clean = snapshot(project)
    yield project, root / "before", first_snap, clean
    clear_cache()


@pytest.fixture
def changed_project(site):
    """The project as first indexed, its corpus changed since (a fresh copy for each test)."""
    project, before, _, _ = site
    clear_cache()
    shutil.rmtree(project.parent)
    shutil.copytree(before, project.parent)
    return project


def test_incremental_runs_hybrid_search_and_a_lost_store(site, changed_project, capsys):
    """An incremental run writes what changed and equals a clean build; an unchanged one writes nothing;
    hybrid search (dense + the engine's BM25) filters; `ragline check` finds a store deleted behind ragline's
    back and `--repair` re-embeds it."""
    _, _, first, clean = site
    assert [c[0] for c in first["chunks"]] == first["state_chunks"] and first["in_step"] and first["bm25_matches"]
    report = run_index(changed_project)
    assert (report.added, report.updated, report.deleted, report.failed) == (1, 1, 2, 0)
    assert snapshot(changed_project) == clean
    again = run_index(changed_project)
    assert (again.added, again.updated, again.deleted, again.chunks_written) == (0, 0, 0, 0)

    search = load_project(changed_project).pipeline("search")
    passages = engine.run(search, {"query": {"text": "notes", "filters": {"format": "markdown"}}}, orchestrate=False)
    assert passages and {p.metadata["format"] for p in passages} == {"markdown"}
    crispr = engine.run(search, {"query": "CRISPR screens"}, orchestrate=False)
    assert crispr[0].source_id == "docs/gamma.md" and "CRISPR" in crispr[0].text

    assert check(changed_project, capsys) == (0, "ok: every store agrees with the index state\n")
    (changed_project.parent / "idx" / "milvus.db").unlink()
    code, out = check(changed_project, capsys)
    assert code == 1 and out.startswith("milvus: milvus ") and "there is no store" in out, out
    code, out = check(changed_project, capsys, "--repair")
    assert code == 0 and "re-indexing with pipeline 'index'" in out, out
    assert snapshot(changed_project) == clean


def check(project, capsys, *extra: str) -> tuple[int, str]:
    """`ragline check` (the full comparison of the stores with the state), as a user runs it."""
    clear_cache()
    capsys.readouterr()
    code = main(["check", "-f", str(project), *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_killed_run_converges_to_clean_index(failpoint, changed_project, site):
    crashed = run_child(changed_project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(changed_project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    assert snapshot(changed_project) == site[3]


def test_random_kills_converge(changed_project, site):
    """Runs killed at random moments, several in a row, then one that finishes: the clean index."""
    kill_at_random(changed_project, seed=11)
    assert run_child(changed_project).returncode == 0
    assert snapshot(changed_project) == site[3]


@pytest.mark.parametrize("failpoint", ["index.after_upsert:2", "finalize.after_delete"])
def test_a_run_killed_while_the_managed_engine_serves_the_file_converges(failpoint, changed_project, site):
    """Under `ragline serve` runs write through the managed engine (flows/ops/milvus_server.py): a run
    killed mid-write leaves the engine up, and the next run, through it, makes the clean index."""
    from ragline.flows.ops.milvus_server import ManagedMilvus

    server = ManagedMilvus(changed_project.parent / "idx" / "milvus.db",
                           logs=changed_project.parent / "logs").start()
    try:
        crashed = run_child(changed_project, failpoints=failpoint)
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
        assert server.endpoint is not None  # the engine outlived the run that wrote through it
        recovered = run_child(changed_project)
        assert recovered.returncode == 0, recovered.stderr[-2000:]
        assert snapshot(changed_project) == site[3]  # read through the engine too
    finally:
        server.stop()
    assert snapshot(changed_project) == site[3]  # and from the file, embedded again


@pytest.mark.parametrize("failpoint", ["milvus.copied_out:2", "milvus.after_drop", "milvus.copied_back:2"])
def test_a_rebuild_killed_at_any_point_finishes_without_re_embedding(failpoint, make_project, tmp_path, capsys):
    """A collection made without filter columns (an older ragline) is rebuilt with them by the next run's
    ``sync``: killed while copying its rows out, the collection is still whole; killed after dropping it
    or while copying them back, the whole copy is, and the next run restores from it before its integrity
    check. Either way the next run re-embeds nothing and the index equals a clean build, and a query in
    between reads every chunk."""
    default_corpus(tmp_path / "docs", n=6)
    old = milvus_yaml(batch_size=4).replace("collection: test}", "collection: test, write_batch_size: 3, "
                                                                   "filter_fields: []}")
    project = make_project(old)
    first = run_index(project)
    assert first.failed == 0 and first.chunks_written > 6  # several pages of rows to copy
    before = snapshot(project)
    project.write_text(old.replace(", filter_fields: []", ""))  # this version's default columns

    crashed = run_child(project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    # A query before the next run reads every chunk: from the collection while its rows were copied out,
    # from the whole copy once it was dropped (was: nothing, or the rows copied back so far).
    clear_cache()
    reader = load_project(project).resource("store")
    assert reader.count() == len(before["chunks"])
    assert reader.count({"file_name": {"$ne": ""}}) == len(before["chunks"])
    hits = reader.search([text for _, text, *_ in before["chunks"]], 3)
    assert all(chunk_id in {hit[0] for hit in found} for (chunk_id, *_), found in zip(before["chunks"], hits))
    reader.close()
    clear_cache()
    report = run_index(project)
    assert (report.added, report.updated, report.deleted, report.chunks_written) == (0, 0, 0, 0), report
    assert snapshot(project) == before
    clear_cache()
    store = load_project(project).resource("store")
    assert store.count() == len(before["chunks"])
    assert store.columns == {"source", "root", "file_name", "format", ACCESS_COLUMN}
    assert check(project, capsys) == (0, "ok: every store agrees with the index state\n")


def test_a_query_creates_no_store(make_project, tmp_path):
    (tmp_path / "docs").mkdir()
    project = make_project(milvus_yaml())
    assert engine.run(load_project(project).pipeline("search"), {"query": "anything"}, orchestrate=False) == []
    assert not (tmp_path / "idx" / "milvus.db").exists()


def test_an_engine_that_died_after_starting_is_started_again(tmp_path, caplog):
    """milvus-lite registers its engine for a file once the process has lived half a second; one that
    dies later (seen on a loaded CI machine: its socket never appeared) used to fail every open of the
    file in that process. Provoked for real: the engine killed while registered."""
    from milvus_lite.server import Server
    from milvus_lite.server_manager import server_manager_instance

    path = str((tmp_path / "dead.db").resolve())
    dead = Server(path)
    assert dead.init() and dead.start()
    dead._p.kill()
    dead._p.wait()
    server_manager_instance._servers[path] = dead
    store = MilvusStore(MilvusSpec(type="milvus", uri="dead.db", collection="c", timeout_seconds=5), tmp_path)
    store.upsert([Chunk(chunk_id="c0", source_id="s0", ordinal=0, text="okapi", embedding=[1.0, 0.0, 0.5, 0.25])])
    assert store.count() == 1
    assert "engine did not answer" in caplog.text and "starting it again" in caplog.text
    store.close()


# ------------------------------------------------------------------------------------------------ filters
ROWS = [
    {"lang": "en", "year": 2020, "score": 0.5, "ragline_acl_public": True},
    {"lang": "de", "year": 2021, "ragline_acl.staff": True},
    {"lang": 'x" or metadata["lang"] != "', "year": 1999, "ragline_acl.g:x-1": True},
    {"lang": "it's", "tag": "a\\b", "ragline_acl_public": True},
    {"lang": "日本 😀", "year": 2022, "draft": False, "ragline_acl.staff": True},
    {"year": 2020, "draft": True},
    {"lang": 5, "year": 2023},  # another type under a key a column keeps: the column holds ""
    {"lang": "", "year": 2024},
    {"lang": "en", "ragline_acl.staff": True, "ragline_acl.g:x-1": True},
]
WHERES = [
    {"lang": "en"}, {"lang": {"$ne": "en"}}, {"year": {"$gte": 2020}}, {"year": {"$lt": 2021}},
    {"score": {"$gt": 0.25}}, {"draft": False}, {"lang": {"$in": ["en", "de"]}}, {"lang": {"$nin": ["en", "de"]}},
    {"lang": {"$in": []}}, {"lang": 'x" or metadata["lang"] != "'}, {"lang": '" or true or "'}, {"lang": "it's"},
    {"tag": "a\\b"}, {"lang": "日本 😀"}, {'lang"] != "zz" or metadata["lang': "en"},
    {"$or": [{"lang": "de"}, {"$and": [{"year": 2020}, {"draft": True}]}]},
    {"$and": [{"year": {"$gt": 1990}}, {"$or": [{"ragline_acl_public": True}, {"ragline_acl.staff": True}]}]},
    {"lang": ""}, {"lang": {"$ne": ""}}, {"lang": {"$nin": ["en", ""]}}, {"lang": 5}, {"lang": {"$gt": "e"}},
    {"$or": [{"lang": {"$in": ["de", "it's"]}}, {"tag": "a\\b"}]},
    # the access clauses a server ANDs in (access.restrict): read from the access field
    restrict(None, frozenset()), restrict(None, frozenset({"staff"})), restrict({"lang": "en"}, frozenset({"g:x-1"})),
    restrict({"year": {"$gte": 2020}}, frozenset({"staff", "g:x-1", "nobody"})),
]
COLUMNS = {"json": [], "columns": ["lang", "tag", "year", "draft"]}  # filter_fields: none, or these keys


@pytest.fixture(scope="module", params=sorted(COLUMNS))
def filter_store(tmp_path_factory, request):
    """The rows in a collection whose filters read the JSON metadata only, or columns of some keys
    (``filter_fields``, where a comparison reads the same there)."""
    store = MilvusStore(MilvusSpec(type="milvus", uri="filters.db", collection="filters",
                                   filter_fields=COLUMNS[request.param]), tmp_path_factory.mktemp("milvus-filters"))
    store.upsert([Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=f"text {i}", metadata=meta,
                        embedding=[1.0, float(i), 0.5, 0.25]) for i, meta in enumerate(ROWS)])
    yield store
    store.close()


@pytest.mark.parametrize("where", WHERES, ids=[json.dumps(w, ensure_ascii=False) for w in WHERES])
def test_engine_filters_like_python(filter_store, where):
    """Dense and BM25 searches and counts on the engine match exactly the rows ``filters.matches``
    accepts, whether a key is read from its column or from the JSON."""
    expected = {f"c{i}" for i, meta in enumerate(ROWS) if matches(meta, where)}
    assert filter_store.count(where) == len(expected)
    json_only = filter_store._connect().query(filter_store.name, filter=expression(where), output_fields=["chunk_id"])
    assert {row["chunk_id"] for row in json_only} == expected  # as a collection without columns reads it
    dense = filter_store.query(np.array([[1.0, 1.0, 0.5, 0.25]]), 100, where=where)[0]
    assert {p.chunk_id for p in dense} == expected
    sparse = filter_store.search(["text"], 100, where=where)[0]
    assert {h[0] for h in sparse} == expected


def test_a_collection_from_before_the_filter_columns_filters_then_is_rebuilt_with_them(tmp_path):
    """A collection made without columns (an older ragline, or other ``filter_fields``) filters from
    the JSON; the next ingestion's ``sync`` rebuilds it from its own rows with the configured columns."""
    from types import SimpleNamespace

    old = MilvusStore(MilvusSpec(type="milvus", uri="f.db", collection="c", filter_fields=[]), tmp_path)
    old.upsert([Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=f"text {i}", metadata=meta,
                      embedding=[1.0, float(i), 0.5, 0.25]) for i, meta in enumerate(ROWS)])
    old.close()
    where = {"lang": {"$in": ["de", "it's"]}}
    expected = {f"c{i}" for i, meta in enumerate(ROWS) if matches(meta, where)}
    store = MilvusStore(MilvusSpec(type="milvus", uri="f.db", collection="c", filter_fields=["lang"]), tmp_path)
    assert {h[0] for h in store.search(["text"], 100, where=where)[0]} == expected
    assert store.columns == {ACCESS_COLUMN} and "metadata[" in expression(where, store.columns)
    assert store.sync(SimpleNamespace(generation=7)) is True
    assert store.columns == {"lang", ACCESS_COLUMN} and expression(where, store.columns).startswith("m_lang in")
    assert {h[0] for h in store.search(["text"], 100, where=where)[0]} == expected
    assert store.count() == len(ROWS) and store.published_version()["generation"] == 7
    store.close()


# ------------------------------------------------------------------------------------------------ server mode
@pytest.fixture
def milvus_server(tmp_path):
    """The engine served over TCP (milvus-lite's own server binary, the gRPC API a Milvus server speaks)."""
    from milvus_lite.server import Server

    from tests.helpers.net import free_port

    port = free_port()
    servers = []

    def start():
        server = Server(str(tmp_path / "served.db"), f"127.0.0.1:{port}")
        assert server.start()
        servers.append(server)
        deadline = time.monotonic() + 60
        while True:  # ready when it accepts connections (a deployment's health check)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline and server._p.poll() is None, "milvus-lite server did not start"
                time.sleep(0.05)

    def stop():
        servers[-1]._p.terminate()
        servers[-1]._p.wait()

    start()
    yield f"http://127.0.0.1:{port}", start, stop
    stop()


def test_server_mode_survives_a_restart_and_names_a_server_that_is_down(milvus_server, tmp_path):
    from ragline.flows.resources.stores.milvus import MilvusUnavailable

    uri, start, stop = milvus_server
    # the attempts, not the time budget, end the retries here: one attempt on a down server took 1.9 s
    # on a loaded machine, and a 2 s budget then stopped after the first
    store = MilvusStore(MilvusSpec(type="milvus", uri=uri, index="FLAT", collection="served", retries=2,
                                   retry_max_seconds=60), tmp_path)
    store.upsert([Chunk(chunk_id=f"c{i}", source_id="s", ordinal=i, text=f"served text {i}", metadata={"i": i},
                        embedding=[1.0, float(i)]) for i in range(3)])
    assert store.count() == 3 and {h[0] for h in store.search(["served"], 10, where={"i": {"$gte": 1}})[0]} == {"c1", "c2"}
    stop()
    with pytest.raises(MilvusUnavailable, match=f"Milvus server {uri} unreachable: .* failed 3 times"):
        store.count()
    start()
    deadline = time.monotonic() + 30  # gRPC backs off its reconnects: a loaded machine may need a few tries
    while True:
        try:
            assert store.count() == 3  # the same handle reconnects; what was written is there
            break
        except MilvusUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    store.close()
    assert not (tmp_path / ".ragline").exists()  # a server store writes nothing under the data folder


def test_a_collection_dropped_by_another_process_is_missing_not_an_engine_error(milvus_server, tmp_path):
    from pymilvus import MilvusClient

    from ragline.flows.resources.stores.state import StoreMissing

    uri, _, _ = milvus_server
    spec = MilvusSpec(type="milvus", uri=uri, index="FLAT", collection="dropped")
    reader = MilvusStore(spec, tmp_path)
    reader.upsert([Chunk(chunk_id="c", source_id="s", ordinal=0, text="t", embedding=[1.0, 0.0])])
    assert reader.count() == 1
    MilvusClient(uri=uri).drop_collection(reader.name)  # e.g. an indexer on another machine resetting it
    with pytest.raises(StoreMissing, match="the collection does not exist"):
        reader.count()
    reader.upsert([Chunk(chunk_id="c", source_id="s", ordinal=0, text="t", embedding=[1.0, 0.0])])
    assert reader.count() == 1
    reader.close()


def test_a_reader_whose_columns_a_rebuild_dropped_filters_from_the_json(milvus_server, tmp_path):
    """A reader (the API under serve) loaded the collection with a ``lang`` column; an ingestion run in
    another process rebuilds it without that column (``filter_fields`` changed). The reader's next
    filtered reads name a column that is gone, which the engine refuses: it describes the collection
    again and reads the key from the JSON."""
    from types import SimpleNamespace

    uri, _, _ = milvus_server
    spec = {"type": "milvus", "uri": uri, "index": "FLAT", "collection": "rebuilt"}
    writer = MilvusStore(MilvusSpec(**spec, filter_fields=["lang"]), tmp_path)
    writer.upsert([Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=f"text {i}", metadata=meta,
                         embedding=[1.0, float(i), 0.5, 0.25]) for i, meta in enumerate(ROWS)])
    where = {"lang": {"$in": ["de", "it's"]}}
    expected = {f"c{i}" for i, meta in enumerate(ROWS) if matches(meta, where)}
    reader = MilvusStore(MilvusSpec(**spec, filter_fields=["lang"]), tmp_path)
    assert reader.count(where) == len(expected) and reader.columns == {"lang", ACCESS_COLUMN}
    rebuilder = MilvusStore(MilvusSpec(**spec, filter_fields=[]), tmp_path)
    assert rebuilder.sync(SimpleNamespace(generation=2)) is True and rebuilder.columns == {ACCESS_COLUMN}
    assert {p.chunk_id for p in reader.query(np.array([[1.0, 1.0, 0.5, 0.25]]), 100, where=where)[0]} == expected
    assert reader.columns == {ACCESS_COLUMN}
    assert reader.count(where) == len(expected)
    assert {h[0] for h in reader.search(["text"], 100, where=where)[0]} == expected
    for store in (writer, reader, rebuilder):
        store.close()


def test_a_reader_during_a_rebuilds_restore_reads_the_whole_copy(milvus_server, tmp_path, monkeypatch):
    """A query process (the API under serve) has the collection loaded when an ingestion run in another
    process rebuilds it and stops after dropping it (here: the failpoint raises where a kill would land).
    The reader's next queries find the collection gone, read the rebuild phase again and answer from
    the copy, which holds every row; once the restore ends they read the collection again."""
    from types import SimpleNamespace

    from ragline.flows import failpoints

    uri, _, _ = milvus_server
    spec = {"type": "milvus", "uri": uri, "index": "FLAT", "collection": "restored"}
    writer = MilvusStore(MilvusSpec(**spec, filter_fields=[]), tmp_path)
    writer.upsert([Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=f"text {i}", metadata=meta,
                         embedding=[1.0, float(i), 0.5, 0.25]) for i, meta in enumerate(ROWS)])
    where = {"lang": {"$in": ["de", "it's"]}}
    expected = {f"c{i}" for i, meta in enumerate(ROWS) if matches(meta, where)}
    reader = MilvusStore(MilvusSpec(**spec), tmp_path)
    assert reader.count() == len(ROWS)

    class Stopped(Exception):
        pass

    def stop_after_drop(name: str) -> None:
        if name == "milvus.after_drop":
            raise Stopped(name)

    monkeypatch.setattr(failpoints, "hit", stop_after_drop)
    rebuilder = MilvusStore(MilvusSpec(**spec), tmp_path)
    with pytest.raises(Stopped):
        rebuilder.sync(SimpleNamespace(generation=2))
    reader._restoring_read = (time.monotonic(), False)  # as read just before the drop: the call finds it gone
    assert reader.count() == len(ROWS) and reader.count(where) == len(expected)
    assert {h[0] for h in reader.search(["text"], 100, where=where)[0]} == expected
    dense = reader.query(np.array([[1.0, 1.0, 0.5, 0.25]]), 100)[0]
    assert {p.chunk_id for p in dense} == {f"c{i}" for i in range(len(ROWS))}
    assert set(reader.vectors([p.chunk_id for p in dense])) == {p.chunk_id for p in dense}  # (an answerability gate's)
    assert rebuilder.resume() is True  # the next writer finishes the restore and drops the copy
    time.sleep(PHASE_READ_SECONDS)
    assert reader.count() == len(ROWS) and {h[0] for h in reader.search(["text"], 100, where=where)[0]} == expected
    assert reader._reading() == reader.name
    for store in (writer, reader, rebuilder):
        store.close()
