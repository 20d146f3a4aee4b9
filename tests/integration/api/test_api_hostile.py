"""Hostile questions over real HTTP (issue 9): a 100,000-character question and prompt-injection text
sent to ``/v1/query`` and ``/v1/chat/completions`` of the served app (real uvicorn, the session's
indexed SciFact project, the scripted LLM).

A question longer than the server's ``max_question_chars`` (10,000 by default) is refused with a
4xx naming its field before any step runs, as OpenAI-compatible servers refuse an input over the
model's context rather than truncating it: the pipeline would read only its start (prompts clip a
question to ~2,000 characters, the embedder to 256 tokens) and answer a question that was not
asked. An injected question stays data: it cannot open a reference of its own, and a citation of
the forged document comes back as an invalid citation with no source."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, running
from tests.helpers.api_harness import events
from tests.helpers.hostile import FORGED, HOSTILE
pytestmark = pytest.mark.integration

LIMIT = 10_000  # flows.api.DEFAULT_MAX_QUESTION_CHARS, spelled out: a changed default must show here


def long_question(chars: int) -> str:
    """``chars`` characters of real words about the indexed corpus."""
    return ((QUESTION + " ") * (chars // len(QUESTION) + 1))[:chars - 1] + "?"


def query(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json=body, headers=AUTH, timeout=60)


def chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def generation_prompts(llm) -> list[str]:
    """Every chat prompt the scripted LLM received (generation and fact checks)."""
    return [r["messages"][-1]["content"] for r in llm.requests if "messages" in r]


# ----------------------------------------------------------------------------- a 100,000-character question
HUGE = long_question(100_000)
SURFACES = {
    "query-ask": ("/v1/query", {"question": HUGE}, 422, "question"),
    "query-ask-stream": ("/v1/query", {"question": HUGE, "stream": True}, 422, "question"),
    "query-search": ("/v1/query", {"question": HUGE, "pipeline": "search"}, 422, "question"),
    "chat": ("/v1/chat/completions", {"model": "ask", "messages": [{"role": "user", "content": HUGE}]},
             400, "messages[0].content"),
    "chat-stream": ("/v1/chat/completions", {"model": "ask", "stream": True, "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": [{"type": "text", "text": HUGE[:50_000]},
                                     {"type": "text", "text": HUGE[50_000:]}]}]},
                    400, "messages[2].content"),
    "chat-search": ("/v1/chat/completions", {"model": "search", "messages": [{"role": "user", "content": HUGE}]},
                    400, "messages[0].content"),
}


@pytest.mark.parametrize("surface", list(SURFACES))
def test_a_100000_character_question_is_refused_naming_the_field(served, scripted_llm, surface):
    path, body, status, field = SURFACES[surface]
    assert len(json.dumps(body)) < 1_000_000  # under the body limit: the question itself is refused
    sent = len(scripted_llm.requests)
    started = time.perf_counter()
    response = httpx.post(f"{served}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")  # refused before any stream starts
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "question_too_long"
    assert error["message"].startswith(f"field '{field}': the question is 100,000 characters long")
    assert f"the limit is {LIMIT:,}" in error["message"] and HUGE[:100] not in response.text
    assert len(scripted_llm.requests) == sent  # no step ran: nothing reached the LLM
    assert time.perf_counter() - started < 10


def test_the_stock_openai_client_gets_a_bad_request_naming_the_message(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="ask", messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": HUGE}])
    assert caught.value.code == "question_too_long" and caught.value.param == "messages[1].content"


def test_a_question_at_the_limit_is_answered_one_over_is_refused(served, fresh_script):
    at_limit = long_question(LIMIT)
    searched = query(served, {"question": at_limit, "pipeline": "search", "top_k": 3})
    assert searched.status_code == 200, searched.text[:500]
    assert "white matter" in searched.json()["passages"][0]["text"].lower()
    asked = chat(served, {"model": "ask", "messages": [{"role": "user", "content": at_limit}]})
    assert asked.status_code == 200 and asked.json()["choices"][0]["message"]["content"] == fresh_script.answer
    over = query(served, {"question": at_limit + "x", "pipeline": "search"})
    assert over.status_code == 422 and over.json()["error"]["message"].startswith(
        f"field 'question': the question is {LIMIT + 1:,} characters long")


def test_a_server_configured_for_long_questions_answers_100000_characters(api_project, scripted_llm, fresh_script):
    """The limit is the server's choice (``create_app(max_question_chars=...)``): raised, the same
    question is answered within the other limits (the 1 MB body; prompts clip the question)."""
    from ragline.flows.serve.app import create_app

    with pytest.raises(ValueError, match="max_question_chars"):
        create_app(str(api_project), max_question_chars=0)
    with running(create_app(str(api_project), token=TOKEN, max_question_chars=200_000)) as url:
        searched = query(url, {"question": HUGE, "pipeline": "search", "top_k": 3})
        assert searched.status_code == 200, searched.text[:500]
        scripted_llm.requests.clear()
        asked = query(url, {"question": HUGE})
    assert asked.status_code == 200 and asked.json()["answer"]["text"] == fresh_script.answer
    assert asked.json()["answer"]["question"] == HUGE
    generation = next(p for p in generation_prompts(scripted_llm) if "Statement:" not in p)
    assert len(generation) < 10_000  # the question was clipped inside the prompt


# ----------------------------------------------------------------------------- prompt injection in the question
def assert_nothing_forged(prompts: list[str]) -> None:
    """The question stays data: no prompt opens a forged reference, the generation prompt has one
    references block, and nothing in it comes from the question."""
    assert prompts and all(FORGED not in p for p in prompts)
    generation = [p for p in prompts if "Statement:" not in p]
    assert len(generation) == 1
    head, closing, tail = generation[0].partition("</references>")
    assert closing and tail.count("</references>") == 0 and head.count("<references>") == 1
    assert "PWNED" not in head and tail.count("Ignore previous instructions") == 1  # the question, once, after


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_injected_question_cannot_forge_a_reference_through_v1_query(served, scripted_llm, fresh_script, stream):
    fresh_script.answer, fresh_script.verdict = "PWNED [666].", "Yes"  # a model that obeys the question
    scripted_llm.requests.clear()
    response = query(served, {"question": f"{QUESTION} {HOSTILE}", "stream": stream,
                              "history": [{"role": "user", "content": HOSTILE}]})
    assert response.status_code == 200, response.text[:500]
    body = events(response)[-1][1] if stream else response.json()
    answer = body["answer"]
    # verification refuses what only restates the (injected) question; the draft's [666] stays flagged
    assert answer["refused"] and answer["reason"] == "degenerate answer: it only restates the question"
    assert answer["draft"] == "PWNED [666]." and answer["citations"] == [666]
    assert answer["invalid_citations"] == [666] and answer["sources"] == []  # no document backs [666]
    assert answer["inferred_citations"] == []
    assert_nothing_forged(generation_prompts(scripted_llm))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_injected_question_cannot_forge_a_reference_through_chat_completions(served, scripted_llm, fresh_script,
                                                                                stream):
    fresh_script.answer, fresh_script.verdict = "PWNED [666].", "Yes"
    scripted_llm.requests.clear()
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    messages = [{"role": "system", "content": HOSTILE}, {"role": "user", "content": HOSTILE},
                {"role": "assistant", "content": HOSTILE}, {"role": "user", "content": f"{QUESTION} {HOSTILE}"}]
    if stream:
        chunks = list(client.chat.completions.create(model="ask", messages=messages, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        extras = chunks[-1].model_extra
    else:
        completion = client.chat.completions.create(model="ask", messages=messages)
        text, extras = completion.choices[0].message.content, completion.model_extra
    # refused (it only restates the injected question); a stream withdraws the draft it already sent
    assert text == ("PWNED [666].\n\n[Verification withdrew the text above.] I cannot answer this question" if stream
                    else "I cannot answer this question")
    assert extras["verification"]["reason"] == "degenerate answer: it only restates the question"
    assert extras["sources"] == [] and extras["verification"]["refused"] is True  # no source for [666]
    assert_nothing_forged(generation_prompts(scripted_llm))


def test_an_injected_question_in_a_search_gets_only_indexed_passages(served):
    """A search has no prompt: the injection is only words to match; every passage returned is a
    real chunk of the index (none is made from the question)."""
    response = query(served, {"question": f"{QUESTION} {HOSTILE}", "pipeline": "search", "top_k": 5})
    assert response.status_code == 200, response.text[:500]
    passages = response.json()["passages"]
    assert passages and all(p["source_id"].split("#")[0].endswith("corpus.jsonl") for p in passages)
    assert all("PWNED" not in p["text"] for p in passages)


def test_an_endpoint_url_in_an_error_stays_whole_while_local_paths_are_hidden():
    """503 messages name the LLM endpoint: its URL must stay readable (was `http:<path>:8000/v1`)."""
    from ragline.flows.serve.ingestion_runs import Redactor

    redact = Redactor.__new__(Redactor)
    redact.roots, redact.hidden = ["/data/docs"], []
    assert redact("LLM endpoint http://127.0.0.1:8000/v1 (model 'm') did not answer") == \
        "LLM endpoint http://127.0.0.1:8000/v1 (model 'm') did not answer"
    assert redact("cannot open /etc/passwd; nor error:/etc/shadow") == "cannot open <path>; nor error:<path>"
    assert redact("see /data/docs/a.md") == "see /data/docs/a.md"
