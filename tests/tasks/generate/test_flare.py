"""FLARE: a low-probability sentence triggers retrieval (masked query) before it is kept."""
from __future__ import annotations

import math

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Context, ContextDocument, Passage, Query
from ragline.flows.spec.prompts import PromptLibrary
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.models.llm import Completion, LLMClient, LLMSpec, TokenLogprob
from ragline.tasks.generate.flare import Params, _first_sentence, _masked, generate_flare
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


# --- FLARE-Instruct: the model asks for retrieval with [Search(query)] ------------------------------
from ragline.flows.access import acl_metadata  # noqa: E402
from ragline.tasks.generate.flare import _without_tokens  # noqa: E402

OLYMPICS = "Which city hosted the 2024 Olympics?"


def instruct(store, embedder, reply, question: str = OLYMPICS, access=None, **params):
    context = Context(documents=[ContextDocument(number=1, passage=Passage(chunk_id="k2", source_id="s2",
                                                                           text="Lyon is known for food."))])
    with ScriptedLLM(reply) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="t", step_id="flare", prompt_name="flare_instruct",
                          render_prompt=PromptLibrary(REPO_PROMPTS).render)
        answer = generate_flare.fn(query=Query(text=question, access=access), context=context,
                                   params=Params(mode="instruct", k=2, **params), ctx=ctx, llm=llm, store=store,
                                   embedder=embedder)
        return answer, [r["messages"][-1]["content"] for r in server.requests if "messages" in r]


def test_a_search_token_retrieves_with_its_query_and_the_model_goes_on(store, minilm):
    def reply(prompt: str) -> str:
        if "2024 Olympics." in prompt.split("Question:")[0]:  # the search found it: answer from it
            return "Paris hosted them [2]."
        return "The host was chosen in 2017. [Search(city hosting the 2024 Olympics)] and more"

    answer, prompts = instruct(store, minilm, reply)
    assert answer.retrievals == 1 and len(prompts) == 2
    assert answer.text == "The host was chosen in 2017. Paris hosted them [2]."  # text after the token dropped
    assert answer.sources[0].chunk_id == "k1" and answer.invalid_citations == []
    assert "Continue this answer" in prompts[1] and "chosen in 2017" in prompts[1]  # continued from the kept text
    assert "[Search(your search query)]" in prompts[0]


def test_searches_are_bounded_and_a_token_past_the_bound_is_dropped(store, minilm):
    answer, prompts = instruct(store, minilm, lambda p: "Paris [1]. [Search(more about Paris)]", max_retrievals=2)
    assert answer.retrievals == 2 and len(prompts) == 3
    assert "Search" not in answer.text and answer.text.startswith("Paris [1].")


def test_a_malformed_or_absent_token_simply_continues(store, minilm):
    for text in ("Lyon [1]. [Search(unclosed", "Lyon [1]. [Search()]", "Lyon [1]."):
        answer, prompts = instruct(store, minilm, lambda p, text=text: text)
        assert (answer.retrievals, len(prompts), answer.text) == (0, 1, "Lyon [1]."), text


def test_instruct_searches_only_what_the_principal_may_read(tmp_path, minilm):
    acl = ChromaStore(ChromaSpec(type="chroma", path="c", collection="acl"), base_dir=tmp_path)
    texts = {"pub": ("Paris hosted the 2024 Olympics.", ()), "board": ("Secret: Paris paid 9 billion.", ("board",))}
    vectors = minilm.encode_documents([t for t, _ in texts.values()])
    acl.upsert([Chunk(chunk_id=key, source_id=key, ordinal=0, text=text, embedding=v.tolist(),
                      metadata=acl_metadata(groups)) for (key, (text, groups)), v in zip(texts.items(), vectors)])

    def reply(prompt: str) -> str:
        return "Paris [2]." if "Paris" in prompt.split("Question:")[0] else "[Search(what Paris paid for 2024)]"

    staff, staff_prompts = instruct(acl, minilm, reply, access=frozenset({"staff"}))
    board, board_prompts = instruct(acl, minilm, reply, access=frozenset({"board"}))
    assert staff.retrievals == board.retrievals == 1
    assert not any("9 billion" in p for p in staff_prompts)  # the re-retrieval kept to what staff may read
    assert "9 billion" in board_prompts[-1]  # the same search, by a reader of the board's documents

def test_without_tokens():
    assert _without_tokens("a [Search(q)] b [Search(] c") == "a b c"
