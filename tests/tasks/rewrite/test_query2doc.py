"""Query2doc: HyDE's pseudo-document appended to the BM25 query too (``rewrite`` mode hyde with
``keyword: true``), against a scripted LLM over HTTP and a real BM25 index of SciFact abstracts."""
from __future__ import annotations

import hashlib

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, Query
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.flows.spec.compile import validate_file
from ragline.tasks.retrieve.dense import Params as RetrieveParams
from ragline.tasks.retrieve.sparse import retrieve_sparse
from tests.helpers.data import scifact_records
from tests.helpers.llm_stages import rewrite_with

QUESTION = "Does it change the cell?"


def test_hyde_with_keyword_expands_the_bm25_query_and_keeps_dense_as_hyde():
    document = "Mitochondria produce ATP through oxidative phosphorylation."
    query, prompts = rewrite_with(document, "hyde", Query(text=QUESTION), keyword=True, query_repeats=3)
    assert query.keyword_texts == [f"{QUESTION} {QUESTION} {QUESTION} {document}"]
    assert query.keyword_search_texts() == query.keyword_texts
    assert query.dense_texts() == [QUESTION, document] and query.search_texts() == [QUESTION]
    assert len(prompts) == 1 and QUESTION in prompts[0]
    plain, _ = rewrite_with(document, "hyde", Query(text=QUESTION))
    assert plain.keyword_texts == [] and plain.keyword_search_texts() == [QUESTION]  # HyDE alone: dense only
    empty, _ = rewrite_with("  ", "hyde", Query(text=QUESTION), keyword=True)
    assert empty.keyword_search_texts() == [QUESTION]  # no pseudo-document: BM25 searches the request


def test_bm25_searches_the_expanded_text(tmp_path):
    records = scifact_records(200)
    chunks = [Chunk(chunk_id=hashlib.sha256(r["_id"].encode()).hexdigest()[:32], source_id=f"s#{r['_id']}",
                    ordinal=0, text=f"{r['title']}\n{r['text']}", title=r["title"]) for r in records]
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=tmp_path)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    sparse = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=tmp_path)
    sparse.sync(state)
    target = records[17]
    pseudo = target["title"]  # a pseudo-document that happens to say what the target says
    query = Query(text="What does the study find?", keyword_texts=[f"What does the study find? {pseudo}"])
    [ranking] = retrieve_sparse.fn(query=query, params=RetrieveParams(k=5), ctx=StepContext(pipeline="p", step_id="s"),
                                   sparse=sparse, state=state)
    assert ranking.query == query.keyword_texts[0] and ranking.passages[0].source_id == f"s#{target['_id']}"
    state.close()


@pytest.mark.parametrize("mode", ["multi_query", "conversational"])
def test_keyword_outside_hyde_is_a_located_error(make_project, mode):
    path = make_project(f"""
resources:
  llm: {{type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}}
pipelines:
  p:
    kind: query
    steps:
      - {{id: rw, task: rewrite, with: {{mode: {mode}, keyword: true}}}}
""")
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.line) == ("p", "rw", 8)
    assert "keyword (query2doc) appends the HyDE pseudo-document" in error.message
