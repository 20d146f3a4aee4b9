"""Query2doc and HyDE with self-consistency (``rewrite`` mode hyde, ``samples`` > 1): the agreement
filter on the BM25 index's own terms (a fake LLM hands the samples: the counting is what is tested),
the mean HyDE vector, and the located validation. The samples of a real model: test_vllm_server.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.stores.bm25 import tokenize
from ragline.flows.resources.models.llm import Completion
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.parse import SpecValidationError
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.retrieve.dense import pooled
from ragline.tasks.rewrite.rewrite import Params, agreed_terms, rewrite
from tests.helpers.llm_stages import REPO_PROMPTS

SAMPLES = ["Aspirin lowers the risk of heart attacks in adults.",
           "In adults, aspirin reduced heart attack risk by a third.",
           "Daily aspirin prevents strokes and heart attacks.",
           "The drug was studied in 1994.",
           ""]


def terms(texts: list[str]) -> list[list[str]]:
    return tokenize(texts, "english", "en")  # what the shipped bm25 index searches with


class FakeSparse:
    terms = staticmethod(terms)


class FakeLLM:
    """Hands back scripted samples; records what each call asked for."""

    def __init__(self, samples: list[str]):
        self.replies, self.calls = samples, []

    def samples(self, prompt, n, **kwargs):
        self.calls.append(("samples", n, kwargs))
        return [Completion(text=t) for t in self.replies[:n]]

    def chat(self, prompt, **kwargs):
        self.calls.append(("chat", 1, kwargs))
        return Completion(text=self.replies[0])


def run(llm: FakeLLM, query: Query, **params) -> Query:
    ctx = StepContext(pipeline="t", step_id="rw", prompt_name="rewrite_hyde", render_prompt=PromptLibrary(REPO_PROMPTS).render)
    return rewrite.fn(query=query, params=Params(mode="hyde", **params), ctx=ctx, llm=llm, sparse=FakeSparse())


def test_agreement_keeps_the_terms_most_samples_share_counted_as_the_index_counts_them():
    # "attacks"/"attack" and "lowers"/"reduced" differ: the stemmer decides, as the index does
    # written as the first sample holding the term writes it; most agreed first, then by first appearance
    assert agreed_terms(SAMPLES, terms, 0.6, set(), 5) == ["Aspirin", "heart", "attacks"]  # 3 of 5 (empty counts)
    assert agreed_terms(SAMPLES, terms, 0.4, set(), 5) == ["Aspirin", "heart", "attacks", "risk", "adults"]
    assert agreed_terms(SAMPLES, terms, 0.6, {"aspirin"}, 5) == ["heart", "attacks"]  # the request's own: out
    assert agreed_terms(SAMPLES, terms, 1.0, set(), 5) == []
    assert agreed_terms(SAMPLES[:4], terms, 0.75, set()) == ["Aspirin", "heart", "attacks"]  # 3 of the 4 given
    assert agreed_terms(list(reversed(SAMPLES)), terms, 0.6, set(), 5) == ["aspirin", "heart", "attacks"]
    assert agreed_terms(["", ""], terms, 0.5, set()) == []


def whole_words(texts: list[str]) -> list[list[str]]:
    """An index tokenizer that splits otherwise than bm25s's pattern: hyphenated and apostrophe words are
    one term, letters and digits apart ("h1n1": h, 1, n, 1), stop words kept."""
    return [re.findall(r"[a-z]+(?:[-'][a-z]+|-\d+)*|\d+", t.lower()) for t in texts]


PIECES = ["COVID-19 spreads fast; O'Brien's team said so.", "covid-19 spreads in winter, O'Brien's paper says",
          "The COVID vaccine: 19 doses of H1N1 serum.", "A covid-19 study, 2021."]


def test_a_term_is_counted_as_the_index_splits_it_and_written_as_a_sample_writes_it():
    # this index: "covid-19" 3 of 4 samples, "o'brien's" and "spreads" 2; "covid" and "19" alone once each
    assert agreed_terms(PIECES, whole_words, 0.5, set()) == ["COVID-19", "spreads", "O'Brien's"]
    assert agreed_terms(PIECES, whole_words, 0.5, {"covid-19"}) == ["spreads", "O'Brien's"]
    every = agreed_terms(PIECES, whole_words, 0.25, set())  # all, most agreed first: "covid" and "19" once each
    assert every[:3] == ["COVID-19", "spreads", "O'Brien's"] and {"COVID", "19", "h", "1", "n"} <= set(every[3:])
    # bm25s (the shipped index): "COVID-19" is two terms, both in all 4 samples; "O'Brien's" is "brien"
    shipped = agreed_terms(PIECES, terms, 0.5, set())
    assert shipped == ["COVID", "19", "spreads", "O'Brien's"]
    assert [terms([w])[0] for w in shipped] == [["covid"], ["19"], ["spread"], ["brien"]]  # each word: one term


def test_samples_one_call_the_agreed_terms_expand_bm25_and_dense_searches_their_mean():
    llm = FakeLLM(SAMPLES)
    query = run(llm, Query(text="Does aspirin help?"), keyword=True, samples=5, query_repeats=2)
    assert llm.calls == [("samples", 5, {"max_tokens": 128, "temperature": 0.7})]
    assert query.keyword_texts == ["Does aspirin help? Does aspirin help? heart attacks"]
    assert query.hypothetical == SAMPLES[:4] and query.hypothetical_mean  # the empty sample is dropped
    assert query.dense_texts() == ["Does aspirin help?", *SAMPLES[:4]]
    again = run(FakeLLM(SAMPLES), Query(text="Does aspirin help?"), keyword=True, samples=5, query_repeats=2)
    assert again == query  # deterministic given the samples
    cold = FakeLLM(SAMPLES)
    run(cold, Query(text="q"), samples=3, temperature=1.2)  # HyDE alone: no BM25 terms needed
    assert cold.calls == [("samples", 3, {"max_tokens": 128, "temperature": 1.2})]


def test_one_sample_is_the_single_pseudo_document_as_before():
    llm = FakeLLM(SAMPLES)
    query = run(llm, Query(text="Does aspirin help?"), keyword=True, query_repeats=2)
    assert llm.calls == [("chat", 1, {"max_tokens": 128, "temperature": None})]
    assert query.keyword_texts == [f"Does aspirin help? Does aspirin help? {SAMPLES[0]}"]
    assert query.hypothetical == [SAMPLES[0]] and not query.hypothetical_mean
    nothing = run(FakeLLM(["", "  "]), Query(text="q"), keyword=True, samples=2)
    assert nothing.keyword_search_texts() == ["q"] and nothing.hypothetical == []


def test_keyword_samples_without_a_bm25_index_name_the_missing_resource():
    ctx = StepContext(pipeline="t", step_id="rw", prompt_name="rewrite_hyde", render_prompt=PromptLibrary(REPO_PROMPTS).render)
    with pytest.raises(MissingResource, match="needs a bm25 \\(or milvus\\) resource"):
        rewrite.fn(query=Query(text="q"), params=Params(mode="hyde", keyword=True, samples=3), ctx=ctx,
                   llm=FakeLLM(SAMPLES), sparse=None)


def test_the_mean_vector_is_one_unit_search_and_feedback_stays_its_own():
    query = Query(text="q", hypothetical=["a", "b"], hypothetical_mean=True)
    vectors = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=np.float32)
    texts, out = pooled(query, ["q", "a", "b"], vectors, normalize=True)
    assert texts == ["q"] and out.shape == (1, 2) and out.dtype == np.float32
    assert np.allclose(out[0], np.array([1.0, 2.0]) / np.sqrt(5))
    only = query.model_copy(update={"hyde_only": True})
    texts, out = pooled(only, ["a", "b", "feedback"], np.array([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]), normalize=False)
    assert texts == ["q", "feedback"] and np.allclose(out, [[0.5, 0.5], [5.0, 5.0]])


@pytest.mark.parametrize(("step", "message"), [
    ("{mode: multi_query, samples: 3}", "samples applies to the HyDE pseudo-documents"),
    ("{mode: conversational, temperature: 0.5}", "temperature applies to the HyDE pseudo-documents"),
    ("{mode: hyde, samples: 3, temperature: 0}", "samples: 3 at temperature 0 are 3 copies"),
    ("{mode: hyde, keyword: true, min_agreement: 0.5}", "min_agreement filters the terms"),
    ("{mode: hyde, samples: 3, min_agreement: 0.5}", "min_agreement filters the terms"),
    ("{mode: hyde, samples: 17}", "with.samples: Input should be less than or equal to 16"),
    ("{mode: hyde, keyword: true, samples: 3, min_agreement: 0}", "with.min_agreement: Input should be greater than 0"),
])
def test_sampling_params_are_located_errors(make_project, step, message):
    path = make_project(f"""
resources:
  llm: {{type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}}
pipelines:
  p:
    kind: query
    steps:
      - {{id: rw, task: rewrite, with: {step}}}
""")
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.line) == ("p", "rw", 8)
    assert message in f"{error.field}: {error.message}" if error.field else message in error.message


REWRITE_FILE = """
resources:
  llm: {{type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}}
{bm25}pipelines:
  p:
    kind: query
    steps:
      - {{id: rw, task: rewrite, with: {step}}}
"""
TWO_BM25 = "  bm_a: {type: bm25, path: idx/a}\n  bm_b: {type: bm25, path: idx/b}\n"


@pytest.mark.parametrize("step", ["{mode: conversational}", "{mode: multi_query, n: 3}", "{mode: decompose}",
                                  "{mode: instruction}", "{mode: hyde}", "{mode: hyde, keyword: true}",
                                  "{mode: hyde, samples: 3}"])
@pytest.mark.parametrize("bm25", ["", TWO_BM25], ids=["no-bm25", "two-bm25"])
def test_a_rewrite_that_reads_no_bm25_validates_without_one_and_binds_none(make_project, step, bm25):
    """Only self-consistent query2doc reads the BM25 index: every other rewrite validates with none, and
    with two it names none (it failed: "needs a bm25/milvus resource for 'sparse' ... several resources")."""
    path = make_project(REWRITE_FILE.format(bm25=bm25, step=step))
    assert validate_file(path) == []
    assert load_project(path).pipelines["p"].steps[0].resources == {"llm": "llm"}


def test_self_consistent_query2doc_without_a_bm25_index_fails_validation_at_keyword(make_project):
    path = make_project(REWRITE_FILE.format(bm25="", step="{mode: hyde, samples: 3,\n                                           keyword: true}"))
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.field, error.line) == ("p", "rw", "with.keyword", 9)
    assert str(path) in str(error) and "keyword: true with samples: 3" in error.message
    assert "needs a bm25/milvus resource for 'sparse' and the file has none" in error.message
    one = make_project(REWRITE_FILE.format(bm25="  sparse: {type: bm25, path: idx/s}\n",
                                           step="{mode: hyde, samples: 3, keyword: true}"), name="one.yaml")
    assert load_project(one).pipelines["p"].steps[0].resources == {"llm": "llm", "sparse": "sparse"}
    named = make_project(REWRITE_FILE.format(bm25=TWO_BM25, step="{mode: hyde, samples: 3, keyword: true}, "
                                                                 "uses: {sparse: bm_b}"), name="named.yaml")
    assert load_project(named).pipelines["p"].steps[0].resources == {"llm": "llm", "sparse": "bm_b"}


def test_a_self_consistent_query2doc_that_is_off_reads_no_bm25_until_an_override_turns_it_on(make_project):
    """Off (``enabled: false``, as `ragline tune` leaves query2doc it did not turn on) it reads nothing, as
    expand_terms off reads no LLM: no BM25 index is needed, two need no name. `--set` or the tuned
    overlay that turns it on binds the file's one then, or says at with.keyword that there is none."""
    off = "{mode: hyde, samples: 3, keyword: true, enabled: false}"
    for bm25, name in (("", "none.yaml"), (TWO_BM25, "two.yaml")):
        path = make_project(REWRITE_FILE.format(bm25=bm25, step=off), name=name)
        assert validate_file(path) == []
        assert load_project(path).pipelines["p"].steps[0].resources == {"llm": "llm"}
    with pytest.raises(SpecValidationError, match="field 'with.keyword'.*keyword: true with samples: 3"):
        load_project(make_project(REWRITE_FILE.format(bm25="", step=off), name="none.yaml")).pipeline(
            "p").with_overrides({"rw": {"enabled": True}})
    one = load_project(make_project(REWRITE_FILE.format(bm25="  sparse: {type: bm25, path: idx/s}\n", step=off),
                                    name="one.yaml"))
    assert one.pipeline("p").step("rw").resources == {"llm": "llm"}
    assert one.pipeline("p").with_overrides({"rw": {"enabled": True}}).step("rw").resources == \
        {"llm": "llm", "sparse": "sparse"}
