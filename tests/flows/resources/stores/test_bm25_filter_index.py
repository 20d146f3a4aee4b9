"""BM25's metadata index (flows.resources.bm25.MetadataIndex): a filter answered by set algebra over
positions grouped by value must equal ``filters.matches`` run on every chunk, and a search must never
scan every chunk's metadata per query."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragline.flows.resources.stores import bm25
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, MetadataIndex
from ragline.flows.resources.stores.filters import FilterError, matches

KEYS = ["year", "lang", "score", "ragline_acl.staff", "text"]
BIG = 2**53  # past it, float64 no longer holds every integer: Python still compares int and float exactly
STORED = st.one_of(
    st.integers(-3, 3), st.booleans(),
    st.sampled_from([-1.5, -0.0, 0.0, 1.0, 2.5, math.inf, -math.inf, float(BIG), BIG, BIG + 1, 2**70]),
    st.builds(float, st.just("nan")),  # a new NaN each time, as json.loads makes them (``in`` tests identity first)
    st.sampled_from(["", "a", "b", "A", "ab", "1", "é", "a\x00"]),
    st.none(), st.lists(st.integers(0, 2), max_size=2), st.just({"nested": 1}),
)
COMPARED = st.one_of(  # what a validated filter compares, and (None, NaN) what validate refuses
    st.integers(-4, 4), st.booleans(), st.sampled_from([-1.5, 0.0, 0.5, 1.0, float(BIG), BIG, BIG + 1, 2**63 - 1]),
    st.sampled_from(["", "a", "b", "B", "ab", "1", "é"]),
    st.none(), st.builds(float, st.just("nan")),
)
FIELD = st.sampled_from(KEYS)
COMPARISON = st.sampled_from(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"])
LEAF = st.one_of(
    st.builds(lambda k, v: {k: v}, FIELD, COMPARED),
    st.builds(lambda k, ops: {k: ops}, FIELD, st.dictionaries(COMPARISON, COMPARED, max_size=2)),
    st.builds(lambda k, op, vs: {k: {op: vs}}, FIELD, st.sampled_from(["$in", "$nin"]),
              st.lists(COMPARED, max_size=3)),
)
WHERE = st.recursive(LEAF, lambda inner: st.one_of(
    st.builds(lambda op, cs: {op: cs}, st.sampled_from(["$and", "$or"]), st.lists(inner, max_size=3)),
    st.builds(lambda a, b: {**a, **b}, inner, inner),  # several keys in one mapping are ANDed
), max_leaves=6)
META = st.lists(st.dictionaries(FIELD, STORED, max_size=5), max_size=25)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=META, where=WHERE)
def test_index_answers_as_matches_does(meta, where):
    expected = [matches(m, where) for m in meta]
    assert MetadataIndex.build(meta).mask(where).tolist() == expected


GRID_STORED = [None, [1], True, False, -1, 0, 1, 2, 0.5, 1.0, float(BIG), BIG, BIG + 1, math.inf, "", "a", "b", "1"]
GRID_COMPARED = [True, False, -2, 0, 1, 2, 0.5, float(BIG), BIG + 1, -math.inf, "", "a", "ab", "1"]


@pytest.mark.parametrize("op", ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"])
def test_every_operator_on_every_pair_of_values(op):
    """Each operator, each stored value (and a missing key) against each compared value: the
    boundaries (equal values, int against float, bool against int, str against number) exactly."""
    meta = [{"x": v} for v in GRID_STORED] + [{}]
    index = MetadataIndex.build(meta)
    for value in GRID_COMPARED:
        where = {"x": {op: [value, "b"] if op in ("$in", "$nin") else value}}
        assert index.mask(where).tolist() == [matches(m, where) for m in meta], where


@pytest.mark.parametrize("stored, where, expected", [
    (True, {"x": 1}, True),  # True == 1 in Python, so in matches
    (1, {"x": True}, True),
    (0, {"x": {"$lt": True}}, True),
    (1.0, {"x": {"$in": [1]}}, True),
    ("1", {"x": 1}, False),  # a string never equals a number
    ("b", {"x": {"$gt": 1}}, False),  # and never orders with one (TypeError in matches: no match)
    (5, {"x": {"$gt": "a"}}, False),
    ("b", {"x": {"$ne": 1}}, True),
    (BIG + 1, {"x": {"$gt": float(BIG)}}, True),  # exact, although float(BIG + 1) == float(BIG)
    (float(BIG), {"x": {"$lt": BIG + 1}}, True),
    (math.nan, {"x": {"$ne": 1}}, True),  # NaN equals nothing, orders with nothing
    (math.nan, {"x": {"$gte": -math.inf}}, False),
    ([1], {"x": {"$nin": [1]}}, True),  # a list value is like a missing one
    (None, {"x": {"$ne": "a"}}, True),
])
def test_edge_values(stored, where, expected):
    meta = [{"x": stored}, {}]
    assert matches(meta[0], where) is expected
    assert MetadataIndex.build(meta).mask(where).tolist() == [expected, matches({}, where)]


def test_missing_key_never_equals_and_always_differs():
    index = MetadataIndex.build([{"a": 1}, {}])
    assert index.mask({"b": {"$eq": 1}}).tolist() == [False, False]
    assert index.mask({"b": {"$ne": 1}}).tolist() == [True, True]
    assert index.mask({"b": {"$nin": [1]}}).tolist() == [True, True]
    assert index.mask({"a": {"$ne": 1}}).tolist() == [False, True]


def test_unknown_operator_is_a_filter_error():
    index = MetadataIndex.build([{"a": 1}])
    with pytest.raises(FilterError, match=r"\$regex"):
        index.mask({"a": {"$regex": "x"}})
    with pytest.raises(FilterError, match=r"\$not"):
        index.mask({"$not": [{"a": 1}]})


def test_acl_or_of_booleans():
    meta = [{f"ragline_acl.g{g}": True for g in range(10) if (i >> g) & 1} for i in range(1024)]
    where = {"$or": [{"ragline_acl.g3": {"$eq": True}}, {"ragline_acl.g7": {"$eq": True}}]}
    mask = MetadataIndex.build(meta).mask(where)
    assert mask.tolist() == [matches(m, where) for m in meta] and mask.sum() == 1024 - 256


def test_index_holds_only_present_keys_in_int32():
    index = MetadataIndex.build([{"year": 2020 + i % 3, "lang": "en"} for i in range(100)] + [{"rare": 1}])
    assert set(index._columns) == {"year", "lang", "rare"}
    assert all(column.postings.dtype == np.int32 for column in index._columns.values())
    assert index._columns["rare"].postings.tolist() == [100]


ROWS = [(f"c{i}", f"mitochondria passage number {i}", {"lang": "de" if i % 4 == 0 else "en", "year": 2000 + i})
        for i in range(40)]


def test_search_never_scans_every_chunk(tmp_path, monkeypatch):
    """A validated filter is answered from the index: ``matches`` is not called once per chunk."""
    index = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    index.build(ROWS, generation=1, settings=index.settings)
    index.search(["warm"], 1)  # loads the version (and builds its metadata index)
    calls = []
    monkeypatch.setattr(bm25, "matches", lambda meta, where: calls.append(1) or matches(meta, where))
    [hits] = index.search(["mitochondria"], k=40, where={"$and": [{"lang": "de"}, {"year": {"$gte": 2010}}]})
    [weighted] = index.search_weighted([{"mitochondria": 1.0}], k=40, where={"lang": {"$ne": "en"}})
    assert calls == []
    assert sorted(h[0] for h in hits) == sorted(f"c{i}" for i in range(10, 40) if i % 4 == 0)
    assert sorted(h[0] for h in weighted) == sorted(f"c{i}" for i in range(40) if i % 4 == 0)


def test_filter_on_the_text_is_indexed_when_first_named(tmp_path):
    index = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    index.build(ROWS, generation=1, settings=index.settings)
    [hits] = index.search(["mitochondria"], k=5, where={"text": ROWS[7][1]})
    assert [h[0] for h in hits] == ["c7"]


def test_each_version_has_its_own_index(tmp_path):
    """A reader that loaded a version keeps answering from it while a writer publishes the next one;
    the next search answers from the new version's index, never a stale one."""
    index = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    index.build(ROWS, generation=1, settings=index.settings)
    old = index._current()
    assert index.search(["mitochondria"], k=5, where={"lang": "fr"}) == [[]]
    index.build(ROWS + [("c99", "mitochondria in French", {"lang": "fr", "year": 2030})], generation=2,
                settings=index.settings)
    [hits] = index.search(["mitochondria"], k=5, where={"lang": "fr"})
    assert [h[0] for h in hits] == ["c99"]
    assert not old.mask({"lang": "fr"}).any() and old.size == len(ROWS)


def test_saved_index_answers_as_the_built_one(tmp_path):
    meta = [{"x": v, "ragline_acl.g1": True} if i % 2 else {"x": v} for i, v in enumerate(GRID_STORED)] + [{}]
    MetadataIndex.build(meta).save(tmp_path)
    loaded = MetadataIndex.load(tmp_path, meta)
    for op in ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"):
        for value in GRID_COMPARED:
            where = {"$or": [{"x": {op: [value] if op in ("$in", "$nin") else value}}, {"ragline_acl.g1": True}]}
            assert loaded.mask(where).tolist() == [matches(m, where) for m in meta], where


def test_a_loaded_version_reads_its_saved_index(tmp_path, monkeypatch):
    """The index is written with the version; a reader loads it instead of rebuilding it."""
    writer = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    writer.build(ROWS, generation=1, settings=writer.settings)
    folder = tmp_path / "bm25" / writer.published_version()["version"]
    assert (folder / MetadataIndex.FILE).is_file()
    monkeypatch.setattr(MetadataIndex, "build", classmethod(lambda cls, meta: pytest.fail("rebuilt")))
    reader = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    [hits] = reader.search(["mitochondria"], k=40, where={"year": {"$lt": 2008}})
    assert sorted(h[0] for h in hits) == sorted(f"c{i}" for i in range(8))


@pytest.mark.parametrize("damage", ["missing", "garbage", "other version"])
def test_a_missing_or_damaged_saved_index_is_rebuilt(tmp_path, damage, caplog):
    writer = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    writer.build(ROWS, generation=1, settings=writer.settings)
    saved = tmp_path / "bm25" / writer.published_version()["version"] / MetadataIndex.FILE
    if damage == "missing":  # a version published before the index was saved with it
        saved.unlink()
    elif damage == "garbage":
        saved.write_bytes(b"PK\x03\x04 not a zip")
    else:  # a valid file over other chunks: positions would point past this version's
        MetadataIndex.build([{"year": 1}] * 100).save(saved.parent)
    reader = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    [hits] = reader.search(["mitochondria"], k=40, where={"year": {"$lt": 2008}})
    assert sorted(h[0] for h in hits) == sorted(f"c{i}" for i in range(8))
    assert ("is unreadable" in caplog.text) is (damage != "missing")
