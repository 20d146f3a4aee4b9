"""LLM endpoint faults: down, slow, failing, refusing — retried, then one clear error naming it."""
from __future__ import annotations

import time

import pytest

from ragline.flows.resources.models.llm import LLMClient, LLMSpec, LLMUnavailable
from tests.helpers.net import closed_port, serve_in_thread
from tests.scripted_llm import ScriptedLLM


def client(base_url: str, **overrides) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=base_url, **overrides))


def test_server_down_names_the_endpoint():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(LLMUnavailable, match=rf"LLM endpoint {url} \(model 'smollm2'\) did not answer after 2 attempts"):
        client(url, max_retries=1).chat("hello")


def test_slow_server_times_out_without_retries():
    """A timeout is not retried: the same request would take as long again (test_llm_hung.py)."""
    with ScriptedLLM(delay=1.5) as server:
        with pytest.raises(LLMUnavailable, match="APITimeoutError"):  # the 1.5 s answer would have come
            client(server.base_url, timeout_seconds=0.3, max_retries=2).chat("hello")
        assert len(server.requests) == 1


def test_server_errors_are_retried_then_reported():
    with ScriptedLLM(status=500) as server:
        with pytest.raises(LLMUnavailable, match="InternalServerError"):
            client(server.base_url, max_retries=2).chat("hello")
        assert len(server.requests) == 3


def test_a_malformed_response_is_retried_then_named():
    with ScriptedLLM(lambda p: "Paris", malformed=True) as server:
        with pytest.raises(LLMUnavailable, match=r"\(model 'smollm2'\) sent a malformed response \(2 attempts\): "
                                                 r"JSONDecodeError"):
            client(server.base_url, max_retries=1).chat("hello")
        assert len(server.requests) == 2
        server.malformed = False  # the server is fixed: the same client answers
        assert client(server.base_url, max_retries=1).chat("hello").text == "Paris"


def test_a_stream_cut_mid_answer_is_an_error_not_a_short_answer():
    """Words already streamed to the caller cannot be taken back, so a cut stream is not retried;
    one cut before the first word is."""
    tokens: list[str] = []
    with ScriptedLLM(lambda p: "Paris is the capital of France", cut_after_chunks=3) as server:
        with pytest.raises(LLMUnavailable, match=r"stopped after 9 characters without an end .*partial answer is "
                                                 r"discarded"):
            client(server.base_url, max_retries=2).stream("hello", on_token=tokens.append)
        assert tokens == ["Paris ", "is "] and len(server.requests) == 1
        server.cut_after_chunks = 1  # cut after the role chunk: nothing was shown, so it is tried again
        with pytest.raises(LLMUnavailable, match=r"\(3 attempts\): the streamed answer stopped after 0 characters"):
            client(server.base_url, max_retries=2).stream("hello")
        assert len(server.requests) == 4
        server.cut_after_chunks = None
        assert client(server.base_url).stream("hello").text == "Paris is the capital of France"


def test_bad_request_is_not_retried():
    with ScriptedLLM(status=400) as server:
        with pytest.raises(RuntimeError, match=r"refused the request \(HTTP 400\)"):
            client(server.base_url, max_retries=3).chat("hello")
        assert len(server.requests) == 1


def test_concurrency_is_capped():
    import threading

    with ScriptedLLM(delay=1.0) as server:  # long enough to overlap even on a starved machine
        llm = client(server.base_url, max_concurrency=2)
        active, peak, lock = [0], [0], threading.Lock()
        original = llm._call

        def counting(request, lane):
            def wrapped():
                with lock:
                    active[0] += 1
                    peak[0] = max(peak[0], active[0])
                try:
                    return request()
                finally:
                    with lock:
                        active[0] -= 1
            return original(wrapped, lane)

        llm._call = counting
        threads = [threading.Thread(target=llm.chat, args=("hi",)) for _ in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert peak[0] == 2 and len(server.requests) == 6


def test_logprobs_and_token_counting_over_http():
    with ScriptedLLM(reply=lambda p: "Yes indeed") as server:
        llm = client(server.base_url)
        reply = llm.chat("is it?", logprobs=True, top_logprobs=2)
        assert reply.text == "Yes indeed" and [t.token for t in reply.tokens] == ["Yes ", "indeed"]
        assert reply.mean_prob() == pytest.approx(0.905, abs=1e-3)
        assert llm.count_tokens(["one two three", "four"]) == [3, 1]


def test_credentials_in_the_endpoint_url_never_reach_a_message():
    url = f"http://alice:s3cret@127.0.0.1:{closed_port()}/v1"
    with pytest.raises(LLMUnavailable) as failure:
        client(url, max_retries=0).chat("hello")
    assert "s3cret" not in str(failure.value) and "alice" not in str(failure.value)
    assert "http://<credentials>@127.0.0.1:" in str(failure.value)


@pytest.mark.parametrize("retry_after, slept", [(None, [0.5, 1.0, 2.0]), ("1.3", [1.3, 1.3, 2.0]), ("100", [30.0] * 3)],
                         ids=["backoff", "retry-after", "retry-after-capped"])
def test_429_backs_off_exponentially_or_as_the_server_asks(monkeypatch, retry_after, slept):
    """The retry policy: 0.5 s doubling (to 8 s), or the server's Retry-After when longer (to 30 s)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class TooMany(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if retry_after:
                self.send_header("Retry-After", retry_after)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    waits: list[float] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), TooMany)
    serve_in_thread(server)
    monkeypatch.setattr(time, "sleep", waits.append)
    try:
        with pytest.raises(LLMUnavailable, match=r"did not answer after 4 attempts: RateLimitError"):
            client(f"http://127.0.0.1:{server.server_address[1]}/v1", max_retries=3).chat("hello")
    finally:
        server.shutdown()
    assert waits == slept
