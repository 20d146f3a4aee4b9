"""FairSlots: the limit holds, older queries are served first, and the LLM's short calls never
wait behind other queries' long streams (real threads, a real HTTP server for the LLM)."""
from __future__ import annotations

import threading
import time

from ragline.flows.context import QUERY_ARRIVAL
from ragline.flows.resources.models.fair_slots import FairSlots
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from tests.scripted_llm import ScriptedLLM


def _wait_until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_never_more_holders_than_the_limit():
    """Holders keep their slot until released, so the limit is reached however slowly the threads
    start on a loaded machine (a fixed 10 ms hold let each finish before the next began)."""
    slots, held, peak, lock, release = FairSlots(3), [0], [0], threading.Lock(), threading.Event()

    def work() -> None:
        with slots.slot():
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            release.wait(30)
            with lock:
                held[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(20)]
    for t in threads:
        t.start()
    _wait_until(lambda: held[0] == 3 and slots.waiting == 17)
    time.sleep(0.05)  # a fourth holder, if the limit leaked, would show up now
    assert held[0] == 3
    release.set()
    for t in threads:
        t.join()
    assert peak[0] == 3 and slots.waiting == 0 and held[0] == 0


def test_a_freed_slot_goes_to_the_oldest_query_then_in_request_order():
    slots, served = FairSlots(1), []
    holder = slots.slot(arrival=0.0)
    holder.__enter__()

    def wait(name: str, arrival: float) -> None:
        with slots.slot(arrival=arrival):
            served.append(name)

    # Requests come in this order; their queries arrived at these times.
    order = [("new query", 30.0), ("old query, later call", 10.0), ("middle", 20.0), ("old query, next call", 10.0)]
    threads = []
    for name, arrival in order:
        threads.append(threading.Thread(target=wait, args=(name, arrival)))
        threads[-1].start()
        _wait_until(lambda n=len(threads): slots.waiting == n)
    holder.__exit__(None, None, None)
    for t in threads:
        t.join(5)
    assert served == ["old query, later call", "old query, next call", "middle", "new query"]


def test_the_arrival_of_the_current_query_is_the_default():
    slots, served = FairSlots(1), []
    holder = slots.slot(arrival=0.0)
    holder.__enter__()

    def wait(name: str, arrival: float) -> None:
        QUERY_ARRIVAL.set(arrival)  # as engine.run does for the query's step threads
        with slots.slot():
            served.append(name)

    for name, arrival in (("late", 2.0), ("early", 1.0)):
        threading.Thread(target=wait, args=(name, arrival)).start()
    _wait_until(lambda: slots.waiting == 2)
    holder.__exit__(None, None, None)
    _wait_until(lambda: len(served) == 2)
    assert served == ["early", "late"]


def test_short_llm_calls_are_not_blocked_by_a_long_stream():
    """One slot per lane: while a slow stream holds the long lane, a verify-sized call answers."""
    with ScriptedLLM(lambda prompt: " ".join(["word"] * 40), chunk_delay=0.05) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_concurrency=1, max_retries=0))
        streamed: list[str] = []
        streaming = threading.Thread(target=llm.stream, args=("tell me a long story",),
                                     kwargs={"max_tokens": 256, "on_token": streamed.append})
        streaming.start()
        _wait_until(lambda: len(server.requests) == 1)
        assert llm.chat("Statement: ... Yes or No?", max_tokens=2).text
        words_by_then = len(streamed)  # event order, not the wall clock: how far the stream had got
        streaming.join(10)
        assert words_by_then < len(streamed) == 40, (words_by_then, len(streamed))  # answered mid-stream (~2 s)


def in_query_thread(arrival: float, call) -> threading.Thread:
    """``call`` on a thread of a query that arrived at ``arrival``, as engine.run sets it."""
    def target() -> None:
        QUERY_ARRIVAL.set(arrival)
        call()
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def test_token_counts_from_a_pool_queue_as_their_query_not_as_a_new_one():
    """count_tokens sends /tokenize from pool threads: they still carry their query's arrival."""
    with ScriptedLLM() as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_concurrency=1, max_retries=0))
        holder = llm._short.slot(arrival=0.0)
        holder.__enter__()

        newer = in_query_thread(2.0, lambda: llm.chat("Statement: a check of a newer query", max_tokens=2))
        _wait_until(lambda: llm._short.waiting == 1)
        older = in_query_thread(1.0, lambda: llm.count_tokens(["one two", "three"]))
        _wait_until(lambda: llm._short.waiting == 2)
        holder.__exit__(None, None, None)
        newer.join(10)
        older.join(10)
        assert server.paths[0].endswith("/tokenize") and len(server.paths) == 3


def test_calls_a_stage_fans_out_with_llm_map_queue_as_their_query():
    """Pointwise rerank, chain-of-note and extraction fan out with LLMClient.map: same rule."""
    with ScriptedLLM(lambda prompt: "Yes") as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_concurrency=1, max_retries=0))
        holder = llm._short.slot(arrival=0.0)
        holder.__enter__()
        served: list[str] = []

        def judge(name: str) -> None:
            llm.chat(f"Statement: {name}", max_tokens=1)
            served.append(name)

        newer = in_query_thread(2.0, lambda: judge("newer"))
        _wait_until(lambda: llm._short.waiting == 1)
        older = in_query_thread(1.0, lambda: llm.map(judge, ["older 1", "older 2"]))
        _wait_until(lambda: llm._short.waiting == 2)
        holder.__exit__(None, None, None)
        newer.join(10)
        older.join(10)
        assert served[0] == "older 1" and sorted(served) == ["newer", "older 1", "older 2"]
