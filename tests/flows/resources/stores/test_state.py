"""Unit tests for the SQLite index state record (flows.resources.state), on a real file in tmp_path."""
from __future__ import annotations

import json
import sqlite3

import pytest

from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources.stores.state import IndexState, StateSpec, StoreMissing
from tests.helpers.postgres import new_schema


def doc(source_id: str, text: str = "text", title: str = "", path: str = "") -> Document:
    return Document(source_id=source_id, text=text, title=title, path=path or source_id,
                    content_hash=f"hash-{source_id}-{text}")


def chunks_of(source_id: str, n: int = 2, title: str = "", prefix: str = "") -> list[Chunk]:
    return [Chunk(chunk_id=f"{prefix}{source_id}#{i}", source_id=source_id, ordinal=i,
                  text=f"{source_id} part {i}", title=title, metadata={"chunk": i, "lang": "en"})
            for i in range(n)]


def test_spec_rejects_unknown_fields():
    with pytest.raises(ValueError):
        StateSpec(type="index_state", path="s.sqlite", bogus=1)


def test_path_is_resolved_under_base_dir(tmp_path):
    st = IndexState(StateSpec(type="index_state", path="sub/dir/s.sqlite"), base_dir=tmp_path)
    assert st.path == (tmp_path / "sub" / "dir" / "s.sqlite").resolve()
    assert not st.path.exists()  # lazy: nothing is created before first use
    with pytest.raises(StoreMissing, match="does not exist: nothing is indexed yet"):
        st.counts()  # a read never creates the file (queries never write)
    assert not st.path.exists() and not st.exists()
    st.set_meta("k", "v")  # a write does
    assert st.path.exists() and st.counts() == (0, 0)
    st.close()


def test_empty_state(state):
    assert state.generation == 0
    assert state.sources() == {}
    assert state.chunk_ids() == set()
    assert state.chunk_ids([]) == set()
    assert state.chunk_rows() == []
    assert state.chunks_by_id([]) == {}
    assert state.chunks_by_id(["nope"]) == {}
    assert state.counts() == (0, 0)


def test_record_and_read_back(state):
    docs = [doc("a", title="Title A"), doc("b")]
    state.record("docs", "fp1", docs, chunks_of("a", 2, title="Title A") + chunks_of("b", 1))
    assert state.sources() == {"a": ("hash-a-text", "fp1"), "b": ("hash-b-text", "fp1")}
    assert state.chunk_ids() == {"a#0", "a#1", "b#0"}
    assert state.chunk_ids(["a"]) == {"a#0", "a#1"}
    assert state.chunk_ids(["b", "missing"]) == {"b#0"}
    assert state.counts() == (2, 3)

    rows = state.chunk_rows()
    assert [r[0] for r in rows] == ["a#0", "a#1", "b#0"]  # ordered by chunk id
    cid, text, meta = rows[1]
    assert text == "a part 1"
    assert meta == {"chunk": 1, "lang": "en", "source_id": "a", "title": "Title A"}
    assert rows[2][2]["title"] == ""

    by_id = state.chunks_by_id(["b#0", "a#0", "zzz"])
    assert set(by_id) == {"a#0", "b#0"}
    assert by_id["a#0"] == {"source_id": "a", "text": "a part 0", "title": "Title A",
                            "metadata": {"chunk": 0, "lang": "en"}}
    assert by_id["b#0"]["title"] == ""


def test_chunk_rows_order_is_stable_regardless_of_insert_order(state):
    state.record("o", "fp", [doc("z"), doc("a")], chunks_of("z", 2) + chunks_of("a", 2))
    ids = [r[0] for r in state.chunk_rows()]
    assert ids == sorted(ids) == ["a#0", "a#1", "z#0", "z#1"]


def test_record_replaces_existing_source(state):
    state.record("o", "fp1", [doc("a", text="old")], chunks_of("a", 3))
    state.record("o", "fp2", [doc("a", text="new")], chunks_of("a", 3))
    assert state.sources() == {"a": ("hash-a-new", "fp2")}
    assert state.counts() == (1, 3)


def test_forget(state):
    state.record("o", "fp", [doc("a"), doc("b"), doc("c")],
                 chunks_of("a", 2) + chunks_of("b", 2) + chunks_of("c", 1))
    state.forget(["a", "c", "not-there"])
    assert set(state.sources()) == {"b"}
    assert state.chunk_ids() == {"b#0", "b#1"}
    assert state.chunks_by_id(["a#0", "b#0"]).keys() == {"b#0"}
    assert state.counts() == (1, 2)


def test_generation_bumps_on_every_write(state):
    assert state.generation == 0
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    assert state.generation == 1
    state.record("o", "fp", [doc("b")], chunks_of("b"))
    assert state.generation == 2
    state.forget(["a"])
    assert state.generation == 3
    state.forget([])  # nothing to forget: not a write
    assert state.generation == 3


def test_meta(state):
    assert state.get_meta("clean") is None
    assert state.get_meta("clean", "no") == "no"
    state.set_meta("clean", "yes")
    assert state.get_meta("clean") == "yes"
    state.set_meta("clean", "no")
    assert state.get_meta("clean") == "no"
    assert state.generation == 0  # meta writes do not bump the generation


def test_origin_filter(state):
    state.record("docs", "fp", [doc("a"), doc("b")], chunks_of("a") + chunks_of("b"))
    state.record("papers", "fp", [doc("p")], chunks_of("p"))
    assert set(state.sources()) == {"a", "b", "p"}
    assert set(state.sources("docs")) == {"a", "b"}
    assert set(state.sources("papers")) == {"p"}
    assert state.sources("other") == {}
    # re-recording a source under another origin moves it
    state.record("papers", "fp", [doc("a")], chunks_of("a"))
    assert set(state.sources("docs")) == {"b"}
    assert set(state.sources("papers")) == {"a", "p"}


def test_batches_of_more_than_500_ids(state):
    n = 1203  # more than two batches of 500 host parameters
    docs = [doc(f"s{i:04d}") for i in range(n)]
    chunks = [c for d in docs for c in chunks_of(d.source_id, 1)]
    state.record("bulk", "fp", docs, chunks)
    assert state.counts() == (n, n)

    all_sources = [d.source_id for d in docs]
    assert state.chunk_ids(all_sources) == {c.chunk_id for c in chunks}
    assert state.chunk_ids(iter(all_sources)) == {c.chunk_id for c in chunks}  # any iterable
    wanted = [c.chunk_id for c in chunks][::-1] + ["absent"]
    by_id = state.chunks_by_id(wanted)
    assert len(by_id) == n
    assert by_id["s1202#0"]["source_id"] == "s1202"

    state.forget(all_sources[:1100])
    assert state.counts() == (103, 103)
    assert set(state.sources()) == set(all_sources[1100:])
    assert state.generation == 2


def test_reopen_sees_committed_data(tmp_path):
    spec = StateSpec(type="index_state", path="s.sqlite")
    first = IndexState(spec, base_dir=tmp_path)
    first.record("docs", "fp", [doc("a", title="T")], chunks_of("a", 2, title="T"))
    first.set_meta("settings", "abc")
    # a second instance on the same file, while the first is still open (WAL readers)
    second = IndexState(spec, base_dir=tmp_path)
    assert second.sources() == {"a": ("hash-a-text", "fp")}
    assert second.generation == 1
    first.close()
    third = IndexState(spec, base_dir=tmp_path)
    assert third.chunk_ids() == {"a#0", "a#1"}
    assert third.get_meta("settings") == "abc"
    assert third.chunks_by_id(["a#1"])["a#1"]["title"] == "T"
    third.forget(["a"])
    assert second.sources() == {}
    assert second.generation == 2
    second.close()
    third.close()


def test_failed_transaction_rolls_back(state):
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    with pytest.raises(RuntimeError):
        with state.transaction() as tx:
            tx.execute("DELETE FROM chunks")
            raise RuntimeError("crash mid-write")
    assert state.chunk_ids() == {"a#0", "a#1"}
    # the connection is usable again afterwards
    state.record("o", "fp", [doc("b")], chunks_of("b"))
    assert state.counts() == (2, 4)


def test_record_is_atomic(state):
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    # the last chunk violates NOT NULL, in the same transaction as the source row
    bad = chunks_of("b") + [Chunk.model_construct(chunk_id="x", source_id="b", ordinal=2, text=None,
                                                  title="", metadata={})]
    with pytest.raises((sqlite3.IntegrityError, Exception), match="(?i)not.null"):
        state.record("o", "fp", [doc("b")], bad)
    assert set(state.sources()) == {"a"}
    assert state.chunk_ids() == {"a#0", "a#1"}
    assert state.generation == 1


def test_close_then_reuse_reopens(state):
    state.record("o", "fp", [doc("a")], chunks_of("a"))
    state.close()
    state.close()  # idempotent
    assert set(state.sources()) == {"a"}


def test_sources_indexed_since_counts_what_a_run_wrote_read_only(state, tmp_path):
    """What `GET /v1/runs/{id}` reports as documents_written: read through IndexState (issue 23), not
    by SQL of the API's own; a reader that never creates or changes the file."""
    import time

    state.record("docs", "fp", [doc("old")], chunks_of("old", 1))
    started = time.time()
    state.record("docs", "fp", [doc("a"), doc("b")], chunks_of("a", 1) + chunks_of("b", 1))
    reader = IndexState(state.spec, base_dir=tmp_path)
    try:
        assert reader.sources_indexed_since(started) == 2 and reader.sources_indexed_since(0) == 3
        assert reader.sources_indexed_since(time.time() + 1) == 0
    finally:
        reader.close()
    missing = IndexState(state.spec.model_copy(update={"path": "none.sqlite", "schema_name": new_schema()}),
                         base_dir=tmp_path)
    with pytest.raises(StoreMissing):
        missing.sources_indexed_since(0)
    assert not (tmp_path / "none.sqlite").exists()


def test_a_status_read_gives_up_on_a_committing_writer_and_holds_no_lock(state, tmp_path):
    """The CI failure of 501983c: a status poll queued on the shared reader (busy timeout 60 s) while
    a writer committed, and every later poll queued behind its lock. A ``wait`` read gives up in
    about that time, and the shared reader still answers once the writer is done."""
    import sqlite3
    import time

    if state.spec.url:
        pytest.skip("SQLite's rollback journal: a PostgreSQL reader never waits for a writer")
    state.record("docs", "fp", [doc("a")], chunks_of("a", 1))
    reader = IndexState(StateSpec(type="index_state", path="s.sqlite"), base_dir=tmp_path)
    writer = sqlite3.connect(tmp_path / "s.sqlite", isolation_level=None)
    try:
        writer.execute("BEGIN EXCLUSIVE")  # what a commit holds in rollback-journal mode
        began = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            reader.sources_indexed_since(0, wait=0.2)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            reader.lease_holder(wait=0.2)
        assert time.monotonic() - began < 5
        writer.execute("COMMIT")
        assert reader.sources_indexed_since(0, wait=0.2) == 1 and reader.lease_holder(wait=0.2) is None
        assert reader.sources_indexed_since(0) == 1
    finally:
        writer.close()
        reader.close()


def test_the_document_access_and_neighbourhood_methods(state):
    """The rest of the public methods, on both backends: documents, access (acls, readers, forget_access,
    regrant), renames, neighbourhoods, samples, snapshots and the integrity check."""
    a = doc("a").model_copy(update={"groups": ["staff"]})
    state.record("docs", "fp", [a, doc("b")], chunks_of("a", 3) + chunks_of("b", 1))
    assert [d[:3] + d[4:] for d in state.documents("docs")] == [("a", "docs", "", 3), ("b", "docs", "", 1)]
    assert state.documents("other") == [] and state.newest_indexed_at() > 0
    assert state.acls(["a", "b"]) == {"a": ("staff",), "b": ()} == state.readers("docs")
    state.forget_access(["a"])
    assert state.acls(["a"]) == {"a": None}
    state.regrant({"a": ("all",)})
    assert state.acls(["a"]) == {"a": ("all",)}
    assert state.chunks_by_id(["a#0"])["a#0"]["metadata"] == {"chunk": 0, "lang": "en", "ragline_acl.all": True}
    assert state.known(["a", "zzz"]) == {"a"} and set(state.sample_chunk_ids(10)) == state.chunk_ids()
    around = state.neighbourhoods(["a#1"], 1)
    assert [(cid, ordinal) for cid, ordinal, _ in around["a#1"]] == [("a#0", 0), ("a#1", 1), ("a#2", 2)]
    assert [r[0] for r in state.source_chunks(["b"])] == ["b#0"]
    renamed = doc("c")
    moved = [c.model_copy(update={"source_id": "c"}) for c in chunks_of("b", 1)]
    state.rename_sources({"b": renamed}, moved)
    assert set(state.sources()) == {"a", "c"} and state.chunks_by_id(["b#0"])["b#0"]["source_id"] == "c"
    generation, rows = state.snapshot()
    assert generation == state.generation and [r[0] for r in rows] == sorted(state.chunk_ids())
    assert state.quick_check() is None


def test_an_item_is_unchanged_only_when_all_its_sources_carry_its_signal(state):
    """A file and its records ('<file>#...') are skipped unread only when every one was recorded with
    the file's signal, fingerprint and pipeline; a sibling whose id shares a prefix is not one of them."""
    docs = [doc("notes/a.jsonl#1"), doc("notes/a.jsonl#2"), doc("notes/a.jsonl.bak"), doc("notes/b.md")]
    for d in docs:
        d.signal = "s1"
    docs[2].signal = "other"
    state.record("docs", "fp", docs, [])
    found = state.unchanged_items("docs", "fp", {"notes/a.jsonl": "s1", "notes/b.md": "s1", "notes/c.md": "s1"})
    assert set(found) == {"notes/a.jsonl", "notes/b.md"}
    assert [row[0] for row in found["notes/a.jsonl"]] == ["notes/a.jsonl#1", "notes/a.jsonl#2"]
    assert state.unchanged_items("docs", "fp2", {"notes/b.md": "s1"}) == {}  # another fingerprint: read it
    assert state.unchanged_items("other", "fp", {"notes/b.md": "s1"}) == {}  # another pipeline's
    generation = state.generation
    state.set_signals({"notes/a.jsonl#2": "s2"})  # one record's signal moved: the file is read again
    assert "notes/a.jsonl" not in state.unchanged_items("docs", "fp", {"notes/a.jsonl": "s1"})
    assert state.generation == generation  # a signal is no content: no new generation


def test_a_batch_of_items_reads_one_range_and_the_same_rows_when_other_rows_lie_between(state):
    """The batch's rows come from one range read; siblings sorting between an item and its records
    ('a.md!') are not its rows, and a batch spanning more other rows than the read's cap (another
    root's) gets the same answer from per-item reads."""
    docs = [doc("a.md"), doc("a.md!"), doc("a.md#1"), doc("z.md")] + [doc(f"m/{i:05d}.md") for i in range(1100)]
    for d in docs:
        d.signal = "s1"
    state.record("docs", "fp", docs, [])
    found = state.unchanged_items("docs", "fp", {"a.md": "s1", "z.md": "s1"})  # 1,100 rows between them
    assert {k: [r[0] for r in v] for k, v in found.items()} == {"a.md": ["a.md", "a.md#1"], "z.md": ["z.md"]}
    near = state.unchanged_items("docs", "fp", {"a.md": "s1", "a.md!": "s1", "m/00003.md": "s1"})
    assert {k: [r[0] for r in v] for k, v in near.items()} == {
        "a.md": ["a.md", "a.md#1"], "a.md!": ["a.md!"], "m/00003.md": ["m/00003.md"]}


def test_a_listings_rows_are_the_unchanged_items_rows_as_stored(state):
    """``unchanged_acls`` (what a listing asks of every file) answers as ``unchanged_items`` does, its
    rows (source_id, content_hash, acl) with the groups' text undecoded (None: unknown), over items
    whose records and prefix-sharing siblings interleave."""
    docs = [doc("a.md"), doc("a.md!"), doc("a.md#1"), doc("a.md#2"), doc("b.md"), doc("c.md"), doc("c.md#x")]
    for d in docs:
        d.signal, d.groups = "s1", ["hr", "eng"] if d.source_id.startswith("a") else []
    docs[6].signal = "s2"  # one record of c.md moved: c.md is read
    state.record("docs", "fp", docs, [])
    state.forget_access(["b.md"])
    signals = {"a.md": "s1", "a.md!": "s1", "b.md": "s1", "c.md": "s1", "d.md": "s1"}
    rows = state.unchanged_acls("docs", "fp", signals)
    assert rows == {"a.md": [("a.md", "hash-a.md-text", '["eng", "hr"]'), ("a.md#1", "hash-a.md#1-text", '["eng", "hr"]'),
                             ("a.md#2", "hash-a.md#2-text", '["eng", "hr"]')],
                    "a.md!": [("a.md!", "hash-a.md!-text", '["eng", "hr"]')], "b.md": [("b.md", "hash-b.md-text", None)]}
    full = state.unchanged_items("docs", "fp", signals)
    assert {k: [(r[0], r[1], r[4]) for r in v] for k, v in full.items()} == {
        k: [(sid, digest, None if acl is None else tuple(json.loads(acl))) for sid, digest, acl in v]
        for k, v in rows.items()}
    assert state.unchanged_acls("docs", "fp2", signals) == {} and state.unchanged_acls("docs", "fp", {}) == {}


def test_a_runs_listing_is_planned_in_sql_a_page_at_a_time(state):
    """Sources marked listed are never read back one by one: what is unlisted (gone or renamed) comes
    in id order a page at a time, for one pipeline; ``sources_of`` reads only the ids asked for."""
    state.record("docs", "fp", [doc(f"d{i:02d}") for i in range(12)], [])
    state.record("other", "fp", [doc("x1")], [])
    state.mark_listed("docs", [f"d{i:02d}" for i in range(12) if i not in (3, 7, 11)])
    assert state.listed_count("docs") == 9 and state.listed_count("other") == 0
    pages = list(state.unlisted_pages("docs", size=2))
    assert [[r[0] for r in page] for page in pages] == [["d03", "d07"], ["d11"]]
    assert pages[0][0] == ("d03", "hash-d03-text", "fp")
    assert set(state.sources_of(["d01", "x1", "nope"])) == {"d01", "x1"}
    assert set(state.sources_of(["d01", "x1"], origin="other")) == {"x1"}
    generation = state.generation
    state.clear_listed()
    assert state.listed_count("docs") == 0 and len(sum(state.unlisted_pages("docs", size=5), [])) == 12
    assert state.generation == generation  # a listing is no content: no new generation


def test_a_runs_work_list_is_kept_in_the_state_and_read_a_page_at_a_time(state):
    """The documents a listing queued to read (``queue``) come back whole, with the step that listed
    them, a page at a time in id order from any cursor, for one pipeline; they are no unlisted
    source (the plan does not take them for gone), leave with ``dequeue`` and with a new run's lease."""
    state.record("docs", "fp", [doc(f"d{i:02d}") for i in range(6)], [])
    queued = [doc(f"d{i:02d}", text="new") for i in (1, 3, 4)] + [doc("n1", text="")]
    queued[0].metadata = {"root": "notes", "_unread": "0:/x/d01"}
    queued[0].groups = ["staff"]
    queued[1].signal = "s2"
    state.queue("docs", "load", queued[:2])
    state.queue("docs", "load2", queued[2:])
    state.queue("other", "load", [doc("x9")])
    assert state.queued_count("docs") == 4 and state.queued_count("other") == 1
    pages = list(state.queued_pages("docs", size=3))
    assert [[(step, d.source_id) for step, d in page] for page in pages] == [
        [("load", "d01"), ("load", "d03"), ("load2", "d04")], [("load2", "n1")]]
    assert pages[0][0][1] == queued[0]  # the whole Document, metadata and groups included
    assert [d.source_id for _, d in next(state.queued_pages("docs", size=10, after="d03"))] == ["d04", "n1"]
    assert [r[0] for page in state.unlisted_pages("docs") for r in page] == ["d00", "d02", "d05"]
    generation = state.generation
    state.dequeue(["n1"])
    state.hold_signals(["d03"])  # unchanged, read this run: off the list, its signal kept for the end
    assert [d.source_id for page in state.queued_pages("docs") for _, d in page] == ["d01", "d04"]
    assert state.queued_count("docs") == 2 and state.unchanged_items("docs", "fp", {"d03": "s2"}) == {}
    state.record_held_signals("docs")  # at finalize: every batch is recorded
    assert set(state.unchanged_items("docs", "fp", {"d03": "s2"})) == {"d03"}
    state.clear_listed()
    assert state.queued_count("docs") == 0 and state.queued_count("other") == 0
    assert state.generation == generation  # a work list is no content: no new generation


def test_an_items_sources_are_read_with_their_hash_and_groups(state):
    """A JSONL file's records as recorded under one pipeline and fingerprint (versions compare with these)."""
    records = [doc("a.jsonl#1"), doc("a.jsonl#2"), doc("a.jsonl-b.md"), doc("a.jsonl")]
    records[1].groups = ["staff", "hr"]
    state.record("docs", "fp", records, [])
    found = state.item_sources("docs", "fp", "a.jsonl")
    assert found == {"a.jsonl": ("hash-a.jsonl-text", ()), "a.jsonl#1": ("hash-a.jsonl#1-text", ()),
                     "a.jsonl#2": ("hash-a.jsonl#2-text", ("hr", "staff"))}
    assert state.item_sources("docs", "fp2", "a.jsonl") == {} and state.item_sources("other", "fp", "a.jsonl") == {}


def test_a_journal_listed_root_reads_only_its_examined_items(state):
    """Under a root listed from its change journal (``mark_journaled``), only the examined items'
    sources (the item, its '#' records, a folder's sources below it) can be unlisted; the root's
    other sources count as listed. Other roots (and a root nested in a journal-listed one, and ids
    that only share its name's prefix) are read as before."""
    ids = ["docs/a.md", "docs/b.jsonl", "docs/b.jsonl#1", "docs/b.jsonl#2", "docs/sub/c.md", "docs/sub/d.md",
           "docs/z.md", "docs0.md", "docsx/e.md", "web/f.md", "web/g.md"]
    state.record("p", "fp", [doc(i) for i in ids], [])
    state.record("other", "fp", [doc("docs/elsewhere.md")], [])
    state.mark_listed("p", ["web/f.md"])
    state.mark_journaled("p", "docs", ["docs/b.jsonl", "docs/sub", "docs/gone.md"])
    unlisted = sorted(sid for page in state.unlisted_pages("p", size=2) for sid, *_ in page)
    assert unlisted == ["docs/b.jsonl", "docs/b.jsonl#1", "docs/b.jsonl#2", "docs/sub/c.md", "docs/sub/d.md",
                        "docs0.md", "docsx/e.md", "web/g.md"]
    # listed: web/f.md marked, docs/a.md and docs/z.md unexamined under the journal-listed root
    assert state.listed_count("p") == 3
    assert state.count_sources("p", "docs/b.jsonl") == 3 and state.count_sources("p", "docs/sub") == 2
    assert state.count_sources("p", "docs/gone.md") == 0 and state.count_sources("other", "docs") == 1
    state.clear_listed()
    assert sorted(sid for page in state.unlisted_pages("p") for sid, *_ in page) == ids


def test_nested_journal_listed_roots_are_merged(state):
    state.record("p", "fp", [doc(i) for i in ["docs/a.md", "docs/sub/b.md", "docs/t.md", "e.md"]], [])
    state.mark_journaled("p", "docs", [])
    state.mark_journaled("p", "docs/sub", [])
    assert sorted(sid for page in state.unlisted_pages("p") for sid, *_ in page) == ["e.md"]


def test_deferred_metadata_is_set_when_the_run_finishes(state):
    state.defer_meta("journal:p:docs", "vouched")
    assert state.get_meta("journal:p:docs") is None
    state.promote_deferred()
    assert state.get_meta("journal:p:docs") == "vouched"
    state.defer_meta("journal:p:docs", "again")
    state.clear_listed()  # a run that died: the next run's start drops what it deferred
    state.promote_deferred()
    assert state.get_meta("journal:p:docs") == "vouched"


def test_a_reader_follows_a_state_file_deleted_and_rebuilt_behind_it(tmp_path):
    """`ragline serve` reads the state for /readyz for hours: the file deleted, then rebuilt by
    `ragline index`, is read anew (was: the deleted inode, so a healthy store was reported down)."""
    spec = StateSpec(type="index_state", path=str(tmp_path / "state.sqlite"))
    writer = IndexState(spec)
    writer.record("index", "fp", [doc("a")], chunks_of("a"))
    writer.close()
    reader = IndexState(spec)
    assert reader.counts() == (1, 2)
    (tmp_path / "state.sqlite").unlink()
    rebuilt = IndexState(spec)
    rebuilt.record("index", "fp", [doc("a"), doc("b")], chunks_of("a") + chunks_of("b"))
    rebuilt.close()
    assert reader.counts() == (2, 4)
    (tmp_path / "state.sqlite").unlink()
    with pytest.raises(StoreMissing):
        reader.counts()
