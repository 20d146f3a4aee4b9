"""The real vLLM server speaks the OpenAI protocol the way ragline's generation stages expect.

Generations stay short (SmolLM2-135M decodes ~10-25 tokens/s on this CPU) and no test asserts exact
text: greedy output differs between dtypes and machines.
"""
from __future__ import annotations

import json
import math

import openai
import pytest

pytestmark = [pytest.mark.llm, pytest.mark.integration]

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_completion_returns_text(client, vllm_server):
    resp = client.chat.completions.create(model=vllm_server.model, messages=MESSAGES, max_tokens=16,
                                          temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in {"stop", "length"}
    assert 0 < resp.usage.completion_tokens <= 16


def test_chat_logprobs_have_openai_structure(client, vllm_server):
    resp = client.chat.completions.create(model=vllm_server.model, messages=MESSAGES, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert isinstance(item.token, str)
        assert math.isfinite(item.logprob) and item.logprob <= 0
        assert len(item.top_logprobs) == 3
        assert all(alt.logprob <= 0 for alt in item.top_logprobs)
        # Greedy decoding picks the most likely token (ties aside).
        assert item.logprob >= max(alt.logprob for alt in item.top_logprobs) - 1e-3


def test_completion_logprobs_have_openai_structure(client, vllm_server):
    resp = client.completions.create(model=vllm_server.model, prompt="The capital of France is",
                                     max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(alts) <= 3 for alts in lp.top_logprobs)  # the sampled token may add one


def test_streaming_returns_several_chunks(client, vllm_server):
    stream = client.chat.completions.create(model=vllm_server.model, messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces).strip()


def test_structured_output_json_schema(client, vllm_server):
    # A bounded schema, so even a 135M model finishes it within max_tokens.
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}},
              "required": ["answer"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=vllm_server.model, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "Is Paris in France? Reply in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema}})
    data = json.loads(resp.choices[0].message.content)
    assert isinstance(data["answer"], bool) and set(data) == {"answer"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert err.value.status_code == 404


# ----------------------------------------------------------------------------- samples (n) through ragline's client
PASSAGE = [{"role": "user", "content": "Write a short passage that answers: does aspirin prevent heart attacks?"}]


@pytest.fixture(scope="module")
def llm(vllm_server):
    from ragline.flows.resources.models.llm import LLMClient, LLMSpec

    client = LLMClient(LLMSpec(type="openai_compatible", base_url=vllm_server.base_url, model=vllm_server.model,
                               timeout_seconds=600))
    yield client
    client.close()


def test_samples_differ_above_temperature_zero_and_repeat_with_the_seed(llm):
    samples = llm.samples(PASSAGE, 4, max_tokens=24, temperature=1.0)
    texts = [s.text for s in samples]
    assert len(texts) == 4 and all(t.strip() for t in texts)
    assert len(set(texts)) >= 3, texts  # four draws of 24 tokens at temperature 1: (nearly) all differ
    assert all(s.finish_reason in {"stop", "length"} for s in samples)
    assert [s.text for s in llm.samples(PASSAGE, 4, max_tokens=24, temperature=1.0)] == texts  # the resource's seed


def test_samples_at_temperature_zero_are_one_text_and_the_resource_keeps_its_defaults(llm):
    greedy = llm.samples(PASSAGE, 3, max_tokens=16, temperature=0)
    assert len({s.text for s in greedy}) == 1 and greedy[0].text.strip()
    assert llm.chat(PASSAGE, max_tokens=16).text == greedy[0].text  # the resource's temperature 0, no `n`


def test_each_sample_is_held_to_the_json_schema(llm):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    samples = llm.samples([{"role": "user", "content": "Answer as JSON: the capital of France?"}], 2,
                          max_tokens=32, temperature=0.8, json_schema=schema)
    assert len(samples) == 2
    for sample in samples:
        assert set(json.loads(sample.text)) == {"answer"}
