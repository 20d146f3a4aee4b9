"""A property of document access at the store level (issue 19 item 3): over random documents, groups,
client filters and queries, neither Chroma nor BM25 ever returns a chunk outside the principal's
groups, and a client's filter (an $or included) only narrows what the access allows. Real embedded
Chroma and bm25s, random small vectors: fast enough for many examples."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragline.flows.access import acl_metadata, readable, restrict
from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.filters import matches, normalize

GROUPS = ["hr", "eng", "sales", "ops:eu", "legal.x"]
WORDS = ["salary", "merge", "review", "budget", "holiday", "okapi", "server", "contract"]
DIMENSION = 8

documents = st.lists(st.tuples(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6),
                               st.sets(st.sampled_from(GROUPS), max_size=3),
                               st.sampled_from(["en", "de", "fr"])), min_size=1, max_size=25)
accesses = st.one_of(st.none(), st.frozensets(st.sampled_from(GROUPS + ["nobody"]), max_size=3))
client_filters = st.sampled_from([None, {"lang": "en"}, {"$or": [{"lang": "en"}, {"lang": "de"}]},
                                  {"lang": {"$ne": "fr"}}, {"$or": [{"lang": "fr"}, {"lang": {"$in": ["en", "de"]}}]}])
_names = itertools.count()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("access-stores")


def stores(folder, docs):
    """A fresh Chroma collection and BM25 index holding one chunk per document, with its access keys."""
    name = f"acl-{next(_names)}"
    store = ChromaStore(ChromaSpec(type="chroma", path="chroma", collection=name), base_dir=folder)
    sparse = BM25Index(BM25Spec(type="bm25", path=f"bm25/{name}"), base_dir=folder)
    rng = np.random.default_rng(len(docs))
    chunks, rows = [], []
    for i, (words, groups, lang) in enumerate(docs):
        meta = {"lang": lang, **acl_metadata(groups)}
        chunks.append(Chunk(chunk_id=f"c{i:03d}", source_id=f"s{i}", ordinal=0, text=" ".join(words), metadata=meta,
                            embedding=rng.normal(size=DIMENSION).tolist()))
        rows.append((f"c{i:03d}", " ".join(words), {**meta, "source_id": f"s{i}", "title": ""}))
    store.upsert(chunks)
    sparse.build(rows, 1, sparse.settings)
    return store, sparse, {c.chunk_id: c.metadata for c in chunks}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=documents, access=accesses, where=client_filters, words=st.lists(st.sampled_from(WORDS), min_size=1,
                                                                            max_size=3), k=st.integers(1, 30))
def test_no_store_returns_a_chunk_outside_the_principals_groups(folder, docs, access, where, words, k):
    store, sparse, metadata = stores(folder, docs)
    combined = normalize(restrict(where, access))
    allowed = {cid for cid, meta in metadata.items() if readable(meta, access) and (not where or matches(meta, where))}

    vector = np.random.default_rng(k).normal(size=(1, DIMENSION))
    dense = {p.chunk_id for p in store.query(vector, k, where=combined)[0]}
    [keyword] = sparse.search([" ".join(words)], k, where=combined)
    keyword_ids = {cid for cid, _, _ in keyword}

    assert dense <= allowed and keyword_ids <= allowed
    assert len(dense) == min(k, len(allowed))  # nothing it may read is held back (a small, exact collection)
    for cid in dense | keyword_ids:
        assert readable(metadata[cid], access)
