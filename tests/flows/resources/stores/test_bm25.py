"""Unit tests for the published bm25s index (flows.resources.bm25), built in tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.state import IndexState, StateSpec

ROWS = [
    ("c1", "The mitochondria is the powerhouse of the cell and produces ATP.", {"lang": "en", "year": 2019}),
    ("c2", "Volcanic eruptions release sulfur dioxide into the stratosphere.", {"lang": "en", "year": 2020}),
    ("c3", "Penguins are flightless birds living in the southern hemisphere.", {"lang": "en", "year": 2021}),
    ("c4", "Der Vulkan Ausbruch setzt Schwefeldioxid frei.", {"lang": "de", "year": 2020}),
    ("c5", "Quantum entanglement links the states of distant particles.", {"lang": "en", "year": 2022}),
    ("c6", "Cells divide by mitosis; mitochondria divide by fission.", {"lang": "en", "year": 2018}),
]


def make(tmp_path, **spec) -> BM25Index:
    return BM25Index(BM25Spec(type="bm25", path="b", **spec), base_dir=tmp_path)


@pytest.fixture
def index(tmp_path):
    idx = make(tmp_path)
    assert idx.build(ROWS, generation=1, settings="s1") == len(ROWS)
    return idx


def ids(hits):
    return [h[0] for h in hits]


def test_search_ranks_matching_passage_first(index):
    [volcano], [penguin] = index.search(["volcanic eruption sulfur dioxide"], k=3), \
        index.search(["flightless penguins"], k=3)
    assert volcano[0][0] == "c2"
    assert penguin[0][0] == "c3"
    assert penguin == sorted(penguin, key=lambda h: -h[1])
    assert all(score > 0 for _, score, _ in volcano + penguin)


def test_stemming_matches_inflected_forms(index):
    # "erupting" and "eruptions" share the stem "erupt" with the English stemmer
    [hits] = index.search(["erupting"], k=3)
    assert ids(hits) == ["c2"]


def test_hits_carry_metadata_and_text(index):
    [hits] = index.search(["penguins"], k=5)
    cid, score, meta = hits[0]
    assert cid == "c3"
    assert meta == {"lang": "en", "year": 2021, "text": ROWS[2][1]}
    assert isinstance(score, float)


def test_one_result_list_per_query_in_order(index):
    results = index.search(["quantum particles", "mitochondria", "penguins"], k=2)
    assert [r[0][0] for r in results] == ["c5", results[1][0][0], "c3"]
    assert set(ids(results[1])) == {"c1", "c6"}


def test_k_limits_results_and_only_positive_scores_are_returned(index):
    [hits] = index.search(["mitochondria"], k=1)
    assert len(hits) == 1
    [hits] = index.search(["mitochondria"], k=100)  # k larger than the index
    assert set(ids(hits)) == {"c1", "c6"}  # documents without any query term score 0 and are dropped


def test_where_filters_on_metadata(index):
    [hits] = index.search(["volcano sulfur dioxide Vulkan Schwefeldioxid"], k=5, where={"lang": "de"})
    assert ids(hits) == ["c4"]
    [hits] = index.search(["mitochondria"], k=5, where={"year": {"$gte": 2019}})
    assert ids(hits) == ["c1"]
    [hits] = index.search(["mitochondria"], k=5,
                          where={"$or": [{"year": {"$lt": 2019}}, {"lang": "de"}]})
    assert ids(hits) == ["c6"]


def test_where_matching_nothing(index):
    assert index.search(["mitochondria", "penguins"], k=5, where={"lang": "fr"}) == [[], []]


def test_where_on_the_text_field(index):
    # the text is stored beside the metadata, so it can be filtered on as well
    [hits] = index.search(["mitochondria"], k=5, where={"text": ROWS[5][1]})
    assert ids(hits) == ["c6"]


def test_no_published_index(tmp_path):
    idx = make(tmp_path)
    assert idx.published_version() is None
    assert idx.search(["anything", "else"], k=5) == [[], []]


def test_empty_index(tmp_path):
    idx = make(tmp_path)
    assert idx.build([], generation=3, settings="s") == 0
    assert idx.published_version()["count"] == 0
    assert idx.search(["anything"], k=5) == [[]]
    assert idx.search(["anything"], k=5, where={"lang": "en"}) == [[]]


def test_query_of_only_stopwords(index):
    assert index.search(["the and of", "is it"], k=5) == [[], []]
    # mixed with a real query, the real one still answers
    stop, real = index.search(["the of", "penguins"], k=5)
    assert stop == [] and ids(real) == ["c3"]


def test_query_of_unknown_words(index):
    assert index.search(["xylophone zeppelin"], k=5) == [[]]
    assert ids(index.search(["xylophone penguins"], k=5)[0]) == ["c3"]


def test_stopwords_none_keeps_them(tmp_path):
    idx = make(tmp_path, stopwords="none")
    idx.build(ROWS, generation=1, settings="s")
    [hits] = idx.search(["the"], k=10)
    assert set(ids(hits)) >= {"c1", "c2", "c5"}


def test_pointer_records_generation_settings_and_count(index):
    info = index.published_version()
    assert info["generation"] == 1
    assert info["settings"] == "s1"
    assert info["count"] == len(ROWS)
    assert info["version"].startswith("v-1-")
    on_disk = json.loads((index.path / BM25Index.POINTER).read_text())
    assert on_disk == info
    folder = index.path / info["version"]
    assert json.loads((folder / "ids.json").read_text()) == [r[0] for r in ROWS]


def test_new_generation_replaces_old_version(tmp_path, index):
    old = index.published_version()["version"]
    [before] = index.search(["penguins"], k=5)
    assert ids(before) == ["c3"]

    index.GRACE_SECONDS = 0  # no grace: the replaced version goes at once
    other = make(tmp_path)  # a second instance on the same folder (e.g. the query process)
    assert ids(other.search(["penguins"], k=5)[0]) == ["c3"]

    new_rows = [("n1", "Glaciers retreat as penguins lose their breeding grounds.", {"lang": "en"}),
                ("n2", "Solar panels convert sunlight into electricity.", {"lang": "en"})]
    assert index.build(new_rows, generation=2, settings="s2") == 2
    info = index.published_version()
    assert info["generation"] == 2 and info["settings"] == "s2" and info["count"] == 2
    assert info["version"] != old
    versions = sorted(p.name for p in index.path.iterdir() if p.is_dir())
    assert versions == [info["version"]]  # the old version folder is gone
    assert not any(p.name.startswith(f"{BM25Index.POINTER}.tmp") for p in index.path.iterdir())

    # both the builder and the other instance now answer from the new version
    assert ids(index.search(["penguins"], k=5)[0]) == ["n1"]
    assert ids(other.search(["penguins"], k=5)[0]) == ["n1"]
    assert ids(other.search(["solar electricity"], k=5)[0]) == ["n2"]
    assert other.search(["mitochondria"], k=5) == [[]]


def test_rebuild_with_same_generation_still_gets_a_new_version(index):
    first = index.published_version()["version"]
    index.build(ROWS[:2], generation=1, settings="s1")
    assert index.published_version()["version"] != first
    assert index.published_version()["count"] == 2


def test_settings_change_ranking_parameters(tmp_path):
    # b=0 switches off length normalisation: a long document with the term once scores like a short one
    long_text = "penguins " + " ".join(f"filler{i}" for i in range(60))
    rows = [("short", "penguins", {}), ("long", long_text, {})]
    plain = make(tmp_path / "one", b=0.75)
    flat = make(tmp_path / "two", b=0.0)
    plain.build(rows, 1, "a")
    flat.build(rows, 1, "b")
    [p] = plain.search(["penguins"], k=2)
    [f] = flat.search(["penguins"], k=2)
    assert p[0][0] == "short" and p[0][1] > p[1][1]
    assert f[0][1] == pytest.approx(f[1][1])


def test_spec_validation_and_fingerprint():
    with pytest.raises(ValueError):
        BM25Spec(type="bm25", k1=0)
    with pytest.raises(ValueError):
        BM25Spec(type="bm25", b=1.5)
    with pytest.raises(ValueError):
        BM25Spec(type="bm25", method="tfidf")
    fields = BM25Index.fingerprint_fields(BM25Spec(type="bm25", path="x"))
    assert "path" not in fields and "type" not in fields
    assert fields["k1"] == 1.2 and fields["stemmer"] == "english"


# ----------------------------------------------------------------------------- versions and cleanup
def versions(index: BM25Index) -> list[str]:
    return sorted(p.name for p in index.path.iterdir() if p.is_dir())


def age(folder: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(folder, (past, past))


def test_cleanup_spares_young_versions_and_the_published_one(tmp_path):
    index = make(tmp_path)
    index.build(ROWS[:2], 1, "s")
    first = index.published_version()["version"]
    index.build(ROWS[:3], 2, "s")
    second = index.published_version()["version"]
    assert versions(index) == sorted([first, second])  # the replaced one is young: kept for now

    crashed = index.path / "v-9-deadbeef"  # left by a build that died before publishing
    crashed.mkdir()
    for folder in (index.path / first, index.path / second, crashed):
        age(folder, index.GRACE_SECONDS + 60)
    index.build(ROWS, 3, "s")
    third = index.published_version()["version"]
    assert versions(index) == [third]

    age(index.path / third, index.GRACE_SECONDS + 60)
    index._remove_stale()  # an old folder that is still published is never removed
    assert versions(index) == [third]
    assert ids(index.search(["penguins"], k=5)[0]) == ["c3"]


def test_reader_rereads_the_pointer_when_its_version_vanished(tmp_path, monkeypatch):
    index = make(tmp_path)
    index.build(ROWS[:1], 1, "s")
    stale = index.published_version()
    index.GRACE_SECONDS = 0
    index.build(ROWS, 2, "s")  # removes the first version
    reader = make(tmp_path)
    answers = iter([stale])
    real = reader.published_version
    monkeypatch.setattr(reader, "published_version", lambda: next(answers, None) or real())

    assert ids(reader.search(["penguins"], k=5)[0]) == ["c3"]  # read the pointer again, loaded the new one


# ----------------------------------------------------------------------------- sync with the state
@pytest.fixture
def state(tmp_path):
    """A state opened by a writer (sync's only callers are writers)."""
    st = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=tmp_path)
    st.conn
    yield st
    st.close()


def record(state: IndexState, rows) -> None:
    """Record one source per row, with the row as its only chunk (as the ingestion sink does)."""
    docs = [Document(source_id=f"src-{cid}", text=text, content_hash=cid) for cid, text, _ in rows]
    chunks = [Chunk(chunk_id=cid, source_id=f"src-{cid}", ordinal=0, text=text, metadata=meta)
              for cid, text, meta in rows]
    state.record("index", "fp", docs, chunks)


def test_sync_rebuilds_when_the_state_moved(tmp_path, state):
    index = make(tmp_path)
    record(state, ROWS[:3])
    calls = []
    assert index.lags(state)
    assert index.sync(state, on_rebuild=lambda: calls.append(1)) is True
    info = index.published_version()
    assert (info["generation"], info["settings"], info["count"]) == (state.generation, index.settings, 3)
    assert ids(index.search(["penguins"], k=5)[0]) == ["c3"]
    hit = index.search(["penguins"], k=5)[0][0]
    assert hit[2] == {"lang": "en", "year": 2021, "source_id": "src-c3", "title": "", "text": ROWS[2][1]}

    record(state, ROWS[4:5])  # an ingestion run that died before publishing
    assert index.lags(state)
    assert index.sync(state, on_rebuild=lambda: calls.append(2)) is True
    assert ids(index.search(["quantum entanglement"], k=5)[0]) == ["c5"]
    assert calls == [1, 2]


def test_sync_does_nothing_when_in_step(tmp_path, state):
    index = make(tmp_path)
    assert index.sync(state) is False  # empty state, nothing published: nothing to build
    assert not index.path.exists() or versions(index) == []
    record(state, ROWS)
    assert index.sync(state) is True
    version = index.published_version()["version"]
    assert index.sync(state, on_rebuild=lambda: pytest.fail("rebuilt an index in step")) is False
    assert index.published_version()["version"] == version
    assert not index.lags(state)


def test_sync_rebuilds_when_the_settings_changed(tmp_path, state):
    record(state, ROWS)
    make(tmp_path).sync(state)
    flat = make(tmp_path, b=0.0)
    assert flat.lags(state)
    assert flat.sync(state) is True
    assert flat.published_version()["settings"] == flat.settings != make(tmp_path).settings


def test_sync_after_the_state_emptied(tmp_path, state):
    index = make(tmp_path)
    record(state, ROWS)
    index.sync(state)
    state.forget([f"src-{cid}" for cid, _, _ in ROWS])
    assert index.sync(state) is True
    assert index.published_version()["count"] == 0
    assert index.search(["penguins"], k=5) == [[]]


def test_concurrent_syncs_rebuild_once(tmp_path, state):
    record(state, ROWS)
    index = make(tmp_path)
    rebuilt: list[bool] = []
    barrier = threading.Barrier(4)

    def query() -> None:
        barrier.wait()
        rebuilt.append(index.sync(state))

    threads = [threading.Thread(target=query) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(rebuilt) == [False, False, False, True]
    assert index.published_version()["generation"] == state.generation


BUILDER = """
import sys
from pathlib import Path
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec

base, worker, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
index = BM25Index(BM25Spec(type="bm25", path="b"), base_dir=base)
index.GRACE_SECONDS = 0  # no grace period: only the lock keeps the other builder's folder alive
for i in range(rounds):
    rows = [(f"w{worker}-{i}-{j}", f"penguins worker{worker} round{i} passage {j} " * 20, {"w": worker})
            for j in range(300)]
    index.build(rows, generation=worker * 1000 + i, settings="s")
    info = index.published_version()
    [hits] = index.search(["penguins"], k=3)
    assert len(hits) == 3, (info, hits)
print("ok")
"""


def test_two_processes_building_at_once_both_succeed(tmp_path):
    repo = Path(__file__).resolve().parents[4]
    env = dict(os.environ, PYTHONPATH=str(repo))
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), str(w), "15"], cwd=repo, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]

    index = make(tmp_path)
    info = index.published_version()
    assert info["generation"] in (1014, 2014) and info["count"] == 300
    assert versions(index) == [info["version"]]  # no grace: every other version was cleaned up
    assert len(index.search(["penguins"], k=5)[0]) == 5
