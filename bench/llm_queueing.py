"""How LLM calls should share one endpoint under load: queueing policies compared on a simulated vLLM.

50 closed-loop clients send `ask`-shaped queries through the API's driver pool (32 queries at once)
and the real ``LLMClient`` (its lanes and ``FairSlots``); only the HTTP call is replaced, by an
in-process model of vLLM's continuous batching, calibrated on the CPU vLLM server of this machine
(SmolLM2-135M, bf16, eager; measured with the machine under load):

- prefill is compute-bound: 367 prompt tokens take 12.2 s alone and 44.9 s for 4 at once (~32 tokens/s,
  no gain from batching);
- decoding batches a little: 32 tokens take 6.1 s alone, 14.2 s for 4 at once;
- 32-token answers on 367-token prompts: 0.05-0.07 requests/s at 1, 4, 8 or 16 in flight (flat).

So each engine step decodes one token for every running request and prefills up to 512 waiting
prompt tokens (first come, first served, as vLLM's scheduler does); a step takes
``0.10 + 0.08 * decoding + prefill_tokens / 32`` seconds. Time runs ``--scale`` times faster than real
(0.01: a 12 s prefill takes 0.12 s), so a policy takes ~20-40 s here and nothing touches the network.

A query is: conversational rewrite (60 prompt tokens, 20 generated, max_tokens 128), /tokenize of
its 5 passages (in parallel, ~50 ms, never touching the engine), the answer (350 prompt tokens, 64
generated) and the verification (350 prompt tokens, 2 generated). Reported: query latency as the
client sees it (driver queue included), throughput, and how long each kind of call waited for a
slot before reaching the endpoint.

Usage: .venv/bin/python bench/llm_queueing.py [--clients 50] [--queries 2] [--scale 0.01]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable

from common import percentile, publish, save

from ragline.flows.context import QUERY_ARRIVAL
from ragline.flows.resources.base import Lazy
from ragline.flows.resources.models.fair_slots import FairSlots
from ragline.flows.resources.models.llm import LLMClient, LLMSpec

STEP_OVERHEAD, PER_DECODE, PREFILL_RATE, PREFILL_BUDGET = 0.10, 0.08, 32.0, 512
TOKENIZE_SECONDS = 0.05
CALLS = {  # kind: (prompt tokens, tokens generated, max_tokens asked)
    "rewrite": (60, 20, 128),
    "answer": (350, 64, 64),
    "verify": (350, 2, 2),
}


class SimulatedVLLM:
    """Continuous batching in scaled real time: a thread runs engine steps; callers block until done."""

    def __init__(self, scale: float):
        self.scale = scale
        self._new: list[dict] = []
        self._running: list[dict] = []
        self._cond = threading.Condition()
        self._stop = False
        self.arrived: dict[str, float] = {}  # call id -> when it reached the endpoint
        self.peak_in_flight = 0
        self.busy = {"overhead": 0.0, "decode": 0.0, "prefill": 0.0, "steps": 0}
        threading.Thread(target=self._loop, daemon=True, name="sim-vllm").start()

    def generate(self, call_id: str, prompt_tokens: int, out_tokens: int) -> None:
        request = {"prefill": prompt_tokens, "out": out_tokens, "done": threading.Event()}
        with self._cond:
            self.arrived[call_id] = time.monotonic()
            self._new.append(request)
            self._cond.notify()
        request["done"].wait()

    def tokenize(self, call_id: str) -> None:
        self.arrived[call_id] = time.monotonic()
        time.sleep(TOKENIZE_SECONDS * self.scale)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _loop(self) -> None:
        deadline = time.monotonic()
        while True:
            with self._cond:
                while not (self._new or self._running or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                self._running += self._new
                self._new = []
                self.peak_in_flight = max(self.peak_in_flight, len(self._running))
                decoding = [r for r in self._running if r["prefill"] == 0]
                budget, prefilled = PREFILL_BUDGET, []
                for r in self._running:  # first come, first served
                    if r["prefill"] and budget:
                        take = min(r["prefill"], budget)
                        budget -= take
                        prefilled.append((r, take))
            step = STEP_OVERHEAD + PER_DECODE * len(decoding) + (PREFILL_BUDGET - budget) / PREFILL_RATE
            self.busy["overhead"] += STEP_OVERHEAD
            self.busy["decode"] += PER_DECODE * len(decoding)
            self.busy["prefill"] += (PREFILL_BUDGET - budget) / PREFILL_RATE
            self.busy["steps"] += 1
            deadline = max(deadline, time.monotonic()) + step * self.scale
            time.sleep(max(0.0, deadline - time.monotonic()))
            with self._cond:
                for r in decoding:
                    r["out"] -= 1
                for r, take in prefilled:
                    r["prefill"] -= take
                    if r["prefill"] == 0:
                        r["out"] -= 1  # the step that ends a prefill yields the first token
                for r in [r for r in self._running if r["out"] <= 0]:
                    r["done"].set()
                    self._running.remove(r)


class FakeOpenAI:
    """The two calls LLMClient makes (chat completions, POST /tokenize), answered by the simulation."""

    def __init__(self, engine: SimulatedVLLM):
        self.engine = engine
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kwargs):
        call_id, prompt_tokens, out_tokens = kwargs["messages"][-1]["content"].split("|")
        self.engine.generate(call_id, int(prompt_tokens), int(out_tokens))
        message = SimpleNamespace(content="text")
        return SimpleNamespace(choices=[SimpleNamespace(message=message, logprobs=None, finish_reason="stop")])

    def post(self, url, body, cast_to):
        self.engine.tokenize(body["prompt"])
        return json.dumps({"count": 80})


class PlainSemaphore:
    """The policy before FairSlots: one bounded semaphore for every call, first come first served."""

    def __init__(self, limit: int):
        self._semaphore = threading.BoundedSemaphore(limit)

    @contextmanager
    def slot(self, arrival: float | None = None):
        with self._semaphore:
            yield


def policies(limit: int) -> list[tuple[str, int, Callable[[LLMClient], None]]]:
    """(name, max_concurrency, how an LLMClient's lanes are set up)."""
    def one_lane(lane):
        def apply(llm):
            llm._long = llm._short = lane
        return apply

    return [
        ("one semaphore (before)", limit, one_lane(PlainSemaphore(limit))),
        ("one lane, oldest query first", limit, one_lane(FairSlots(limit))),
        ("two lanes, oldest query first (shipped)", limit, lambda llm: None),
        ("two lanes, oldest query first", 4 * limit, lambda llm: None),
        ("no client limit", 256, lambda llm: None),
    ]


def run_policy(name: str, limit: int, apply, clients: int, queries: int, scale: float, runs: int) -> dict:
    engine = SimulatedVLLM(scale)
    # no health checks: simulated calls are never silent for long (hung_after_seconds is real time)
    llm = LLMClient(LLMSpec(type="openai_compatible", max_concurrency=limit, hung_after_seconds=3600))
    llm._client = Lazy(lambda: FakeOpenAI(engine))
    apply(llm)
    drivers = ThreadPoolExecutor(max_workers=runs)
    started: dict[str, float] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def call(kind: str) -> None:
        prompt_tokens, out_tokens, max_tokens = CALLS[kind]
        call_id = f"{kind}-{next(counter)}"
        started[call_id] = time.monotonic()
        llm.chat(f"{call_id}|{prompt_tokens}|{out_tokens}", max_tokens=max_tokens)

    def query() -> None:  # on a driver thread, as QueryService.run -> engine.run does
        QUERY_ARRIVAL.set(time.monotonic())
        call("rewrite")
        ids = [f"tokenize-{next(counter)}" for _ in range(5)]
        for i in ids:
            started[i] = time.monotonic()
        llm.count_tokens(ids)
        call("answer")
        call("verify")

    def client() -> None:
        for _ in range(queries):
            begun = time.monotonic()
            drivers.submit(query).result()
            with lock:
                latencies.append(time.monotonic() - begun)

    wall = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = (time.monotonic() - wall) / scale
    engine.close()
    drivers.shutdown()
    waits: dict[str, list[float]] = defaultdict(list)
    for call_id, begun in started.items():
        waits[call_id.split("-")[0]].append((engine.arrived[call_id] - begun) / scale)
    seconds = [s / scale for s in latencies]
    result = {"policy": name, "max_concurrency": limit, "queries": len(seconds), "wall_s": round(wall),
              "throughput_per_min": round(60 * len(seconds) / wall, 2), "p50_s": round(statistics.median(seconds)),
              "p95_s": round(percentile(seconds, 95)),
              "max_s": round(max(seconds)), "peak_in_flight": engine.peak_in_flight,
              "engine_busy_s": {k: round(v) for k, v in engine.busy.items()},
              "wait_s": {kind: {"p50": round(statistics.median(w), 1), "p95": round(percentile(w, 95), 1)}
                         for kind, w in sorted(waits.items())}}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--queries", type=int, default=2, help="per client, one after another")
    parser.add_argument("--scale", type=float, default=0.01, help="simulated seconds per real second, inverted")
    parser.add_argument("--limit", type=int, default=4, help="max_concurrency (per lane)")
    parser.add_argument("--runs", type=int, default=32, help="the API's max_concurrent_runs")
    parser.add_argument("--only", help="run only the policies whose name contains this")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    import openai  # noqa: F401 - LLMClient imports it on first use: not inside the first policy's timing
    results = [run_policy(name, limit, apply, args.clients, args.queries, args.scale, args.runs)
               for name, limit, apply in policies(args.limit) if not args.only or args.only in name]
    save("llm_queueing", {"results": results, "clients": args.clients, "queries_per_client": args.queries,
                          "scale": args.scale, "max_concurrency": args.limit, "max_concurrent_runs": args.runs,
                          "model": {"step_overhead_s": STEP_OVERHEAD, "per_decode_s": PER_DECODE,
                                    "prefill_tokens_per_s": PREFILL_RATE, "prefill_budget": PREFILL_BUDGET,
                                    "calls": CALLS}})
    kinds = ["rewrite", "tokenize", "answer", "verify"]
    table = ["| policy | max_concurrency | queries/min | query p50 | query p95 | max | "
             + " | ".join(f"{k} wait p50 / p95" for k in kinds) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(kinds)]
    for r in results:
        table.append(f"| {r['policy']} | {r['max_concurrency']} | {r['throughput_per_min']} | {r['p50_s']} s "
                     f"| {r['p95_s']} s | {r['max_s']} s | "
                     + " | ".join(f"{r['wait_s'][k]['p50']} / {r['wait_s'][k]['p95']} s" for k in kinds) + " |")
    table.append(f"\n{args.clients} closed-loop clients × {args.queries} `ask`-shaped queries (rewrite, "
                 f"/tokenize ×5, answer, verify), {args.runs} queries at once; max_concurrency is per lane; "
                 "vLLM simulated as calibrated on SmolLM2-135M on this machine's CPU; simulated seconds.")
    publish("queueing", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
