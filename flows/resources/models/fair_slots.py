"""A concurrency limit that serves the oldest query first: how LLM calls share one endpoint.

vLLM batches whatever is in flight, so the client-side limit exists to bound load, not to order
it; a plain semaphore orders it badly. Under load, a query that has already streamed its answer and
now needs one short verification call queues behind every newer query's first call, so in-flight
queries stall while new ones start, and tail latency grows with the queue. ``FairSlots`` hands a
freed slot to the waiter whose *query* arrived first (``QUERY_ARRIVAL``), then in request order:
queries finish in the order they came, and none waits for more than the queries ahead of it.

Measured (``bench/llm_queueing.py``: 50 closed-loop clients, `ask`-shaped queries through the real
``LLMClient``, vLLM's batching simulated as measured on this project's CPU server, where prefill is
compute-bound and 1, 4, 8 or 16 requests in flight all give ~0.06 requests/s): throughput is the
engine's whatever the order (1.8 queries/min), so the policy only decides who waits. With one plain
semaphore, a started query's later calls wait behind newer queries' (answer p95 752 s, /tokenize
p95 658 s) and query latency spreads out: p95 2,079 s, max 2,557 s. Oldest query first, in two
lanes: the wait moves to a query's first call, where it holds nothing; later calls wait little
(answer p95 71 s, /tokenize and verify under 1 s) and p95 falls to 1,701 s, max to 1,736 s. No
client limit at all (everything in vLLM at once) shares the engine evenly instead: p95 1,794 s,
max 1,864 s, and every query slows as load grows. A larger limit pays where batching does (a GPU):
``max_concurrency`` sets it per lane.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ragline.flows import telemetry
from ragline.flows.context import QUERY_ARRIVAL


class FairSlots:
    """At most ``limit`` holders; a freed slot goes to the waiter of the oldest query."""

    def __init__(self, limit: int, name: str = "default"):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit, self.name = limit, name  # name: the lane label of the queue-wait metric
        self._held = 0
        self._waiting: list[tuple[float, int, threading.Event]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextmanager
    def slot(self, arrival: float | None = None) -> Iterator[float]:
        """Hold one slot for the block (it gets the seconds waited for it); ``arrival`` defaults to
        the current query's arrival time."""
        asked = time.perf_counter()
        arrival = arrival if arrival is not None else (QUERY_ARRIVAL.get() or time.monotonic())
        turn: threading.Event | None = None
        with self._lock:
            if self._held < self.limit and not self._waiting:
                self._held += 1
            else:
                turn = threading.Event()
                heapq.heappush(self._waiting, (arrival, next(self._order), turn))
        if turn is not None:
            turn.wait()  # the releaser handed its slot over: _held already counts it
        waited = time.perf_counter() - asked
        telemetry.queue_waited(self.name, waited)
        try:
            yield waited
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._waiting:
                heapq.heappop(self._waiting)[2].set()
            else:
                self._held -= 1
