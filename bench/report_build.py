"""How long ``ragline report`` takes to build its page from a 10,000-line query log (plus 1,000
feedback records and 20 eval runs), on lines shaped as the served app writes them: `ask` lines
(5 retrieved passages, an answer with sources) and `search` lines (100 retrieved passages, about
10 KB each). Median of ``--repeats`` builds of the same data dir (``build``: read, aggregate, render).

Usage: .venv/bin/python bench/report_build.py [--lines 10000] [--search-share 0.3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import save

STEPS = ("dense", "sparse", "fuse", "insert", "answer", "check")


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _passages(rng: random.Random, n: int) -> list[dict]:
    return [{"chunk_id": f"{rng.getrandbits(64):016x}", "source_id": f"docs/corpus.jsonl#{rng.randrange(5000)}",
             "doc_id": str(rng.randrange(5000)), "score": round(rng.random(), 6)} for _ in range(n)]


def write_data_dir(folder: Path, lines: int, search_share: float) -> int:
    from ragline.flows.evaluation.retrieval import record_run
    from ragline.flows.serve.routers.feedback import FEEDBACK_FOLDER, FEEDBACK_NAME
    from ragline.flows.serve.query_log import LOG_FOLDER, LOG_NAME

    rng, now = random.Random(1), time.time()
    (folder / LOG_FOLDER).mkdir(parents=True)
    (folder / FEEDBACK_FOLDER).mkdir(parents=True)
    times = sorted(now - rng.uniform(0, 7 * 86400) for _ in range(lines))
    with open(folder / LOG_FOLDER / LOG_NAME, "w", encoding="utf-8") as log, \
            open(folder / FEEDBACK_FOLDER / FEEDBACK_NAME, "w", encoding="utf-8") as feedback:
        for n, at in enumerate(times):
            search = rng.random() < search_share
            timings = {s: round(rng.lognormvariate(3, 0.6), 2) for s in (STEPS[:3] if search else STEPS)}
            entry = {"answer_id": f"{n:032x}", "time": _iso(at), "pipeline": "search" if search else "ask",
                     "surface": "query", "stream": False, "status": rng.choices(["answered", "refused", "failed"],
                                                                                 [0.85, 0.12, 0.03])[0],
                     "latency_ms": round(sum(timings.values()), 2), "timings": timings, "request_id": None,
                     "principal": f"key:{rng.randrange(20)}", "restricted": False, "trace_id": None,
                     "history_turns": 0, "filtered": False, "question": f"what does study {n} show about cells?",
                     "retrieved": _passages(rng, 100 if search else 5)}
            if not search:
                entry["answer"] = {"citations": [1], "refused": entry["status"] == "refused", "verdict": "Yes",
                                   "confidence": 0.9, "text": "It shows that [1].", "reason": "",
                                   "sources": [{"number": 1, **entry["retrieved"][0]}]}
            log.write(json.dumps(entry, separators=(",", ":")) + "\n")
            if n % 10 == 0:
                feedback.write(json.dumps({"feedback_id": f"{n:032x}", "time": _iso(at + 30), "principal": "u",
                                           "answer_id": entry["answer_id"], "rating": rng.choice(["up", "down"]),
                                           "corrected_passage_ids": []}) + "\n")
    for i in range(20):
        record_run(folder, {"dataset": "scifact", "pipeline": "search", "queries": 300, "ndcg@10": 0.6 + i / 200,
                            "recall@100": 0.9, "mrr@10": 0.6, "map@10": 0.55, "p@10": 0.09}, "test")
    return (folder / LOG_FOLDER / LOG_NAME).stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--search-share", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from ragline.flows.serve.report import build

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = write_data_dir(folder, args.lines, args.search_share)
        seconds, page = [], ""
        for _ in range(args.repeats):
            started = time.perf_counter()
            page = build(folder, 8 * 86400)
            seconds.append(time.perf_counter() - started)
    result = {"lines": args.lines, "log_mb": round(size / 1e6, 1), "search_share": args.search_share,
              "build_seconds_median": round(statistics.median(seconds), 3),
              "build_seconds": [round(s, 3) for s in seconds], "page_kb": round(len(page.encode()) / 1000, 1)}
    save("report_build", result)
    print(f"ragline report from {args.lines} log lines ({result['log_mb']} MB, {args.search_share:.0%} search lines): "
          f"{result['build_seconds_median']} s median of {args.repeats} ({result['build_seconds']}); "
          f"page {result['page_kb']} KB")


if __name__ == "__main__":
    main()
