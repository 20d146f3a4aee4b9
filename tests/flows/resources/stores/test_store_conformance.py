"""The store roles (flows/resources/stores/protocols.py) and every backend that plays them (issue 37.1): each
implementation has the protocol's methods with its parameters, and the same behavioural cases run
against each one: a dense store (embedded Chroma, Milvus Lite) and a keyword index (BM25, Milvus
Lite). The Milvus cases start its embedded server, so they run with the integration tests."""
from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore, EmbedderMismatch
from ragline.flows.resources.stores.milvus import MilvusSpec, MilvusStore
from ragline.flows.resources.stores.protocols import DenseStore, SparseIndex

_names = itertools.count()
MILVUS = pytest.mark.integration
TEXTS = ["okapi grazes in the forest", "the narwhal swims under ice", "an otter floats on its back",
         "the okapi and the otter", "ice fishing in winter"]
LANGS = ["en", "de", "en", "fr", "en"]


def chunks(vectors: np.ndarray) -> list[Chunk]:
    return [Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=TEXTS[i], title=f"doc {i}",
                  metadata={"lang": LANGS[i], "n": i}, embedding=vectors[i].tolist()) for i in range(len(TEXTS))]


VECTORS = np.eye(5, 8, dtype=np.float32) + 0.05  # each chunk nearest its own axis


# ----------------------------------------------------------------------------- structure
def _members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


@pytest.mark.parametrize("protocol, implementation", [
    (DenseStore, ChromaStore), (DenseStore, MilvusStore), (SparseIndex, BM25Index), (SparseIndex, MilvusStore)])
def test_each_backend_has_the_roles_methods_with_their_parameters(protocol, implementation):
    for name in _members(protocol):
        wanted, found = inspect.getattr_static(protocol, name), inspect.getattr_static(implementation, name, None)
        assert found is not None, f"{implementation.__name__} lacks {name}"
        if isinstance(wanted, property):
            assert isinstance(found, property), f"{implementation.__name__}.{name} is not a property"
            continue
        given = list(inspect.signature(wanted).parameters.values())[1:]
        has = list(inspect.signature(found).parameters.values())[1:]
        assert [p.name for p in has[:len(given)]] == [p.name for p in given], f"{implementation.__name__}.{name}"
        assert all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in has[len(given):]), \
            f"{implementation.__name__}.{name} needs more than the role gives"
        kept = [(mine.default, role.default) for mine, role in zip(has, given) if role.default is not role.empty]
        assert all(mine == role for mine, role in kept), f"{implementation.__name__}.{name} changes a default"


# ----------------------------------------------------------------------------- dense stores
def _chroma(folder: Path) -> DenseStore:
    return ChromaStore(ChromaSpec(type="chroma", path="chroma", collection=f"conf{next(_names)}"), base_dir=folder)


def _milvus(folder: Path) -> DenseStore:
    return MilvusStore(MilvusSpec(type="milvus", uri="conformance.db", collection=f"conf{next(_names)}"), folder)


DENSE = [pytest.param(_chroma, id="chroma"), pytest.param(_milvus, id="milvus", marks=MILVUS)]


@pytest.fixture(params=DENSE)
def dense(request, tmp_path) -> Iterator[DenseStore]:
    store = request.param(tmp_path)
    store.upsert(chunks(VECTORS))
    yield store
    store.close()


def test_a_dense_store_plays_its_role(dense):
    assert isinstance(dense, DenseStore) and dense.location


def test_written_chunks_are_counted_listed_and_read_back(dense):
    assert dense.count() == 5 and dense.all_ids() == {f"c{i}" for i in range(5)}
    assert dense.present(["c1", "c9"]) == {"c1"}
    vectors = dense.vectors(["c2", "c9"])
    assert list(vectors) == ["c2"] and np.allclose(vectors["c2"], VECTORS[2], atol=1e-5)
    metadatas = dense.metadatas(["c3", "c9"])
    assert list(metadatas) == ["c3"] and metadatas["c3"]["lang"] == "fr"


def test_a_query_returns_the_nearest_first_within_k(dense):
    [passages] = dense.query(VECTORS[3:4], 2)
    assert [p.chunk_id for p in passages][0] == "c3" and len(passages) == 2
    assert passages[0].score >= passages[1].score and passages[0].text == TEXTS[3]


def test_a_filter_applies_before_k(dense):
    [passages] = dense.query(VECTORS[1:2], 3, where={"lang": "en"})
    assert [p.chunk_id for p in passages] and {p.chunk_id for p in passages} <= {"c0", "c2", "c4"}
    assert len(passages) == 3  # the nearest (c1, German) is filtered out, not counted
    [none] = dense.query(VECTORS[1:2], 3, where={"lang": "xx"})
    assert none == []


def test_an_upsert_of_a_known_id_replaces_it(dense):
    moved = VECTORS[0].copy()
    dense.upsert([Chunk(chunk_id="c1", source_id="s1", ordinal=0, text="replaced", metadata={"lang": "en", "n": 1},
                        embedding=moved.tolist())])
    assert dense.count() == 5 and dense.metadatas(["c1"])["c1"]["lang"] == "en"
    assert np.allclose(dense.vectors(["c1"])["c1"], moved, atol=1e-5)


def test_metadata_changes_in_place_and_deletes_forget(dense):
    dense.update_metadata({"c0": {"lang": "de"}})
    assert dense.metadatas(["c0"])["c0"]["lang"] == "de" and np.allclose(dense.vectors(["c0"])["c0"], VECTORS[0],
                                                                          atol=1e-5)
    dense.delete(["c0", "c9"])  # an absent id is no error
    assert dense.count() == 4 and "c0" not in dense.all_ids()


def test_the_embedder_is_recorded_and_another_refused(dense):
    dense.record_embedder("key-a", "model-a")
    assert dense.stored_embedder() == "key-a"
    dense.check_embedder("key-a", "model-a")
    with pytest.raises(EmbedderMismatch):
        dense.check_embedder("key-b", "model-b")


def test_scores_are_on_the_scale_of_the_querys_passages(dense):
    [passages] = dense.query(VECTORS[2:3], 1)
    rescored = dense.score(VECTORS[2], np.stack([dense.vectors(["c2"])["c2"]]))
    assert rescored.shape == (1,) and rescored[0] == pytest.approx(passages[0].score, abs=1e-4)


# ----------------------------------------------------------------------------- keyword indexes
class _State:
    """The index state's generation, as a keyword index's writer reads it."""
    generation = 1


def _bm25(folder: Path) -> SparseIndex:
    index = BM25Index(BM25Spec(type="bm25", path=f"bm25/conf{next(_names)}"), base_dir=folder)
    rows = [(c.chunk_id, c.text, {**c.metadata, "source_id": c.source_id, "title": c.title}) for c in chunks(VECTORS)]
    index.build(rows, 1, index.settings)
    return index


def _milvus_keywords(folder: Path) -> SparseIndex:
    store = _milvus(folder)
    store.upsert(chunks(VECTORS))
    store.sync(_State())
    return store


SPARSE = [pytest.param(_bm25, id="bm25"), pytest.param(_milvus_keywords, id="milvus", marks=MILVUS)]


@pytest.fixture(params=SPARSE)
def sparse(request, tmp_path) -> Iterator[SparseIndex]:
    index: Callable[[Path], SparseIndex] = request.param
    built = index(tmp_path)
    yield built
    built.close()


def test_a_keyword_index_plays_its_role(sparse):
    assert isinstance(sparse, SparseIndex) and sparse.location and isinstance(sparse.settings, str)


def test_a_keyword_search_finds_the_chunks_that_say_it_best_first(sparse):
    [hits] = sparse.search(["narwhal"], 5)
    assert [cid for cid, _, _ in hits] == ["c1"] and hits[0][2]["text"] == TEXTS[1]
    [both] = sparse.search(["okapi otter"], 5)
    assert both[0][0] == "c3" and {cid for cid, _, _ in both} == {"c0", "c2", "c3"}


def test_a_keyword_filter_applies_before_k(sparse):
    [hits] = sparse.search(["okapi otter"], 1, where={"lang": "en"})
    assert [cid for cid, _, _ in hits] in (["c0"], ["c2"])
    assert sparse.count({"lang": "en"}) == 3 and sparse.count(None) == 5


def test_terms_frequencies_and_weighted_queries_use_the_indexs_own_terms(sparse):
    [terms] = sparse.terms(["The okapi grazes"])
    assert terms and "the" not in terms
    frequencies, passages = sparse.document_frequencies(terms)
    assert passages == 5 and frequencies[terms[0]] == 2  # okapi: c0 and c3
    [hits] = sparse.search_weighted([{terms[0]: 1.0}], 5)
    assert {cid for cid, _, _ in hits} == {"c0", "c3"}


def test_the_published_version_is_what_was_written(sparse):
    assert sorted(sparse.published_ids()) == [f"c{i}" for i in range(5)]
    assert sparse.published_version() is not None and sparse.problem() is None
