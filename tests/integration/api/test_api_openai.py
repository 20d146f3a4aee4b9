"""The OpenAI-compatible surface with the stock ``openai`` client, unchanged: models, completions,
streaming chunks with ragline's extras in ``model_extra``, usage, [DONE], OpenAI-shaped errors."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, running

pytestmark = pytest.mark.integration


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str = "ask", **kwargs):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi! Ask me about the papers."}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def test_models_are_the_query_pipelines(client):
    assert sorted(m.id for m in client.models.list()) == ["ask", "search"]
    assert client.models.retrieve("search").owned_by == "ragline"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("index")
    assert caught.value.code == "model_not_found"


def test_completion_with_sources_and_verification_as_extras(client, fresh_script, scripted_llm):
    scripted_llm.requests.clear()
    completion = ask(client, temperature=0.7, max_tokens=50)
    assert completion.object == "chat.completion" and completion.model == "ask" and completion.id
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == fresh_script.answer
    assert choice.finish_reason == "stop"
    usage = completion.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    sources = completion.model_extra["sources"]
    assert sources[0]["number"] == 1 and sources[0]["passage"] and sources[0]["source_id"]
    assert completion.model_extra["verification"] == {"verdict": "supported", "refused": False, "reason": "",
                                                      "confidence": pytest.approx(0.905, abs=1e-3)}
    generation = [r for r in scripted_llm.requests
                  if "messages" in r and "Statement:" not in r["messages"][-1]["content"]]
    assert QUESTION in generation[0]["messages"][-1]["content"]  # the last user message is the question


def test_search_model_answers_with_numbered_passages(client):
    completion = ask(client, model="search")
    assert completion.choices[0].message.content.startswith("[1] ")
    assert len(completion.model_extra["sources"]) == 3 or len(completion.model_extra["sources"]) > 3
    assert completion.model_extra["verification"]["refused"] is False


def test_streaming_chunks_usage_and_extras(client, fresh_script):
    chunks = list(ask(client, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == fresh_script.answer and sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 3
    stop = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(stop) == 1 and stop[0].choices[0].finish_reason == "stop"
    assert stop[0].model_extra["sources"][0]["number"] == 1
    assert stop[0].model_extra["verification"]["verdict"] == "supported"
    assert stop[0].model_extra["verification"]["replaced_by_refusal"] is False
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done_and_has_no_usage_unless_asked(served, fresh_script):
    body = {"model": "ask", "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    response = httpx.post(f"{served}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    frames = [block for block in response.text.split("\n\n") if block.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    decoded = [json.loads(f[6:]) for f in frames[:-1]]
    assert all("usage" not in d for d in decoded) and decoded[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_draft_withdrawn_by_verification(client, fresh_script):
    fresh_script.answer, fresh_script.verdict = "Newborn brains are measured with rulers [1].", "No"
    chunks = list(ask(client, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith(fresh_script.answer) and text.endswith("I cannot answer this question")
    verification = chunks[-1].model_extra["verification"]
    assert verification["refused"] and verification["replaced_by_refusal"] and verification["reason"]
    assert chunks[-1].model_extra["sources"] == []
    plain = ask(client)
    assert plain.choices[0].message.content == "I cannot answer this question"
    assert plain.model_extra["verification"]["refused"] is True


def test_errors_are_openai_shaped(client, served):
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client, model="gpt-4")
    assert caught.value.code == "model_not_found" and "search, ask" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="ask", messages=[{"role": "assistant", "content": "hi"}])
    assert caught.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, extra_body={"filters": {"$nope": 1}})
    assert caught.value.param == "filters"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()
    url = f"{served}/v1/chat/completions"
    malformed = httpx.post(url, content=b'{"model": "ask", "messages": [',
                           headers={**AUTH, "Content-Type": "application/json"})
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    no_messages = httpx.post(url, json={"model": "ask", "messages": []}, headers=AUTH)
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    assert "detail" not in no_messages.json()


def test_failure_while_streaming_raises_in_the_client(down_project):
    from ragline.flows.serve.app import create_app

    with running(create_app(str(down_project), token=TOKEN)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        with pytest.raises(openai.APIError, match="LLM endpoint"):
            list(ask(client, stream=True))
        with pytest.raises(openai.InternalServerError) as caught:
            ask(client)
        assert caught.value.status_code == 503 and str(down_project.parent) not in caught.value.message


def test_prompt_delimiters_never_reach_the_answer_streamed_or_not(client, fresh_script):
    """Issue 15 item 5: a model that echoes its prompt's markup ('... [1]. </document> [1]')."""
    fresh_script.answer = "Diffusion tensor imaging measures it [1]. </document> [1]"
    plain = ask(client).choices[0].message.content
    chunks = list(ask(client, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain == "Diffusion tensor imaging measures it [1]. [1]"
    assert "document" not in streamed and streamed.strip() == plain


def test_a_refusal_the_model_writes_itself_is_shown_once(client, fresh_script):
    """Issue 15 item 5: nothing was withdrawn, so no withdrawal note and no second refusal."""
    fresh_script.answer = "I cannot answer this question."
    chunks = list(ask(client, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.count("I cannot answer this question") == 1 and "withdrew" not in streamed
    verification = chunks[-1].model_extra["verification"]
    assert verification["refused"] is True and verification["replaced_by_refusal"] is False
