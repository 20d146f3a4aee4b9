"""The PostgreSQL index state (flows/resources/stores/state_pg.py) on a real server (tests/helpers/postgres.py):
what only a shared database must do. The methods' semantics run on both backends in test_state.py."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[dev]')")

from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources.stores.state import IndexBusy, IndexState, StateSpec, StoreMissing
from ragline.flows.resources.stores.state_pg import PostgresIndexState, StateUnreachable, schema_ddl, translate
from ragline.flows.spec.fingerprint import _resource_fingerprint
from tests.helpers.data import REPO
from tests.helpers.net import closed_port
from tests.helpers.postgres import PASSWORD, new_schema


def doc(source_id: str, text: str = "text") -> Document:
    return Document(source_id=source_id, text=text, title="", path=source_id, content_hash=f"h-{source_id}-{text}")


def chunks_of(source_id: str, n: int = 2, text: str = "part") -> list[Chunk]:
    return [Chunk(chunk_id=f"{source_id}#{i}", source_id=source_id, ordinal=i, text=f"{source_id} {text} {i}",
                  title="", metadata={"i": i}) for i in range(n)]


def spec_of(url: str, schema: str | None = None) -> StateSpec:
    return StateSpec(type="index_state", url=url, schema_name=schema or new_schema())


@pytest.fixture
def spec(postgres):
    return spec_of(postgres.url)


@pytest.fixture
def state(spec, tmp_path):
    st = IndexState(spec, base_dir=tmp_path)
    yield st
    st.close()


def test_a_url_selects_the_postgres_backend_and_leaves_no_file(state, tmp_path):
    assert isinstance(state, PostgresIndexState)
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    assert state.counts() == (1, 2) and not state.path.exists() and not list(tmp_path.iterdir())


def test_an_unknown_url_scheme_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown scheme 'mysql://'; known: postgres://, postgresql://"):
        IndexState(StateSpec(type="index_state", url="mysql://u:p@h/db"))


def test_sql_translation():
    assert translate("SELECT x FROM t WHERE a=? AND b IN (?,?)") == "SELECT x FROM t WHERE a=%s AND b IN (%s,%s)"
    assert translate("BEGIN") == "BEGIN ISOLATION LEVEL REPEATABLE READ"
    assert translate("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?)") == (
        "INSERT INTO chunks VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (chunk_id) DO UPDATE SET "
        "source_id = EXCLUDED.source_id, ordinal = EXCLUDED.ordinal, text = EXCLUDED.text, title = EXCLUDED.title, "
        "metadata = EXCLUDED.metadata")
    assert translate("INSERT OR IGNORE INTO meta(key, value) VALUES(?, ?)").endswith("ON CONFLICT DO NOTHING")
    # every column state.py's SCHEMA names is created and added to an older schema: one place to add one
    assert 'ALTER TABLE sources ADD COLUMN IF NOT EXISTS acl TEXT COLLATE "C"' in schema_ddl()  # bytewise, as SQLite
    assert any("indexed_at DOUBLE PRECISION" in s for s in schema_ddl())


def test_an_older_schema_gains_the_columns_added_since(postgres, spec, tmp_path):
    with psycopg.connect(postgres.url, autocommit=True) as raw:
        raw.execute(f"CREATE SCHEMA {spec.schema_name}")
        raw.execute(f"CREATE TABLE {spec.schema_name}.sources (source_id TEXT PRIMARY KEY, origin TEXT NOT NULL, "
                    f"content_hash TEXT NOT NULL, fingerprint TEXT NOT NULL, path TEXT, title TEXT, "
                    f"indexed_at DOUBLE PRECISION NOT NULL)")
    state = IndexState(spec, base_dir=tmp_path)
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    assert state.acls(["a"]) == {"a": ()}
    state.close()


def test_the_change_log_names_every_chunk_written_or_deleted_by_generation(state):
    state.record("o", "fp", [doc("a"), doc("b")], chunks_of("a") + chunks_of("b"))
    log_id = state.chunk_log_id()
    since = state.generation
    state.forget(["a"])
    state.record("o", "fp", [doc("b", "new")], chunks_of("b", 3, text="new"))
    changes = state.chunk_changes(since, log_id)
    assert changes.generation == since + 2 and changes.chunks == 3
    assert changes.changed == {"a#0", "a#1", "b#0", "b#1", "b#2"}
    assert [r[0] for r in changes.rows] == ["b#0", "b#1", "b#2"] and changes.rows[0][1] == "b new 0"
    assert state.chunk_changes(since, "another log") is None
    state.prune_chunk_changes(state.generation)
    assert state.chunk_changes(since, log_id) is None  # pruned past it: the log cannot say
    assert state.chunk_changes(state.generation, log_id).changed == set()


def test_writers_on_separate_connections_serialise_their_generations(spec, tmp_path):
    """Two processes' worth of writers (one instance each) at once: every write bumps the generation
    once and every chunk is in the log (SQLite's BEGIN IMMEDIATE, here an advisory transaction lock)."""
    writers = [IndexState(spec, base_dir=tmp_path) for _ in range(3)]
    writers[0].conn
    log_id, start = writers[0].chunk_log_id(), writers[0].generation

    def write(n: int) -> None:
        for i in range(10):
            writers[n].record("o", "fp", [doc(f"w{n}-{i}")], chunks_of(f"w{n}-{i}", 1))

    threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writers[1].generation == start + 30
    assert len(writers[2].chunk_changes(start, log_id).changed) == 30
    for w in writers:
        w.close()


def test_a_reader_sees_one_generation_while_a_writer_commits(spec, tmp_path):
    writer, reader = IndexState(spec, base_dir=tmp_path), IndexState(spec, base_dir=tmp_path)
    writer.record("o", "fp", [doc("a")], chunks_of("a"))
    with writer.transaction() as tx:  # a write in flight: forget a, record b, not committed yet
        tx.execute("DELETE FROM chunks WHERE source_id = ?", ("a",))
        tx.execute("INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?)", ("b#0", "b", 0, "b", "", "{}"))
        writer._bump(tx)
        generation, rows = reader.snapshot()  # not blocked (this thread holds the write: it would hang), not half of it
        assert (generation, [r[0] for r in rows]) == (1, ["a#0", "a#1"])
    assert reader.snapshot()[0] == 2 and [r[0] for r in reader.snapshot()[1]] == ["b#0"]
    writer.close()
    reader.close()


def test_a_reader_never_creates_the_schema(spec, tmp_path):
    reader = IndexState(spec, base_dir=tmp_path)
    with pytest.raises(StoreMissing, match=f"schema {spec.schema_name}.*holds no index"):
        reader.counts()
    assert not reader.exists() and reader.lease_holder(wait=1) is None
    assert reader.health().status == "degraded"
    reader.close()
    writer = IndexState(spec, base_dir=tmp_path)
    writer.set_meta("k", "v")
    assert IndexState(spec, base_dir=tmp_path).get_meta("k") == "v"
    writer.close()


def test_the_password_is_never_shown(postgres, tmp_path):
    """Not in the location, the errors of a refused or rejected connection, health, or the spec's repr;
    and not in the index fingerprint (a rotated password re-indexes nothing)."""
    wrong = postgres.url.replace(PASSWORD, PASSWORD + "x")
    refused = f"postgresql://ragline:{PASSWORD}@127.0.0.1:{closed_port()}/postgres"
    for url in (wrong, refused):
        state = IndexState(spec_of(url), base_dir=tmp_path)
        with pytest.raises(StateUnreachable) as raised:
            state.counts()
        with pytest.raises(StateUnreachable) as raised_write:
            state.record("o", "fp", [doc("a")], chunks_of("a"))
        health = state.health()
        shown = [str(raised.value), str(raised_write.value), health.model_dump_json(), state.location,
                 repr(state.spec)]
        assert health.status == "down" and "127.0.0.1" in health.error
        assert all(PASSWORD not in text for text in shown), shown
        assert "ragline@127.0.0.1" in state.location
    assert _resource_fingerprint(spec_of(wrong, "s")) == _resource_fingerprint(spec_of(postgres.url, "s")) == {
        "type": "index_state", "path": ".ragline/state.sqlite"}


def test_another_data_folder_moves_the_state_out_of_the_database(postgres):
    """`--data-dir` and evaluation never write the configured database: a file there instead."""
    moved = IndexState.relocated(spec_of(postgres.url), "state")
    assert moved.url is None and moved.path == "state"


HOLD = """
import sys, time
from pathlib import Path
from ragline.flows.resources.stores.state import IndexState, StateSpec
state = IndexState(StateSpec(type="index_state", url=sys.argv[1], schema_name=sys.argv[2]), Path("."))
with state.lease("holder " + sys.argv[3], heartbeat=0.2):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(spec: StateSpec, tag: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, spec.url, spec.schema_name, tag], cwd=REPO,
                               env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_killed_writers_lease_is_freed_and_a_frozen_ones_taken_over(spec, tmp_path):
    """The lease across processes: held -> the other is refused and told who; SIGKILL -> the server ends
    its session and the lock is free at once; SIGSTOP (heartbeat stops, session alive) -> taken over."""
    state = IndexState(spec, base_dir=tmp_path)
    state.conn
    first = _holder(spec, "one")
    try:
        holder = state.lease_holder()
        assert holder.holder == "holder one" and holder.pid == first.pid
        with pytest.raises(IndexBusy, match=r"being written by holder one \(pid \d+"):
            with state.lease("me", wait=False):
                pass
        first.send_signal(signal.SIGKILL)
        first.wait()
        began = time.monotonic()
        with state.lease("me", timeout=10):
            assert state.lease_holder().holder == "me"
        assert time.monotonic() - began < 5
        assert state.lease_holder() is None  # released at the end of the block
    finally:
        first.kill()
        first.wait()

    frozen = _holder(spec, "two")
    try:
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        with state.lease("me", timeout=10, stale_after=1.0):
            assert state.lease_holder().holder == "me"
    finally:
        frozen.kill()
        frozen.wait()
    state.close()


def test_each_collection_gets_a_schema_of_its_own():
    """A collection's state must never share its template's tables (its `path` move does not move a database)."""
    from ragline.flows.spec.collections import _derived_fields

    template = {"type": "index_state", "path": "idx/state.sqlite", "url": "postgresql://u:p@h/db", "schema_name": "kb"}
    papers, other = _derived_fields(template, "papers"), _derived_fields(template, "Papers-2")
    assert papers["schema_name"] == "kb__papers" and papers["url"] == template["url"]
    assert re.fullmatch(r"kb__papers_2_[0-9a-f]{8}", other["schema_name"])
    assert StateSpec(**papers) and StateSpec(**other)  # valid schema names
    assert "schema_name" not in _derived_fields({"type": "index_state", "path": "s.sqlite"}, "papers")
