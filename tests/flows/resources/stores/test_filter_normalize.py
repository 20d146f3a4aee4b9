"""normalize() turns any filter into the one-key-per-dict form Chroma accepts, keeping its meaning."""
from __future__ import annotations

import itertools

import pytest

from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.filters import matches, normalize

FILTERS = [
    {"lang": "en", "year": 2020},
    {"year": {"$gte": 2019, "$lt": 2021}},
    {"$and": [{"lang": "en"}]},
    {"$or": [{"lang": "en", "year": 2020}, {"lang": "de"}]},
    {"$and": [{"year": {"$gt": 2018, "$lte": 2020}}, {"$or": [{"lang": "de"}]}]},
]
METAS = [{"lang": lang, "year": year} for lang, year in itertools.product(["en", "de", "fr"], [2018, 2019, 2020, 2021])]


@pytest.mark.parametrize("where", FILTERS)
def test_same_meaning(where):
    assert [matches(m, where) for m in METAS] == [matches(m, normalize(where)) for m in METAS]


def test_shapes():
    assert normalize(None) is None and normalize({}) is None and normalize({"$and": []}) is None
    assert normalize({"a": 1}) == {"a": 1}
    assert normalize({"a": 1, "b": 2}) == {"$and": [{"a": 1}, {"b": 2}]}
    assert normalize({"$and": [{"a": 1}]}) == {"a": 1}
    assert normalize({"y": {"$gt": 1, "$lt": 3}}) == {"$and": [{"y": {"$gt": 1}}, {"y": {"$lt": 3}}]}


@pytest.mark.parametrize("where", FILTERS)
def test_chroma_accepts_and_agrees(where, tmp_path):
    import numpy as np

    from ragline.flows.contracts import Chunk

    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="filters"), base_dir=tmp_path)
    rng = np.random.default_rng(0)
    chunks = [Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text="t", metadata=m,
                    embedding=rng.normal(size=8).tolist()) for i, m in enumerate(METAS)]
    store.upsert(chunks)
    got = store.query(np.ones((1, 8), dtype=np.float32), k=len(METAS), where=normalize(where))[0]
    assert {p.chunk_id for p in got} == {c.chunk_id for c in chunks if matches(c.metadata, where)}
