"""Per-call sampling in the LLM client (``n``, ``temperature``, ``seed``): what goes over real HTTP to
a scripted server, the validation, and a server that ignores ``n``. The samples themselves (distinct
at temperature > 0, identical at 0) are checked on the real vLLM in tests/integration/test_vllm_server.py."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.flows.resources.models.llm import LLMClient, LLMSpec, LLMUnavailable, Sampling
from tests.scripted_llm import ScriptedLLM


def client(server: ScriptedLLM, **spec) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0, **spec))


def test_one_sample_is_the_request_it_always_was_and_a_call_overrides_sampling_for_itself_only():
    with ScriptedLLM(lambda p: "answer") as server:
        llm = client(server, temperature=0.2, seed=7)
        assert llm.chat("q").text == "answer"
        assert llm.samples("q", 1)[0].text == "answer"
        llm.chat("q", temperature=0.9, seed=3)
        llm.chat("q", seed=None)
        llm.chat("q")
    plain, one, own, unseeded, again = server.requests
    assert "n" not in plain and (plain["temperature"], plain["seed"]) == (0.2, 7)
    assert one == plain
    assert (own["temperature"], own["seed"]) == (0.9, 3)
    assert "seed" not in unseeded and unseeded["temperature"] == 0.2
    assert again == plain  # the resource's defaults are untouched by the calls before


def test_several_samples_ask_for_n_and_a_server_that_ignores_it_is_a_clear_error():
    with ScriptedLLM(lambda p: "one choice only", ignore_n=True) as server:
        llm = client(server)
        with pytest.raises(LLMUnavailable, match=r"answered 1 completion\(s\) where 3 were asked for \(n\)"):
            llm.samples("q", 3, temperature=0.7)
    [sent] = server.requests
    assert (sent["n"], sent["temperature"], sent["seed"]) == (3, 0.7, 0)


@pytest.mark.parametrize(("fields", "named"), [({"n": 0}, "n"), ({"n": 17}, "n"), ({"temperature": -0.1}, "temperature"),
                                              ({"temperature": 2.5}, "temperature"), ({"seed": "seven"}, "seed")])
def test_sampling_is_validated_before_anything_is_sent(fields, named):
    with pytest.raises(ValidationError) as caught:
        Sampling(**fields)
    assert caught.value.errors()[0]["loc"][0] == named
    with ScriptedLLM() as server:
        llm = client(server)
        with pytest.raises(ValidationError):
            llm.samples("q", fields.get("n", 2), temperature=fields.get("temperature"), seed=fields.get("seed", 0))
    assert server.requests == []


def test_samples_come_back_in_order_each_its_own_completion():
    replies = iter(["first", "second", "third"])
    with ScriptedLLM(lambda p: next(replies)) as server:
        samples = client(server).samples("q", 3, temperature=0.7, logprobs=True)
    assert [s.text for s in samples] == ["first", "second", "third"]
    assert all(len(s.tokens) == 1 and s.finish_reason == "stop" for s in samples)


def test_greedy_samples_are_one_decoding_repeated():
    """vLLM refuses `n` > 1 at temperature 0 (HTTP 400), and the copies would all be one text anyway."""
    with ScriptedLLM(lambda p: "the same") as server:
        llm = client(server)
        assert [c.text for c in llm.samples("q", 3)] == ["the same"] * 3
        assert [c.text for c in llm.samples("q", 2, temperature=0.0)] == ["the same"] * 2
    assert all("n" not in sent for sent in server.requests) and len(server.requests) == 2


def test_chat_and_samples_are_separate_requests_so_wrapping_one_never_counts_the_other():
    """A wrapper around ``samples`` on the instance (the benches' memo) must not see ``chat``'s calls."""
    with ScriptedLLM(lambda p: "x") as server:
        llm = client(server)
        seen = []
        real = llm.samples
        llm.samples = lambda *a, **k: seen.append(a) or real(*a, **k)
        llm.chat("q")
        assert seen == []
        llm.samples("q", 2, temperature=0.5)
        assert len(seen) == 1 and len(server.requests) == 2
