"""The incremental BM25 index (segments + deletion bitmaps, flows.resources.bm25_segments): an update
costs what changed, and every answer equals a bm25s index built from scratch over the same chunks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources.stores import bm25 as bm25_module
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, MetadataIndex, in_memory, tokenize
from ragline.flows.resources.stores.state import IndexState, StateSpec

METHODS = ["lucene", "robertson", "atire", "bm25l", "bm25+"]
WORDS = ("mitochondria cell protein gene the of and volcanic sulfur penguin bird quantum particle entangled "
         "mitosis fission insulin receptor tumour virus immune response").split()
QUERIES = ["mitochondria protein", "volcanic sulfur penguin", "the cell cell gene", "quantum entangled particle",
           "immune virus response tumour", "zeppelin"]
WHERE = {"lang": "de"}


def open_state(folder: Path) -> IndexState:
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=folder)
    state.conn  # a writer, as every sync caller is
    return state


def put(state: IndexState, source: str, texts: list[str], lang: str = "en") -> None:
    """Replace ``source`` with these chunks, as the ingestion sink does (forget, then record)."""
    state.forget([source])
    digest = uuid.uuid4().hex[:6]
    chunks = [Chunk(chunk_id=f"{source}#{digest}{i}", source_id=source, ordinal=i, text=text,
                    metadata={"lang": lang, "n": i}) for i, text in enumerate(texts)]
    state.record("index", "fp", [Document(source_id=source, text=" ".join(texts), content_hash=digest)], chunks)


def make(folder: Path, path: str = "bm25", **spec) -> BM25Index:
    return BM25Index(BM25Spec(type="bm25", path=path, **spec), base_dir=folder)


def reference(rows, spec: BM25Spec, query: str, where: dict | None = None) -> dict[str, float]:
    """What bm25s built from scratch over ``rows`` scores each passage (the scores before this change)."""
    corpus = tokenize([r[1] for r in rows], spec.stemmer, spec.stopwords)
    if not any(corpus):  # bm25s cannot index a corpus without a term (the old build failed on it)
        return {}
    retriever = in_memory(corpus, spec)
    tokens = tokenize([query], spec.stemmer, spec.stopwords)[0]
    known = retriever.get_tokens_ids(tokens)
    if not known:
        return {}
    mask = None if where is None else np.array([all(r[2].get(k) == v for k, v in where.items()) for r in rows],
                                               dtype=np.float32)
    scores = retriever.get_scores_from_ids(known, weight_mask=mask)
    return {r[0]: float(s) for r, s in zip(rows, scores) if s > 0}


def answered(index: BM25Index, query: str, where: dict | None = None) -> dict[str, float]:
    [hits] = index.search([query], k=10**6, where=where)
    return {cid: score for cid, score, _ in hits}


def assert_same_scores(index: BM25Index, state: IndexState) -> None:
    rows = state.chunk_rows()
    for query in QUERIES:
        for where in (None, WHERE):
            want, got = reference(rows, index.spec, query, where), answered(index, query, where)
            assert got.keys() == want.keys(), (query, where)
            for cid in want:  # computed as bm25s computes them: equal, not merely close
                assert got[cid] == pytest.approx(want[cid], rel=1e-6, abs=1e-7), (query, where, cid)


texts = st.lists(st.lists(st.sampled_from(WORDS), min_size=0, max_size=12).map(" ".join), min_size=1, max_size=3)
operation = st.tuples(st.sampled_from(["put", "put", "delete"]), st.integers(0, 7), texts,
                      st.sampled_from(["en", "de"]))
runs = st.lists(st.lists(operation, min_size=1, max_size=4), min_size=1, max_size=5)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=runs)
def test_incremental_index_scores_as_a_full_rebuild_does(method, history):
    """Random adds, deletes and replaces over several runs, synced after each: every query and filter
    answers with the scores of bm25s built from scratch over the final chunks (all five variants)."""
    with tempfile.TemporaryDirectory() as folder:
        state, index = open_state(Path(folder)), make(Path(folder), method=method)
        for run in history:
            for op, source, chunks, lang in run:
                if op == "put":
                    put(state, f"s{source}", chunks, lang)
                else:
                    state.forget([f"s{source}"])
            index.sync(state)
            assert index.published_version()["generation"] == state.generation
            assert sorted(index.published_ids()) == sorted(r[0] for r in state.chunk_rows())
            assert_same_scores(index, state)
        state.close()


def test_an_incremental_sync_never_reads_every_chunk_row(tmp_path, monkeypatch):
    state, index = open_state(tmp_path), make(tmp_path)
    for s in range(30):
        put(state, f"s{s}", [f"mitochondria protein passage {s}", f"volcanic sulfur {s}"])
    index.sync(state)  # the first build reads them all
    monkeypatch.setattr(IndexState, "chunk_rows", lambda self: pytest.fail("read every chunk row"))
    monkeypatch.setattr(IndexState, "snapshot", lambda self: pytest.fail("read every chunk row"))
    gone = state.chunk_ids(["s3", "s4"])
    put(state, "s3", ["penguin bird of the south"])
    state.forget(["s4"])
    assert index.sync(state) is True
    manifest = index._current()
    assert [segment.docs for segment in manifest.segments] == [60, 1]  # the change is one small segment
    assert manifest.live_count == 60 - 2 - 2 + 1
    assert answered(index, "penguin").keys() == {next(iter(state.chunk_ids(["s3"])))}
    assert not gone & answered(index, "volcanic sulfur protein").keys()  # replaced and deleted chunks are gone
    monkeypatch.undo()
    assert_same_scores(index, state)


def test_search_weighted_and_document_frequencies_follow_the_live_chunks(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    put(state, "a", ["mitochondria protein", "mitochondria gene"])
    put(state, "b", ["protein gene gene"])
    index.sync(state)
    put(state, "a", ["mitochondria virus"])
    index.sync(state)
    assert index.document_frequencies(["mitochondria", "gene", "protein", "zeppelin"]) == \
        ({"mitochondria": 1, "gene": 1, "protein": 1}, 2)
    assert index.count(None) == 2 and index.count({"n": 0}) == 2
    rows = state.chunk_rows()
    retriever = in_memory(tokenize([r[1] for r in rows]), index.spec)
    weights = {"mitochondria": 0.7, "gene": 0.2, "zeppelin": 1.0}
    want = np.zeros(len(rows))
    for term, weight in weights.items():
        if term in retriever.vocab_dict:
            want += weight * retriever.get_scores_from_ids([retriever.vocab_dict[term]])
    [hits] = index.search_weighted([weights], k=10)
    assert {cid: score for cid, score, _ in hits} == pytest.approx({r[0]: s for r, s in zip(rows, want) if s > 0})


def test_a_reader_keeps_its_generation_while_a_writer_publishes(tmp_path):
    state, writer = open_state(tmp_path), make(tmp_path)
    put(state, "a", ["penguin bird"])
    writer.sync(state)
    writer.GRACE_SECONDS = 0  # nothing spared: the reader's files may be unlinked under it
    reader = make(tmp_path)
    tokens = reader.terms(["penguin"])[0]
    held = reader._current()  # a query in flight holds the version it started with
    before = held.scores(tokens)
    stop, errors = threading.Event(), []

    def query() -> None:
        while not stop.is_set():
            try:
                [hits] = reader.search(["penguin"], k=5)
                assert len(hits) >= 1
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=query) for _ in range(2)]
    for thread in threads:
        thread.start()
    for i in range(15):
        put(state, f"n{i}", [f"penguin bird number{i}"])
        if i % 3 == 0:
            put(state, "a", [f"penguin bird version{i}"])
        writer.sync(state)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert np.array_equal(held.scores(tokens), before) and held.ids == ["a#" + held.ids[0][2:]]
    assert len(reader.search(["penguin"], k=50)[0]) == 16
    assert_same_scores(reader, state)


CRASH = r"""
import sys
from pathlib import Path
from tests.flows.resources.stores.test_bm25_segments import make, open_state, put
folder = Path(sys.argv[1])
state, index = open_state(folder), make(folder)
put(state, "late", ["penguin bird of the crash"])
index.sync(state)  # killed at bm25.before_pointer
"""


def test_a_crash_before_the_pointer_leaves_the_old_version(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    put(state, "a", ["mitochondria protein"])
    put(state, "b", ["penguin bird"])
    index.sync(state)
    published = index.published_version()
    state.close()
    repo = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(repo),
                                                RAGLINE_FAILPOINTS="bm25.before_pointer"))
    assert done.returncode == -9, done.stderr[-2000:]
    fresh = make(tmp_path)
    assert fresh.published_version() == published
    assert set(answered(fresh, "penguin")) == set(state.chunk_ids(["b"]))
    state = open_state(tmp_path)
    assert fresh.lags(state) and fresh.sync(state)  # the next run publishes the change
    assert_same_scores(fresh, state)


def test_merges_bound_the_segments_and_keep_the_scores(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path, method="bm25+")
    for s in range(20):
        put(state, f"s{s}", [f"mitochondria cell gene {s}", "volcanic sulfur the"])
    index.sync(state)
    for run in range(30):
        put(state, f"s{run % 7}", [f"penguin bird gene run{run}"])  # replaces: deletions in old segments
        put(state, f"new{run}", ["quantum particle", "immune virus response"])
        index.sync(state)
        manifest = index._current()
        assert len(manifest.segments) <= index.MAX_SEGMENTS
        assert all(s.docs - s.live <= index.DELETED_SHARE * s.docs or s.docs <= 1 for s in manifest.segments)
    assert_same_scores(index, state)


def test_force_rebuilds_into_one_segment(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    for s in range(5):
        put(state, f"s{s}", ["mitochondria", "penguin"])
        index.sync(state)
    assert len(index._current().segments) > 1
    assert index.sync(state, force=True)
    assert len(index._current().segments) == 1
    assert_same_scores(index, state)


def test_a_state_edited_behind_the_log_is_rebuilt_in_full(tmp_path):
    """The change log cannot reach the published version (a new state file, a pruned log): full rebuild."""
    state, index = open_state(tmp_path), make(tmp_path)
    put(state, "a", ["penguin bird"])
    index.sync(state)
    state.close()
    (tmp_path / "state.sqlite").unlink()  # moved aside: re-indexed from scratch, its generation restarts
    state = open_state(tmp_path)
    for s in ("b", "c"):
        put(state, s, ["mitochondria protein"])
    put(state, "d", ["volcanic"])
    index.sync(state)
    assert sorted(index.published_ids()) == sorted(r[0] for r in state.chunk_rows())
    assert_same_scores(index, state)


def test_old_versions_and_unreferenced_segments_are_cleaned_up(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    index.GRACE_SECONDS = 0
    for s in range(12):
        put(state, f"s{s}", ["mitochondria", "penguin"])
        index.sync(state)
    kept = {p.name for p in index.path.iterdir() if p.is_dir()}
    manifest = index._current()
    assert kept == manifest.folders()  # only what the published version reads
    assert_same_scores(make(tmp_path), state)


# ----------------------------------------------------------------------------- the change log in the state
def test_the_state_logs_every_changed_chunk_with_its_generation(tmp_path):
    state = open_state(tmp_path)
    put(state, "a", ["one", "two"])
    first, gone = state.generation, state.chunk_ids(["a"])
    put(state, "b", ["three"])
    state.forget(["a"])
    log = state.chunk_log_id()
    changes = state.chunk_changes(since=first, log_id=log)
    assert changes.generation == state.generation and changes.chunks == 1
    assert changes.rows == state.chunk_rows()  # present now: with their rows
    assert changes.changed == state.chunk_ids(["b"]) | gone  # and the deleted ones by id
    assert state.chunk_changes(since=first, log_id="another state's") is None
    state.prune_chunk_changes(state.generation)
    assert state.chunk_changes(since=first, log_id=log) is None  # pruned past: the caller rebuilds in full
    now = state.chunk_changes(since=state.generation, log_id=log)
    assert (now.rows, now.changed) == ([], set())
    assert state.chunk_changes(since=state.generation + 1, log_id=log) is None  # a generation never reached


# ----------------------------------------------------------------------------- the upgrade path
def publish_legacy(index: BM25Index, rows, generation: int) -> None:
    """A version as the code before segments published it: one folder of bm25s files."""
    import bm25s

    version = f"v-{generation}-legacy00"
    folder = index.path / version
    folder.mkdir(parents=True)
    retriever = bm25s.BM25(k1=index.spec.k1, b=index.spec.b, method=index.spec.method)
    retriever.index(tokenize([r[1] for r in rows]), show_progress=False)
    retriever.save(str(folder), show_progress=False)
    (folder / "ids.json").write_text(json.dumps([r[0] for r in rows]))
    meta = [{**r[2], "text": r[1]} for r in rows]
    (folder / "meta.json").write_text(json.dumps(meta))
    MetadataIndex.build(meta).save(folder)
    (index.path / index.POINTER).write_text(json.dumps({"version": version, "generation": generation,
                                                       "settings": index.settings, "count": len(rows)}))


def test_a_version_published_before_segments_still_answers_and_the_next_sync_converts_it(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    for s in range(4):
        put(state, f"s{s}", [f"mitochondria protein {s}", "penguin bird"], lang="de" if s % 2 else "en")
    publish_legacy(index, state.chunk_rows(), state.generation)
    assert not index.lags(state) and index.problem(state) is None
    assert_same_scores(index, state)
    assert index.count(WHERE) == 4 and sorted(index.published_ids()) == sorted(state.chunk_ids())
    assert index.document_frequencies(["penguin"]) == ({"penguin": 4}, 8)
    put(state, "s1", ["volcanic sulfur"])
    assert index.sync(state)
    assert (index.path / index.published_version()["version"] / "manifest.json").is_file()
    assert_same_scores(index, state)


@pytest.mark.parametrize("method", ["robertson", "lucene", "atire", "bm25l", "bm25+"])
def test_the_restated_formulas_are_bm25s_own(method):
    """Scores are computed from raw term frequencies with bm25s.scoring's idf and tf functions,
    restated so that a query does not import bm25s: equal, value for value, to the package's."""
    from bm25s import scoring

    from ragline.flows.resources.stores import bm25_segments

    ours = bm25_segments.scorer(method, 1.2, 0.75)
    idf, tfc = scoring._select_idf_scorer(method), scoring._select_tfc_scorer(method)
    for n, df in [(1, 1), (10, 1), (10, 5), (10, 10), (5183, 3), (5183, 4000)]:
        assert ours.idf(df, N=n) == idf(df, N=n)
    tf = np.array([0, 1, 2, 7, 40], dtype=np.float32)
    lengths = np.array([1, 12, 80, 300, 3], dtype=np.float32)
    for k1, b in [(1.2, 0.75), (0.9, 0.4), (2.0, 1.0), (1.5, 0.0)]:
        for avg in (np.float64(1.0), np.float64(57.3)):
            np.testing.assert_array_equal(ours.tfc(tf_array=tf, l_d=lengths, l_avg=avg, k1=k1, b=b, delta=0.5),
                                          tfc(tf_array=tf, l_d=lengths, l_avg=avg, k1=k1, b=b, delta=0.5))


def test_a_deleted_segment_is_reported_and_rebuilt(tmp_path):
    state, index = open_state(tmp_path), make(tmp_path)
    put(state, "a", ["penguin bird"])
    index.sync(state)
    put(state, "b", ["mitochondria protein"])
    index.sync(state)
    older = index._current().segments[0].segment.folder
    assert older.name != index.published_version()["version"]
    shutil.rmtree(older)
    assert f"the published version {older} is missing" in index.problem(state)
    assert index.lags(state) and index.sync(state)  # rebuilt whole from the state
    assert len(index._current().segments) == 1
    assert_same_scores(make(tmp_path), state)


@pytest.mark.parametrize("method", ["lucene", "bm25+"])
def test_a_full_build_is_written_batch_by_batch_and_scores_as_one(tmp_path, monkeypatch, method):
    """A full build tokenizes ``build_batch`` passages at a time, each batch its own segment, reading the
    state in pages (never every row at once); the scores are those of one index over every chunk, and
    incremental runs after it merge only the small segments they add, never the build's."""
    state, index = open_state(tmp_path), make(tmp_path, method=method, build_batch=8)
    for s in range(25):
        put(state, f"s{s}", [f"mitochondria cell gene {s}", "volcanic sulfur the", f"penguin {WORDS[s % 20]}"],
            "de" if s % 3 else "en")
    monkeypatch.setattr(IndexState, "chunk_rows", lambda self: pytest.fail("read every chunk row at once"))
    pages = []
    real = IndexState.chunk_row_pages
    monkeypatch.setattr(IndexState, "chunk_row_pages",
                        lambda self, size=5: (pages.append(len(p)) or p for p in real(self, 5)))
    tokenized = []
    real_tokenize = BM25Index._tokenize
    monkeypatch.setattr(BM25Index, "_tokenize", lambda self, texts: tokenized.append(len(texts)) or
                        real_tokenize(self, texts))
    index.sync(state)
    assert pages == [5] * 15 and max(tokenized) == 8  # 75 chunks: 15 pages; no batch over 8 passages
    assert [s.docs for s in index._current().segments] == [8] * 9 + [3]
    monkeypatch.undo()
    assert_same_scores(index, state)
    assert sorted(index.published_ids()) == sorted(r[0] for r in state.chunk_rows())
    for run in range(12):  # small runs: their segments merge among themselves, the build's stay apart
        put(state, f"n{run}", ["quantum particle"])
        index.sync(state)
        sizes = [s.docs for s in index._current().segments]
        assert sizes.count(8) == 9 and sum(1 for n in sizes if n < 4) <= index.MAX_SEGMENTS
    assert_same_scores(index, state)


def test_a_failed_full_build_removes_the_segments_it_wrote(tmp_path, monkeypatch):
    state, index = open_state(tmp_path), make(tmp_path, build_batch=4)
    for s in range(6):
        put(state, f"s{s}", ["mitochondria cell", "volcanic sulfur"])
    real = IndexState.chunk_row_pages

    def failing(self, size=5_000):
        for number, page in enumerate(real(self, 3)):
            if number == 3:
                raise OSError("disk went away")
            yield page
    monkeypatch.setattr(IndexState, "chunk_row_pages", failing)
    with pytest.raises(OSError):
        index.sync(state)
    assert index.published_version() is None
    assert not [p for p in (tmp_path / "bm25").iterdir() if p.name.startswith("v-")]
