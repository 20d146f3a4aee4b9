"""Query expansion with related terms (``expand_terms``) over real BM25 indexes: SciFact abstracts
for the corpus's co-occurrence statistics, a tiny index with access groups for what may be counted,
and the scripted LLM over real HTTP for the LLM's synonyms."""
from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from ragline.flows.access import acl_metadata
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, Feedback, Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.parse import SpecValidationError
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.rewrite.expand_terms import Params, expand_terms, merged
from ragline.tasks.retrieve.dense import Params as RetrieveParams
from ragline.tasks.retrieve.sparse import retrieve_sparse
from tests.helpers.data import scifact_records
from tests.helpers.llm_stages import REPO_PROMPTS
from tests.helpers.reads_roles import BM25, LLM, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

CLAIM = "Vitamin D deficiency increases the risk of tuberculosis."


def bm25_of(folder, chunks: list[Chunk]):
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=folder)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    sparse = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=folder)
    sparse.sync(state)
    return sparse, state


@pytest.fixture(scope="module")
def scifact(tmp_path_factory):
    """BM25 built from an index state holding 400 SciFact abstracts (one chunk each)."""
    chunks = [Chunk(chunk_id=hashlib.sha256(r["_id"].encode()).hexdigest()[:32], source_id=f"scifact#{r['_id']}",
                    ordinal=0, text=f"{r['title']}\n{r['text']}", title=r["title"]) for r in scifact_records(400)]
    sparse, state = bm25_of(tmp_path_factory.mktemp("terms"), chunks)
    yield sparse, state
    state.close()


def ctx(**kwargs) -> StepContext:
    return StepContext(pipeline="p", step_id="terms", **kwargs)


def expand(sparse, query: Query | str, **params) -> Query:
    query = Query(text=query) if isinstance(query, str) else query
    return expand_terms.fn(query=query, params=Params(**params), ctx=ctx(), sparse=sparse)


def bm25(query: Query, sparse, state, k: int = 10):
    [ranking] = retrieve_sparse.fn(query=query, params=RetrieveParams(k=k), ctx=ctx(), sparse=sparse, state=state)
    return ranking.passages


def test_corpus_terms_are_index_terms_that_meet_the_query_terms_in_its_top_passages(scifact):
    sparse, state = scifact
    expanded = expand(sparse, CLAIM, terms=6, weight=0.25)
    feedback = expanded.feedback
    assert feedback is not None and len(feedback.terms) == 6 and sum(feedback.terms.values()) == pytest.approx(1)
    assert feedback.query_weight == pytest.approx(0.75) and feedback.text == ""  # dense unchanged by default
    own = set(sparse.terms([CLAIM])[0])
    assert not own & set(feedback.terms)
    top = [Counter(terms) for terms in sparse.terms([p.text for p in bm25(Query(text=CLAIM), sparse, state)])]
    for term in feedback.terms:  # each co-occurs with a query term in a top passage
        assert any(c[term] and own & set(c) for c in top), term
    frequencies, total = sparse.document_frequencies(feedback.terms)
    assert set(frequencies) == set(feedback.terms) and total == 400


def test_co_occurrence_with_every_query_term_beats_frequency_in_the_top_passages(scifact):
    """What sets it apart from RM3: a term frequent in the top passages but beside none of the query
    terms (a common word) is not taken; the terms taken are rarer in the index than RM3's would be."""
    sparse, state = scifact
    related = expand(sparse, CLAIM, terms=10).feedback.terms
    top = sparse.terms([p.text for p in bm25(Query(text=CLAIM), sparse, state)])
    frequent = [t for t, _ in Counter(t for terms in top for t in terms).most_common(10)]
    frequencies, _ = sparse.document_frequencies(set(related) | set(frequent))
    assert sum(frequencies[t] for t in related) < sum(frequencies[t] for t in frequent)


def test_the_expansion_finds_passages_without_any_query_term(scifact):
    sparse, state = scifact
    expanded = expand(sparse, CLAIM, terms=10, weight=0.4)
    query_terms = set(sparse.terms([CLAIM])[0])
    found = [p for p in bm25(expanded, sparse, state, k=200) if not query_terms & set(sparse.terms([p.text])[0])]
    assert found and not {p.chunk_id for p in found} & {p.chunk_id for p in bm25(Query(text=CLAIM), sparse, state,
                                                                                    k=400)}


def test_dense_gives_a_second_dense_query_in_written_words(scifact):
    sparse, _ = scifact
    expanded = expand(sparse, CLAIM, terms=5, dense=True)
    assert expanded.dense_texts() == [CLAIM, expanded.feedback.text] and expanded.search_texts() == [CLAIM]
    assert expanded.feedback.text.startswith(CLAIM + " ") and len(expanded.feedback.text.split()) == 8 + 5


def test_terms_are_counted_only_in_passages_the_query_may_read(tmp_path):
    texts = [("p1", "Capybara herds graze near rivers.", ()), ("p2", "Capybara grazing habits in wetlands.", ()),
             ("p3", "Capybara rodents graze; secret herbicide trials.", ("board",)),
             ("p4", "Capybara graze; herbicide drift in wetlands.", ("board",)),
             ("p5", "Unrelated text about trains.", ())]
    sparse, state = bm25_of(tmp_path, [Chunk(chunk_id=k, source_id=k, ordinal=0, text=t, metadata=acl_metadata(g))
                                       for k, t, g in texts])
    try:
        staff = expand(sparse, Query(text="capybara graze", access=frozenset({"staff"})), terms=10).feedback.terms
        board = expand(sparse, Query(text="capybara graze", access=frozenset({"board"})), terms=10).feedback.terms
        everyone = expand(sparse, Query(text="capybara graze"), terms=10).feedback.terms
        assert "herbicid" not in staff and "herbicid" in board and "herbicid" in everyone
        filtered = expand(sparse, Query(text="capybara graze", filters={"source_id": {"$in": ["p1", "p2"]}}),
                          terms=10).feedback.terms
        assert "herbicid" not in filtered and "wetland" in filtered
    finally:
        state.close()


def test_nothing_related_leaves_the_query_as_it_is(scifact):
    sparse, _ = scifact
    query = Query(text="zxqv unknownword")
    assert expand(sparse, query) is query


def test_llm_proposals_become_weighted_index_terms(scifact):
    sparse, state = scifact
    replies = "1. calcidiol, sunlight\n- TB; Mycobacterium tuberculosis\n* qqqzzz, tuberculosis\nvitamin D"
    with ScriptedLLM(lambda prompt: replies) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        step = ctx(prompt_name="expand_terms", render_prompt=PromptLibrary(REPO_PROMPTS).render)
        expanded = expand_terms.fn(query=Query(text=CLAIM), params=Params(mode="llm", terms=4, dense=True),
                                   ctx=step, sparse=sparse, llm=llm)
        [prompt] = [r["messages"][-1]["content"] for r in server.requests if "messages" in r]
    assert CLAIM in prompt and "up to 4 synonyms" in prompt
    terms = expanded.feedback.terms
    # "calcidiol" and "qqqzzz" are not in the index, "tuberculosis" and "vitamin D" are the request's
    # own: left out; "Mycobacterium tuberculosis" adds only its new term
    assert terms == pytest.approx({"sunlight": 1 / 3, "tb": 1 / 3, "mycobacterium": 1 / 3})
    assert sum(terms.values()) == pytest.approx(1) and not set(terms) & set(sparse.terms([CLAIM])[0])
    assert expanded.feedback.text.startswith(CLAIM + " ") and "sunlight" in expanded.feedback.text
    assert bm25(expanded, sparse, state)  # the weighted keyword query runs


def test_llm_mode_without_an_llm_is_refused_clearly(scifact):
    sparse, _ = scifact
    with pytest.raises(MissingResource, match="mode 'llm' needs an openai_compatible resource"):
        expand(sparse, CLAIM, mode="llm")


def test_an_earlier_feedback_is_kept_beside_the_new_terms():
    prf = Feedback(terms={"a": 0.5, "b": 0.5}, query_weight=0.7, text="q a b")
    both = merged(prf, Feedback(terms={"b": 0.5, "c": 0.5}, query_weight=0.6))
    assert both.terms == {"a": 0.25, "b": 0.5, "c": 0.25} and both.query_weight == 0.6 and both.text == "q a b"


@pytest.mark.parametrize("setting, field", [("weight: 1.5", "with.weight"), ("mode: synonyms", "with.mode"),
                                            ("docs: 1", "with.docs")])
def test_bad_params_are_located(make_project, setting, field):
    path = make_project(f"""
resources:
  sparse: {{type: bm25, path: bm25}}
pipelines:
  p:
    kind: query
    steps:
      - {{id: terms, task: expand_terms, with: {{{setting}}}}}
""")
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.field, error.line) == ("p", "terms", field, 8)


# ----------------------------------------------------------------------------- resources read (validate)
EXPAND_STEP = """      - id: expand
        task: expand_terms
        with:
          mode: llm
"""


def test_expand_terms_in_mode_llm_without_an_llm_fails_validation_at_mode(make_project):
    """Mode llm validated without an LLM and failed only when a request came; now `ragline validate`
    names the line and with.mode."""
    error = error_at(make_project(pipelines_file(BM25, EXPAND_STEP)), "expand", "with.mode")
    assert "mode 'llm' asks the LLM for related terms" in error.message


def test_expand_terms_binds_an_llm_only_in_mode_llm_when_on_and_an_override_that_turns_it_on_binds_it(make_project):
    """Mode corpus, or a step that is off, reads no LLM: two need no name, none is no error. `--set` (or
    the tuned overlay) that turns an llm step on binds the file's LLM then, or says at with.mode that
    there is none, before anything runs."""
    corpus = make_project(pipelines_file(BM25 + TWO_LLMS, EXPAND_STEP.replace("mode: llm", "mode: corpus")))
    assert validate_file(corpus) == [] and load_project(corpus).pipeline("p").step("expand").resources == \
        {"sparse": "sparse"}
    off = EXPAND_STEP + "          enabled: false\n"
    assert validate_file(make_project(pipelines_file(BM25, off), name="off.yaml")) == []
    with pytest.raises(SpecValidationError, match="field 'with.mode'.*mode 'llm' asks the LLM"):
        load_project(make_project(pipelines_file(BM25, off), name="off.yaml")).pipeline("p").with_overrides(
            {"expand": {"enabled": True}})
    with_llm = load_project(make_project(pipelines_file(BM25 + LLM, off), name="llm.yaml"))
    assert with_llm.pipeline("p").step("expand").resources == {"sparse": "sparse"}
    assert with_llm.pipeline("p").with_overrides({"expand": {"enabled": True}}).step("expand").resources == \
        {"sparse": "sparse", "llm": "llm"}
