"""Unit tests for the ``retrieve_dense`` and ``retrieve_sparse`` stages over a small real index."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, Query
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.filters import FilterError
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.tasks.retrieve.dense import Params, combined_filter, retrieve_dense
from ragline.tasks.retrieve.sparse import BEHIND, RESET, retrieve_sparse

CORPUS = [
    ("penguin", "Penguins are flightless seabirds that live in the southern hemisphere.", "en", 2021),
    ("volcano", "Volcanic eruptions inject sulfur dioxide into the stratosphere and cool the climate.", "en", 2019),
    ("mito", "Mitochondria produce most of the cell's supply of ATP through respiration.", "en", 2022),
    ("vulkan", "Vulkanausbrüche bringen Schwefeldioxid in die Stratosphäre.", "de", 2020),
    ("market", "Stock markets fell sharply after the central bank raised interest rates.", "en", 2020),
    ("penguin2", "Emperor penguins huddle together to survive the Antarctic winter.", "en", 2018),
]


@pytest.fixture(scope="module")
def chunks(minilm) -> list[Chunk]:
    items = [Chunk(chunk_id=cid, source_id=f"docs/{cid}.md", ordinal=0, text=text, title=cid.title(),
                   metadata={"lang": lang, "year": year, "chunk": 0})
             for cid, text, lang, year in CORPUS]
    vectors = minilm.encode_documents([c.text for c in items])
    return [c.model_copy(update={"embedding": v.tolist()}) for c, v in zip(items, vectors)]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("index")


# read-only for the tests below, so built once per module
@pytest.fixture(scope="module")
def store(index_dir, chunks) -> ChromaStore:
    s = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=index_dir)
    s.upsert(chunks)
    return s


def record(state: IndexState, chunks: list[Chunk]) -> None:
    """Record the chunks' sources in the state, as the ingestion sink does."""
    docs = [Document(source_id=c.source_id, text=c.text, title=c.title, content_hash=c.chunk_id) for c in chunks]
    state.record("index", "fp", docs, chunks)


def open_state(base_dir, path: str = "state.sqlite") -> IndexState:
    return IndexState(StateSpec(type="index_state", path=path), base_dir=base_dir)


@pytest.fixture(scope="module")
def state(index_dir, chunks) -> IndexState:
    st = open_state(index_dir)
    record(st, chunks)
    yield st
    st.close()


@pytest.fixture(scope="module")
def sparse(index_dir, state) -> BM25Index:
    index = BM25Index(BM25Spec(type="bm25", path="b"), base_dir=index_dir)
    assert index.sync(state)  # built from the state's rows: metadata plus source_id and title
    return index


def ctx(step_id: str) -> StepContext:
    return StepContext(pipeline="search", step_id=step_id)


def dense(query: Query, store, minilm, **params):
    return retrieve_dense.fn(query=query, params=Params(**params), ctx=ctx("dense"), store=store, embedder=minilm)


def sparse_search(query: Query, index, state=None, **params):
    state = state if state is not None else open_state(index.base_dir)  # the module's state, or an empty one
    return retrieve_sparse.fn(query=query, params=Params(**params), ctx=ctx("bm25"), sparse=index, state=state)


def ids(ranking) -> list[str]:
    return [p.chunk_id for p in ranking.passages]


def test_dense_ranking(store, minilm):
    [ranking] = dense(Query(text="birds that cannot fly"), store, minilm, k=3)
    assert ranking.retriever == "dense"
    assert ranking.query == "birds that cannot fly"
    assert ids(ranking)[0] == "penguin"
    assert len(ranking.passages) == 3
    top = ranking.passages[0]
    assert top.retriever == "dense"
    assert top.source_id == "docs/penguin.md" and top.title == "Penguin" and top.text == CORPUS[0][1]
    assert top.metadata == {"lang": "en", "year": 2021, "chunk": 0}
    scores = [p.score for p in ranking.passages]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1


def test_sparse_ranking(sparse):
    [ranking] = sparse_search(Query(text="volcanic eruptions sulfur dioxide"), sparse, k=3)
    assert ranking.retriever == "bm25"
    assert ids(ranking)[0] == "volcano"
    top = ranking.passages[0]
    assert top.retriever == "bm25"
    assert top.source_id == "docs/volcano.md" and top.title == "Volcano" and top.text == CORPUS[1][1]
    assert top.metadata == {"lang": "en", "year": 2019, "chunk": 0}  # text, title, source_id moved out
    assert top.score > 0


def test_one_ranking_per_variant(store, sparse, minilm):
    query = Query(text="original question", variants=["flightless seabirds", "stock market interest rates"])
    for rankings in (dense(query, store, minilm, k=2), sparse_search(query, sparse, k=2)):
        assert [r.query for r in rankings] == query.variants
        assert ids(rankings[0])[0] == "penguin"
        assert ids(rankings[1])[0] == "market"
    # without variants the text itself is searched, once
    assert [r.query for r in dense(Query(text="penguins"), store, minilm)] == ["penguins"]
    assert [r.query for r in sparse_search(Query(text="penguins"), sparse)] == ["penguins"]


def test_k_limits_passages(store, sparse, minilm):
    assert len(dense(Query(text="anything"), store, minilm, k=1)[0].passages) == 1
    assert len(dense(Query(text="anything"), store, minilm, k=50)[0].passages) == len(CORPUS)
    [r] = sparse_search(Query(text="penguins"), sparse, k=1)
    assert ids(r) == [ids(sparse_search(Query(text="penguins"), sparse, k=5)[0])[0]]


def test_params_where_is_anded_with_query_filters(store, sparse, minilm):
    query = Query(text="penguins volcanic eruptions sulfur stock markets mitochondria",
                  filters={"year": {"$gte": 2020}})
    expected = {"penguin", "mito", "market"}  # en and 2020 or later
    [d] = dense(query, store, minilm, k=10, where={"lang": "en"})
    assert set(ids(d)) == expected
    [s] = sparse_search(query, sparse, k=10, where={"lang": "en"})
    assert set(ids(s)) == expected
    # each filter alone lets more through
    assert set(ids(dense(query, store, minilm, k=10)[0])) == expected | {"vulkan"}
    assert set(ids(dense(Query(text=query.text), store, minilm, k=10, where={"lang": "en"})[0])) == \
        expected | {"volcano", "penguin2"}


def test_filters_on_source_id(store, sparse, minilm):
    query = Query(text="penguins", filters={"source_id": {"$in": ["docs/penguin2.md"]}})
    assert ids(dense(query, store, minilm, k=5)[0]) == ["penguin2"]
    assert ids(sparse_search(query, sparse, k=5)[0]) == ["penguin2"]


def test_filter_matching_nothing(store, sparse, minilm):
    query = Query(text="penguins", filters={"lang": "fr"})
    assert dense(query, store, minilm)[0].passages == []
    assert sparse_search(query, sparse)[0].passages == []


def test_empty_indexes(tmp_path, minilm):
    empty_store = ChromaStore(ChromaSpec(type="chroma", path="e", collection="empty"), base_dir=tmp_path)
    empty_bm25 = BM25Index(BM25Spec(type="bm25", path="eb"), base_dir=tmp_path)
    query = Query(text="x", variants=["a", "b"])
    assert [r.passages for r in dense(query, empty_store, minilm)] == [[], []]
    assert [r.passages for r in sparse_search(query, empty_bm25)] == [[], []]
    assert empty_bm25.published_version() is None  # an empty state publishes nothing


def test_sparse_reports_a_state_that_moved_without_a_publish_and_never_rebuilds(tmp_path, chunks, caplog):
    """Issue 16: a query never publishes BM25 (a query once published an empty version over a valid one)."""
    st = open_state(tmp_path)
    index = BM25Index(BM25Spec(type="bm25", path="b"), base_dir=tmp_path)
    record(st, chunks[:2])
    index.sync(st)
    published = index.published_version()
    # an ingestion run recorded new sources, then died before it published BM25
    record(st, [c for c in chunks if c.chunk_id in ("market", "mito")])
    with caplog.at_level("WARNING", logger="ragline.search.bm25"):
        [ranking] = sparse_search(Query(text="penguins"), index, st, k=3)
    assert ids(ranking) == ["penguin"]  # the published version answers
    assert [r.getMessage() for r in caplog.records] == [BEHIND]
    assert index.published_version() == published  # reported, not rebuilt
    st.close()


def test_changed_bm25_settings_are_reported_not_rebuilt(tmp_path, chunks, caplog):
    """A tuned overlay that sets k1 and b: `ragline tune` rebuilds as a writer; a query only says so."""
    st = open_state(tmp_path)
    record(st, chunks)
    BM25Index(BM25Spec(type="bm25", path="b"), base_dir=tmp_path).sync(st)
    tuned = BM25Index(BM25Spec(type="bm25", path="b", k1=1.5, b=0.9), base_dir=tmp_path)
    with caplog.at_level("INFO", logger="ragline.search.bm25"):
        assert ids(sparse_search(Query(text="penguins"), tuned, st, k=1)[0]) == ["penguin"]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", RESET)]
    assert tuned.published_version()["settings"] != tuned.settings
    st.close()


def test_sparse_stage_declares_the_state_role():
    assert retrieve_sparse.uses == {"sparse": ("bm25", "milvus"), "state": ("index_state",)}


@pytest.mark.parametrize("bad", [
    {"lang": {"$regex": "e.*"}},
    {"$not": {"lang": "en"}},
    {"lang": "de", "year": {"$between": [2000, 2020]}},  # hidden behind a clause that fails first
    {"$or": [{"lang": {"$ne": "xx"}}, {"year": {"$like": 1}}]},  # hidden behind one that succeeds
])
def test_invalid_query_filter_raises(store, sparse, minilm, bad):
    with pytest.raises(FilterError):
        dense(Query(text="penguins", filters=bad), store, minilm)
    with pytest.raises(FilterError):
        sparse_search(Query(text="penguins", filters=bad), sparse)


def test_invalid_params_where_is_rejected():
    with pytest.raises(ValidationError, match=r"\$regex"):
        Params(where={"lang": {"$regex": "e"}})
    with pytest.raises(ValidationError):
        Params(where={"$and": [{"lang": "en"}, {"$nor": []}]})
    with pytest.raises(ValidationError):
        Params(k=0)
    with pytest.raises(ValidationError):
        Params(top=3)


def test_combined_filter():
    assert combined_filter(None, None, None) is None
    assert combined_filter({}, {}, None) is None
    assert combined_filter({"a": 1}, None, None) == {"a": 1}
    assert combined_filter(None, {"b": 2}, None) == {"b": 2}
    assert combined_filter({"a": 1}, {"b": 2}, None) == {"$and": [{"a": 1}, {"b": 2}]}
    with pytest.raises(FilterError):
        combined_filter({"a": 1}, {"b": {"$bad": 2}}, None)
