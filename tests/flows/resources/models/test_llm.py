"""The LLM client over real HTTP (the scripted OpenAI-compatible server): what a request carries,
streaming, logprobs, the short lane that keeps quick checks from waiting behind long answers,
``map`` in order and in the caller's context, health, and URLs without credentials.
(Faults: test_llm_faults.py; hung servers: test_llm_hung.py; token counting: test_llm_tokenize.py.)"""
from __future__ import annotations

import contextvars
import math
import threading
import time

import pytest

from ragline.flows.resources.models.llm import Completion, LLMClient, LLMSpec, TokenLogprob, without_credentials
from tests.scripted_llm import ScriptedLLM

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("test_llm_mark", default="unset")


def client(base_url: str, **fields) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=base_url, **fields))


@pytest.fixture(scope="module")
def echo():
    """Answers every prompt with 'echo: <prompt>'."""
    with ScriptedLLM(lambda prompt: f"echo: {prompt}", logprob=-0.5) as server:
        yield server


def test_a_chat_request_carries_the_specs_defaults(echo):
    answer = client(echo.base_url, model="m1", max_tokens=77, temperature=0.3, seed=5).chat("hello there")
    assert answer.text == "echo: hello there" and answer.finish_reason == "stop" and answer.tokens == []
    body = echo.requests[-1]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"]) == ("m1", 77, 0.3, 5)
    assert "stop" not in body and "response_format" not in body and "logprobs" not in body


def test_a_chat_request_carries_what_the_caller_asks(echo):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    answer = client(echo.base_url, seed=None).chat(messages, max_tokens=9, temperature=0.0, logprobs=True,
                                                   top_logprobs=2, stop=["\n"], json_schema=schema)
    body = echo.requests[-1]
    assert body["messages"] == messages and body["max_tokens"] == 9 and body["stop"] == ["\n"]
    assert "seed" not in body and body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert [t.token for t in answer.tokens] == ["echo: ", "why?"]
    assert answer.tokens[0].top == {"echo: ": -0.5} and answer.mean_prob() == pytest.approx(math.exp(-0.5))


def test_a_stream_hands_each_piece_to_on_token_in_order(echo):
    seen: list[str] = []
    answer = client(echo.base_url).stream("one two three", on_token=seen.append, logprobs=True)
    assert seen == ["echo: ", "one ", "two ", "three"] and answer.text == "echo: one two three"
    assert answer.finish_reason == "stop" and len(answer.tokens) == 4
    assert echo.requests[-1]["stream"] is True


def test_a_short_check_does_not_wait_behind_a_long_answer():
    """One slot per lane: a 2-token check is answered while a long stream holds the long lane."""
    with ScriptedLLM(lambda prompt: " ".join(["w"] * 20), chunk_delay=0.1) as server:
        llm = client(server.base_url, max_concurrency=1)
        finished: dict[str, float] = {}

        def long_answer() -> None:
            llm.stream("tell me everything")
            finished["stream"] = time.perf_counter()

        streaming = threading.Thread(target=long_answer)
        streaming.start()
        while not server.requests:
            time.sleep(0.01)
        assert llm.chat("is it?", max_tokens=2).text
        finished["check"] = time.perf_counter()
        streaming.join(30)
        assert finished["check"] < finished["stream"]  # not queued behind the 2 s stream


def test_long_answers_share_the_long_lane_one_at_a_time():
    with ScriptedLLM(delay=0.4) as server:
        llm = client(server.base_url, max_concurrency=1)
        started = time.perf_counter()
        threads = [threading.Thread(target=llm.chat, args=("q",)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert time.perf_counter() - started >= 3 * 0.4 and len(server.requests) == 3


def test_map_keeps_order_and_the_callers_context(echo):
    llm = client(echo.base_url, max_concurrency=3)
    MARK.set("query 7")

    def ask(text: str) -> tuple[str, str]:
        return llm.chat(text).text, MARK.get()

    assert llm.map(ask, ["a", "b", "c", "d", "e"]) == [(f"echo: {t}", "query 7") for t in "abcde"]
    assert llm.map(ask, []) == [] and llm.map(ask, ["x"]) == [("echo: x", "query 7")]


def test_map_starts_nothing_more_after_a_failure():
    started: list[int] = []

    def work(item: int) -> int:
        started.append(item)
        if item == 0:
            raise ValueError("first item fails")
        time.sleep(0.2)
        return item

    llm = client("http://127.0.0.1:9/v1", max_concurrency=1)
    with pytest.raises(ValueError, match="first item fails"):
        llm.map(work, list(range(10)))
    time.sleep(0.3)
    assert len(started) < 10


def test_health_is_up_only_for_a_server_that_answers(echo):
    assert client(echo.base_url).health().status == "up"
    assert echo.paths[-1] == "/health"
    with ScriptedLLM() as stopped:
        url = stopped.base_url
    down = client(url).health()
    assert down.status == "down" and "unreachable" in down.error


@pytest.mark.parametrize("base_url, root", [
    ("http://h:8000/v1", "http://h:8000"), ("http://h:8000/v1/", "http://h:8000"), ("http://h/llm/v1", "http://h/llm"),
])
def test_health_and_tokenize_urls_are_beside_the_api_root(base_url, root):
    llm = client(base_url)
    assert (llm.health_url, llm.tokenize_url) == (f"{root}/health", f"{root}/tokenize")


def test_credentials_never_show_in_the_location_nor_the_spec():
    llm = client("https://user:s3cret@llm.example/v1", api_key="sk-hidden", model="big")
    assert llm.location == "LLM endpoint https://<credentials>@llm.example/v1 (model 'big')"
    assert "sk-hidden" not in repr(llm.spec) and "s3cret" not in without_credentials(llm.spec.base_url)
    assert without_credentials("http://plain:80/v1") == "http://plain:80/v1"


def test_only_what_shapes_answers_is_fingerprinted():
    spec = LLMSpec(type="openai_compatible", model="m", temperature=0.2, seed=3, base_url="http://other/v1",
                   api_key="k", max_concurrency=9)
    assert LLMClient.fingerprint_fields(spec) == {"model": "m", "temperature": 0.2, "seed": 3}


def test_confidence_is_the_geometric_mean_token_probability():
    tokens = [TokenLogprob("a", math.log(0.5)), TokenLogprob("b", math.log(0.125))]
    assert Completion("ab", tokens).mean_prob() == pytest.approx(0.25)
    assert Completion("").mean_prob() is None and tokens[0].prob == pytest.approx(0.5)
