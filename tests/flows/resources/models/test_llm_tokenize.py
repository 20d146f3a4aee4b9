"""Token counting against a real, scripted HTTP server: /tokenize is retried like completions; a
server without it is counted with a local tokenizer; a transient failure never switches modes; and
nothing is ever counted by a silent guess."""
from __future__ import annotations

import logging
import re
import socket
import threading

import pytest

from ragline.flows.resources.models.embedder import resolve_model_path
from ragline.flows.resources.models.llm import LLMClient, LLMSpec, LLMUnavailable
from tests.scripted_llm import ScriptedLLM

MINILM = resolve_model_path("all-MiniLM-L6-v2")  # a real tokenizer folder, offline
TEXTS = ["one two three", "four"]


def client(base_url: str, **overrides) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=base_url, **overrides))


def failing(*statuses: int):
    """A /tokenize script: answer these statuses first (one per request), then vLLM's default."""
    queue, lock = iter(statuses), threading.Lock()

    def script(body: dict) -> tuple[int, dict] | None:
        with lock:
            status = next(queue, None)
        return None if status is None else (status, {"error": {"message": "scripted", "type": "x"}})
    return script


def tokenize_calls(server: ScriptedLLM) -> int:
    return sum(path.endswith("/tokenize") for path in server.paths)


def minilm_counts(texts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("status", [500, 503, 429])
def test_a_transient_failure_is_retried_and_the_server_stays_in_use(status):
    with ScriptedLLM(tokenize=failing(status)) as server:
        llm = client(server.base_url, max_retries=2, tokenizer=MINILM)
        assert llm.count_tokens(["one two three"]) == [3]  # the server's word count, not the local tokenizer
        assert tokenize_calls(server) == 2 and llm.token_counting == "server"
        assert llm.count_tokens(TEXTS) == [3, 1] and tokenize_calls(server) == 4


def test_persistent_failure_names_the_endpoint_and_switches_nothing():
    with ScriptedLLM(tokenize=failing(*[500] * 3)) as server:
        llm = client(server.base_url, max_retries=2, tokenizer=MINILM, chars_per_token=4)
        url = server.base_url.removesuffix("/v1") + "/tokenize"
        with pytest.raises(LLMUnavailable, match=rf"did not answer after 3 attempts \(POST {re.escape(url)}\)"):
            llm.count_tokens(["one two three"])
        assert tokenize_calls(server) == 3 and llm.token_counting is None
        assert llm.count_tokens(TEXTS) == [3, 1] and llm.token_counting == "server"  # recovered: server again


def test_server_down_is_an_error_not_an_estimate():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    llm = client(f"http://127.0.0.1:{port}/v1", max_retries=1, chars_per_token=4)
    with pytest.raises(LLMUnavailable, match=rf"127.0.0.1:{port}/tokenize\): APIConnectionError"):
        llm.count_tokens(TEXTS)


def test_a_refused_request_is_reported_not_worked_around():
    with ScriptedLLM(tokenize=failing(400)) as server:
        llm = client(server.base_url, tokenizer=MINILM)
        with pytest.raises(RuntimeError, match=r"refused the request \(POST .*/tokenize\) \(HTTP 400\)"):
            llm.count_tokens(["one"])
        assert tokenize_calls(server) == 1


@pytest.mark.parametrize("status", [404, 405])
def test_no_tokenize_endpoint_uses_the_configured_tokenizer(status):
    texts = ["Tokenization splits words into word pieces.", "hello"]
    with ScriptedLLM(tokenize=lambda body: (status, {"detail": "Not Found"})) as server:
        llm = client(server.base_url, tokenizer=MINILM)
        assert llm.count_tokens(texts) == minilm_counts(texts) and llm.token_counting == "local"
        asked = tokenize_calls(server)
        assert llm.count_tokens(texts) == minilm_counts(texts)
        assert tokenize_calls(server) == asked  # the server has none: not asked again


def test_no_tokenize_endpoint_uses_the_served_models_own_folder():
    texts = ["Tokenization splits words into word pieces."]
    with ScriptedLLM(tokenize=lambda body: (404, {})) as server:
        llm = client(server.base_url, model=str(MINILM))
        assert llm.count_tokens(texts) == minilm_counts(texts) and llm.token_counting == "local"


@pytest.mark.parametrize("answer", [(404, {"detail": "Not Found"}), (405, {}), (200, {"tokens": [1, 2]})])
def test_no_tokenize_and_no_tokenizer_is_a_clear_error(answer):
    with ScriptedLLM(tokenize=lambda body: answer) as server:
        llm = client(server.base_url)
        with pytest.raises(RuntimeError, match=rf"LLM endpoint {re.escape(server.base_url)} .* has no /tokenize "
                                               r".*set `tokenizer:` on the llm resource"):
            llm.count_tokens(TEXTS)
        assert llm.token_counting is None


def test_a_tokenizer_that_does_not_load_is_an_error(tmp_path):
    with ScriptedLLM(tokenize=lambda body: (404, {})) as server:
        llm = client(server.base_url, tokenizer=str(tmp_path / "missing"))
        with pytest.raises(RuntimeError, match=r"the tokenizer '.*missing' configured for LLM endpoint"):
            llm.count_tokens(TEXTS)


def test_an_estimate_is_opt_in_warned_once_and_visible(caplog):
    with ScriptedLLM(tokenize=lambda body: (404, {})) as server, caplog.at_level(logging.WARNING, "ragline.llm"):
        llm = client(server.base_url, chars_per_token=4)
        assert llm.count_tokens(["12345678", "123456789", ""]) == [2, 3, 0]
        assert llm.count_tokens(["1234"]) == [1] and llm.token_counting == "estimate"
    estimates = [r for r in caplog.records if "estimate of 4 characters per token" in r.getMessage()]
    assert len(estimates) == 1


def test_many_texts_are_counted_concurrently_and_in_order():
    with ScriptedLLM(delay=0.05) as server:
        llm = client(server.base_url, max_concurrency=3)
        texts = [" ".join(["w"] * n) for n in range(1, 21)]
        assert llm.count_tokens(texts) == list(range(1, 21)) and tokenize_calls(server) == 20
