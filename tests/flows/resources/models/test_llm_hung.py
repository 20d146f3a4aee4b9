"""A hung LLM server (accepts connections, never answers) is reported within ``hung_after_seconds``,
never retried, naming the endpoint; a busy one (it answers its health check) is waited for; the
client answers again once the server is back. Real sockets: the scripted server really hangs."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from ragline.flows.resources.models.llm import LLMClient, LLMSpec, LLMUnavailable
from tests.scripted_llm import ScriptedLLM


def client(base_url: str, **overrides) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=base_url, **overrides))


def test_defaults_report_a_hung_server_well_under_a_minute():
    spec = LLMSpec(type="openai_compatible")
    assert spec.hung_after_seconds <= 30 and spec.max_retries >= 1  # retries stay, for refused connections


def test_a_hung_server_is_reported_in_hung_after_seconds_and_not_retried(caplog):
    with ScriptedLLM(hung=True) as server:
        llm = client(server.base_url, hung_after_seconds=2, timeout_seconds=60, max_retries=3)
        started = time.perf_counter()
        with caplog.at_level(logging.INFO, logger="ragline.llm"):
            with pytest.raises(LLMUnavailable) as failed:
                llm.chat("hello")
        elapsed = time.perf_counter() - started
        message = str(failed.value)
        assert f"LLM endpoint {server.base_url} (model 'smollm2') accepted the request but has not answered" in message
        assert "nor its health check" in message and "not retried" in message and "hung_after_seconds: 2" in message
        assert elapsed > 1.5  # hung_after_seconds waited; the message names it, not the 60 s timeout
        assert len(server.requests) == 1 and server.paths.count("/health") == 1
        assert any("no answer from" in r.getMessage() and "checking that it is up" in r.getMessage()
                   for r in caplog.records)  # the waiting message, before the error


def test_a_busy_server_that_answers_its_health_check_is_waited_for(caplog):
    with ScriptedLLM(reply=lambda p: "slow but fine", delay=1.6) as server:
        llm = client(server.base_url, hung_after_seconds=0.6, timeout_seconds=30, max_retries=0)
        with caplog.at_level(logging.INFO, logger="ragline.llm"):
            assert llm.chat("hello").text == "slow but fine"
        assert server.paths.count("/health") >= 1 and len(server.requests) == 1
        assert any("so it is busy" in r.getMessage() for r in caplog.records)


def test_a_slow_answer_is_not_retried_after_timeout_seconds():
    with ScriptedLLM(delay=1.5) as server:
        llm = client(server.base_url, timeout_seconds=0.3, hung_after_seconds=20, max_retries=3)
        with pytest.raises(LLMUnavailable, match=r"did not answer within 0.3 s \(timeout_seconds\): APITimeoutError"):
            llm.chat("hello")
        assert len(server.requests) == 1


def test_a_stream_that_stops_midway_on_a_hung_server_is_reported():
    with ScriptedLLM(reply=lambda p: "one two three four five six", hang_after_chunks=3) as server:
        llm = client(server.base_url, hung_after_seconds=1, timeout_seconds=60, max_retries=2)
        seen: list[str] = []

        def on_token(piece: str) -> None:
            seen.append(piece)
            server.hung = True  # from here on the server answers nothing, not even its health check

        with pytest.raises(LLMUnavailable, match="has not answered in .* nor its health check"):
            llm.stream("count", on_token=on_token)
        assert seen[:2] == ["one ", "two "]
        assert len(server.requests) == 1  # tokens were shown: never repeated


def test_tokenize_on_a_hung_server_names_the_request():
    with ScriptedLLM(hung=True) as server:
        llm = client(server.base_url, hung_after_seconds=1)
        with pytest.raises(LLMUnavailable, match=r"accepted the request \(POST .*/tokenize\) but has not answered"):
            llm.count_tokens(["one two", "three"])


def test_the_client_answers_again_once_the_server_is_back():
    with ScriptedLLM(reply=lambda p: "back", hung=True) as server:
        llm = client(server.base_url, hung_after_seconds=1, timeout_seconds=60)
        with pytest.raises(LLMUnavailable):
            llm.chat("hello")
        server.hung = False
        started = time.perf_counter()
        assert llm.chat("hello").text == "back"
        assert time.perf_counter() - started < 5


def test_many_waiters_on_a_hung_server_share_health_checks():
    with ScriptedLLM(hung=True) as server:
        llm = client(server.base_url, hung_after_seconds=2, max_concurrency=8)
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                llm.chat("hello")
            except LLMUnavailable as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(8)]
        [t.start() for t in threads]
        [t.join(20) for t in threads]
        assert len(errors) == 8 and server.paths.count("/health") <= 3
