"""FLARE: a low-probability sentence triggers retrieval (masked query) before it is kept."""
from __future__ import annotations

import math

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Context, ContextDocument, Passage, Query
from ragline.flows.spec.prompts import PromptLibrary
from ragline.flows.resources.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.llm import Completion, LLMClient, LLMSpec, TokenLogprob
from ragline.tasks.generate_flare import Params, _first_sentence, _masked, generate_flare
from tests.helpers.llm_stages import REPO_PROMPTS
from tests.scripted_llm import ScriptedLLM


def test_first_sentence_and_masked_query():
    tokens = [TokenLogprob(t, math.log(p)) for t, p in
              [("Paris ", 0.9), ("is ", 0.95), ("big", 0.2), (". ", 0.9), ("More", 0.9)]]
    step = Completion("Paris is big. More", tokens)
    assert _first_sentence(step, 0.5) == ("Paris is big.", False)
    assert _first_sentence(step, 0.1) == ("Paris is big.", True)
    assert _masked(step, "Paris is big.", 0.5) == "Paris is ."


@pytest.fixture
def store(tmp_path, minilm):
    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="flare"), base_dir=tmp_path)
    texts = ["The Eiffel Tower is in Paris.", "Paris hosted the 2024 Olympics.", "Lyon is known for food."]
    vectors = minilm.encode_documents(texts)
    store.upsert([Chunk(chunk_id=f"k{i}", source_id=f"s{i}", ordinal=0, text=t, embedding=v.tolist())
                  for i, (t, v) in enumerate(zip(texts, vectors))])
    return store


def run(store, embedder, threshold: float, logprob: float):
    context = Context(documents=[ContextDocument(number=1, passage=Passage(chunk_id="k2", source_id="s2",
                                                                           text="Lyon is known for food."))])
    with ScriptedLLM(lambda p: "Paris hosted the Olympics [2].", logprob=logprob) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="t", step_id="flare", prompt_name="flare_continue",
                          render_prompt=PromptLibrary(REPO_PROMPTS).render)
        answer = generate_flare.fn(query=Query(text="Which city hosted the 2024 Olympics?"), context=context,
                                   params=Params(threshold=threshold, k=2, max_sentences=2), ctx=ctx, llm=llm,
                                   store=store, embedder=embedder)
        return answer, len([r for r in server.requests if "messages" in r])


def test_uncertain_sentence_triggers_retrieval(store, minilm):
    answer, calls = run(store, minilm, threshold=0.95, logprob=math.log(0.6))
    assert answer.retrievals == 1 and calls >= 2
    assert answer.text == "Paris hosted the Olympics [2]." and answer.sources[0].chunk_id in {"k0", "k1"}


def test_confident_sentence_needs_no_retrieval(store, minilm):
    answer, calls = run(store, minilm, threshold=0.5, logprob=math.log(0.9))
    assert answer.retrievals == 0 and calls == 1 and answer.invalid_citations == [2]
