"""Pseudo-relevance feedback (``expand_prf``, RM3) over a real BM25 index of SciFact abstracts, and
through the engine with real Chroma in a hybrid pipeline."""
from __future__ import annotations

import hashlib

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, Feedback, Query
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.tasks.rewrite.expand_prf import Params, expand_prf
from ragline.tasks.retrieve.dense import Params as RetrieveParams
from ragline.tasks.retrieve.sparse import retrieve_sparse
from tests.helpers.data import BASE_RESOURCES, scifact_records, write_jsonl

CLAIM = "Vitamin D deficiency increases the risk of tuberculosis."


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """BM25 built from an index state holding 400 SciFact abstracts (one chunk each)."""
    folder = tmp_path_factory.mktemp("prf")
    records = scifact_records(400)
    chunks = [Chunk(chunk_id=hashlib.sha256(r["_id"].encode()).hexdigest()[:32], source_id=f"scifact#{r['_id']}",
                    ordinal=0, text=f"{r['title']}\n{r['text']}", title=r["title"], metadata={"doc_id": r["_id"]})
              for r in records]
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=folder)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    sparse = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=folder)
    sparse.sync(state)
    yield sparse, state
    state.close()


def bm25(query: Query, sparse: BM25Index, state: IndexState, k: int = 10):
    [ranking] = retrieve_sparse.fn(query=query, params=RetrieveParams(k=k), ctx=StepContext(pipeline="p", step_id="s"),
                                   sparse=sparse, state=state)
    return ranking.passages


def test_feedback_terms_are_index_terms_of_the_top_passages(index):
    sparse, state = index
    first = bm25(Query(text=CLAIM), sparse, state)
    expanded = expand_prf.fn(query=Query(text=CLAIM), passages=first, params=Params(docs=5, terms=8), sparse=sparse)
    feedback = expanded.feedback
    assert feedback is not None and len(feedback.terms) == 8 and sum(feedback.terms.values()) == pytest.approx(1)
    frequencies, total = sparse.document_frequencies(feedback.terms)
    assert set(frequencies) == set(feedback.terms) and total == 400  # stems the index holds
    top_terms = set(sparse.terms([p.text for p in first[:5]])[0] + sum(sparse.terms([p.text for p in first[:5]]), []))
    assert set(feedback.terms) <= top_terms
    # the second dense query: the request, then the terms as written in the passages (not stems)
    assert feedback.text.startswith(CLAIM + " ")
    written = " ".join(p.text.lower() for p in first[:5])
    assert all(word in written for word in feedback.text[len(CLAIM) + 1:].split())
    assert expanded.dense_texts() == [CLAIM, feedback.text] and expanded.search_texts() == [CLAIM]


def test_query_weight_one_ranks_as_plain_bm25(index):
    sparse, state = index
    plain = bm25(Query(text=CLAIM), sparse, state, k=50)
    only_query = Query(text=CLAIM, feedback=Feedback(terms={"tuberculosi": 1.0}, query_weight=1.0))
    assert [p.chunk_id for p in bm25(only_query, sparse, state, k=50)] == [p.chunk_id for p in plain]


def test_expansion_terms_retrieve_passages_without_any_query_term(index):
    sparse, state = index
    query = Query(text=CLAIM)
    first = bm25(query, sparse, state)
    expanded = expand_prf.fn(query=query, passages=first, params=Params(docs=10, terms=20, query_weight=0.3),
                             sparse=sparse)
    second = bm25(expanded, sparse, state, k=200)
    query_terms = set(sparse.terms([CLAIM])[0])
    found_by_expansion = [p for p in second if not query_terms & set(sparse.terms([p.text])[0])]
    assert found_by_expansion  # plain BM25 scores such passages 0 and never returns them
    assert not {p.chunk_id for p in found_by_expansion} & {p.chunk_id for p in bm25(query, sparse, state, k=400)}


def test_max_df_leaves_out_common_terms(index):
    sparse, state = index
    first = bm25(Query(text=CLAIM), sparse, state)
    every = expand_prf.fn(query=Query(text=CLAIM), passages=first, params=Params(terms=100), sparse=sparse)
    rare = expand_prf.fn(query=Query(text=CLAIM), passages=first, params=Params(terms=100, max_df=0.02),
                         sparse=sparse)
    frequencies, total = sparse.document_frequencies(every.feedback.terms)
    common = {t for t, df in frequencies.items() if df > 0.02 * total}
    assert common and not common & set(rare.feedback.terms)


def test_no_passages_leaves_the_query_unchanged(index):
    sparse, _ = index
    query = Query(text=CLAIM)
    assert expand_prf.fn(query=query, passages=[], params=Params(), sparse=sparse) is query


PRF_PIPELINE = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  search_prf:
    kind: query
    steps:
      - {id: first_dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: first_sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: top,    task: fuse, after: [first_dense, first_sparse], with: {top_k: 10}}
      - {id: prf,    task: expand_prf, with: {docs: 10, terms: 10, query_weight: WEIGHT}}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [prf]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


def test_hybrid_prf_pipeline_runs_and_never_writes_the_index(make_project):
    path = make_project(PRF_PIPELINE.replace("WEIGHT", "0.5"))
    write_jsonl(path.parent / "docs" / "scifact.jsonl", scifact_records(12))
    project = load_project(path)
    engine.run(project.pipeline("index"), orchestrate=False)
    stores = path.parent / "idx"
    before = {p: p.read_bytes() for p in stores.rglob("*") if p.is_file()}
    title = scifact_records(1)[0]["title"]
    passages = engine.run(project.pipeline("search_prf"), {"query": title}, orchestrate=False)
    assert passages and passages[0].metadata["doc_id"] == scifact_records(1)[0]["_id"]
    assert {p: p.read_bytes() for p in stores.rglob("*") if p.is_file()} == before


def test_invalid_query_weight_is_located(make_project):
    path = make_project(PRF_PIPELINE.replace("WEIGHT", "1.5"))
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.field) == ("search_prf", "prf", "with.query_weight")
    assert error.line == path.read_text().splitlines().index(
        next(line for line in path.read_text().splitlines() if "id: prf" in line)) + 1
    assert "less than or equal to 1" in error.message
