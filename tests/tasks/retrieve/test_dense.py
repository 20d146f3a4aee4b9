"""``retrieve_dense`` against a real small Chroma and the packaged MiniLM, beside a real index
state: a store that was never built is an empty answer; one that is missing, emptied or
unreadable while the state holds chunks fails a dense-only pipeline and warns in a hybrid one,
in one line naming the store and the remedy; vectors of another embedder are refused.
(Rankings, filters and k over a healthy store: test_retrieve.py.)"""
from __future__ import annotations

import logging
import os
import shutil

import pytest

from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, Query
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore, EmbedderMismatch
from ragline.flows.resources.stores.state import StoreDamaged, StoreMissing
from ragline.tasks.retrieve.dense import Params, indexed_chunks, retrieve_dense

PROJECT = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  search_dense:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 3}}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 3}}
      - {id: sparse, task: retrieve_sparse, with: {k: 3}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
"""
TEXTS = {"penguin": "Penguins are flightless seabirds of the southern hemisphere.",
         "volcano": "Volcanic eruptions inject sulfur dioxide into the stratosphere."}


@pytest.fixture
def project(make_project):
    return load_project(make_project(PROJECT), tuned=False)


@pytest.fixture(scope="module")
def embedded(minilm) -> list[Chunk]:
    vectors = minilm.encode_documents(list(TEXTS.values()))
    return [Chunk(chunk_id=cid, source_id=f"docs/{cid}.md", ordinal=0, text=text, embedding=v.tolist())
            for (cid, text), v in zip(TEXTS.items(), vectors)]


def store_of(project) -> ChromaStore:
    return ChromaStore(ChromaSpec(type="chroma", path="idx/chroma", collection="test"), base_dir=project.base_dir)


def recorded(project, chunks: list[Chunk]) -> None:
    """The index state names the chunks' sources, as after an ingestion run."""
    docs = [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id) for c in chunks]
    project.resource("state").record("index", "fp", docs, chunks)


def search(project, pipeline: str, store: ChromaStore, minilm, text: str = "penguins"):
    ctx = StepContext(pipeline=pipeline, step_id="dense", project=project)
    return retrieve_dense.fn(query=Query(text=text), params=Params(k=3), ctx=ctx, store=store, embedder=minilm)


def built(project, embedded, minilm) -> ChromaStore:
    store = store_of(project)
    store.upsert(embedded)
    store.record_embedder(minilm.spec.vectors_key(), minilm.spec.model)
    recorded(project, embedded)
    return store


def test_a_healthy_store_answers_nearest_first(project, embedded, minilm):
    [ranking] = search(project, "search_dense", built(project, embedded, minilm), minilm)
    assert ranking.retriever == "dense" and ranking.query == "penguins"
    assert [p.chunk_id for p in ranking.passages] == ["penguin", "volcano"]
    assert ranking.passages[0].score > ranking.passages[1].score


def test_a_store_never_built_is_an_empty_answer_and_creates_nothing(project, minilm, caplog):
    store = store_of(project)
    with caplog.at_level(logging.INFO):
        [ranking] = search(project, "search_dense", store, minilm)
    assert ranking.passages == [] and indexed_chunks(StepContext(pipeline="search", step_id="dense", project=project)) == 0
    assert any("nothing is indexed yet" in r.getMessage() for r in caplog.records)
    assert not store.path.exists()


def test_a_missing_store_fails_dense_only_naming_it_and_the_remedy(project, embedded, minilm):
    store = built(project, embedded, minilm)
    shutil.rmtree(store.path)
    with pytest.raises(StoreMissing, match=rf"there is no store at {store.path}; run `ragline index`"):
        search(project, "search_dense", store_of(project), minilm)
    assert not store.path.exists()


def test_a_missing_store_in_a_hybrid_pipeline_warns_and_answers_empty(project, embedded, minilm, caplog):
    store = built(project, embedded, minilm)
    shutil.rmtree(store.path)
    with caplog.at_level(logging.WARNING):
        [ranking] = search(project, "search", store_of(project), minilm)
    assert ranking.passages == []
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"there is no store at {store.path}" in warning and warning.endswith("answering from the other retrievers only")


def test_an_emptied_collection_beside_a_full_state_is_damage(project, embedded, minilm, caplog):
    store = built(project, embedded, minilm)
    store.delete([c.chunk_id for c in embedded])
    with pytest.raises(StoreDamaged, match=r"the collection is empty while the index state holds 2 chunks; "
                                           r"run `ragline index`"):
        search(project, "search_dense", store, minilm)
    with caplog.at_level(logging.WARNING):
        assert search(project, "search", store, minilm)[0].passages == []
    assert any("the collection is empty" in r.getMessage() for r in caplog.records)


def test_an_unreadable_store_is_named_with_how_to_move_it_aside(project, embedded, minilm):
    store = built(project, embedded, minilm)
    path = store.path
    del store
    os.truncate(path / "chroma.sqlite3", 4096)
    with pytest.raises(StoreDamaged, match=rf"is unreadable .*: move it aside \(mv {path} {path}\.damaged\)"):
        search(project, "search_dense", store_of(project), minilm)


def test_vectors_of_another_embedder_are_refused_even_in_a_hybrid_pipeline(project, embedded, minilm):
    store = built(project, embedded, minilm)
    store.record_embedder("0000000000000000", "some-other-model")
    with pytest.raises(EmbedderMismatch, match=r"holds vectors of embedder 'some-other-model'.* re-embed"):
        search(project, "search", store_of(project), minilm)
