"""Filtered BM25 search: the metadata index (flows.resources.bm25.MetadataIndex) against the old
scan that ran ``filters.matches`` on every chunk's metadata per query, same corpus, same run.

The corpus is synthetic but worded like SciFact: each chunk is a ~50-word window of a SciFact
abstract (from $RAGLINE_DATA_DIR), each document has 1-3 chunks and realistic metadata (source,
title, a year, a category, ACL booleans ``ragline_acl.<group>: true`` for 1-3 of 10 groups).

Usage: .venv/bin/python bench/bm25_filter.py [--sizes 8000 41000 163000 490000] [--queries 20]
       [--budget 300]   (a size whose build would pass the budget, extrapolated, is skipped)
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from common import SCIFACT, save, summary_ms

from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, MetadataIndex
from ragline.flows.resources.stores.filters import matches

CATEGORIES = ["biology", "medicine", "chemistry", "physics", "genetics", "immunology", "oncology",
              "neuroscience", "epidemiology", "pharmacology", "cardiology", "microbiology"]
GROUPS = [f"g{g}" for g in range(10)]
ACL = {"$or": [{f"ragline_acl.{g}": {"$eq": True}} for g in ("g1", "g4", "g7")]}  # a user in 3 groups
FILTERS = {
    "acl (3 groups $or)": ACL,
    "year>=2015 and category $in 2": {"$and": [{"year": {"$gte": 2015}},
                                               {"category": {"$in": ["biology", "medicine"]}}]},
    "acl and year>=2010": {"$and": [ACL, {"year": {"$gte": 2010}}]},
    "one source_id": {"source_id": "doc-1234"},
}


def corpus(chunks: int, seed: int = 7) -> list[tuple[str, str, dict]]:
    """``chunks`` (chunk_id, text, metadata) rows over ~chunks/2 documents."""
    rng = random.Random(seed)
    abstracts = [json.loads(line) for line in (SCIFACT / "corpus.jsonl").open(encoding="utf-8")]
    words = [(a["title"], a["text"].split()) for a in abstracts]
    rows, doc = [], 0
    while len(rows) < chunks:
        title, text = words[rng.randrange(len(words))]
        groups = rng.sample(GROUPS, rng.randint(1, 3))
        meta = {"source_id": f"doc-{doc}", "title": title[:80], "year": rng.randint(1990, 2024),
                "source": f"s3://corpus/{CATEGORIES[doc % len(CATEGORIES)]}/doc-{doc}.txt",
                "category": rng.choice(CATEGORIES), **{f"ragline_acl.{g}": True for g in groups}}
        for part in range(rng.randint(1, 3)):
            start = rng.randrange(max(1, len(text) - 50))
            rows.append((f"doc-{doc}#{part}", " ".join(text[start:start + 50]), {**meta, "chunk": part}))
        doc += 1
    return rows[:chunks]


def ranked_before(scores: np.ndarray, k: int, ids: list[str]) -> np.ndarray:
    """``bm25.ranked`` before this change: it partitioned every score, the zeros a filter left too."""
    k = min(k, int((scores > 0).sum()))
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    cut = np.partition(scores, len(scores) - k)[len(scores) - k]
    tied = np.flatnonzero((scores >= cut) & (scores > 0))
    key = np.array([ids[i] for i in tied])
    return tied[np.lexsort((key, -scores[tied]))][:k]


def search_scan(index: BM25Index, texts: list[str], k: int, where: dict) -> list[list[tuple[str, float, dict]]]:
    """The search before the metadata index, as main had it: ``matches`` on every chunk's metadata
    per query, and every score partitioned."""
    loaded = index._current()
    ids, meta = loaded.ids, [m for part in loaded.segments for m in part.segment.meta]
    mask = np.fromiter((matches(m, where) for m in meta), dtype=bool, count=len(meta))
    if not mask.any():
        return [[] for _ in texts]
    results = []
    for query_tokens in index.terms(texts):
        if not query_tokens:
            results.append([])
            continue
        scores = loaded.scores(query_tokens)
        if scores is None:
            results.append([])
            continue
        scores *= mask.astype(np.float32)
        results.append([(ids[d], float(scores[d]), meta[d]) for d in ranked_before(scores, k, ids).tolist()])
    return results


def timed(fn, queries: list[str]) -> tuple[list[float], list]:
    seconds, answers = [], []
    for text in queries:
        start = time.perf_counter()
        answers.append(fn([text]))
        seconds.append(time.perf_counter() - start)
    return seconds, answers


def measure(chunks: int, queries: list[str], folder: Path) -> dict:
    rows = corpus(chunks)
    index = BM25Index(BM25Spec(type="bm25", path=str(folder / f"bm25-{chunks}")))
    start = time.perf_counter()
    index.build(rows, generation=1, settings=index.settings)
    built = time.perf_counter() - start
    del rows
    start = time.perf_counter()
    loaded = index._current()  # the version's ids and postings (mmap); its one segment's metadata below
    segment = loaded.segments[0].segment
    meta, folder = segment.meta, segment.folder
    load = time.perf_counter() - start
    start = time.perf_counter()
    metadata = MetadataIndex.build(meta)
    index_build = time.perf_counter() - start
    start = time.perf_counter()
    MetadataIndex.load(folder, meta)
    index_load = time.perf_counter() - start
    report = {"chunks": chunks, "build_s": round(built, 1), "load_s": round(load, 2),
              "index_build_s": round(index_build, 2), "index_load_s": round(index_load, 3),
              "index_bytes_per_chunk": round(metadata.nbytes() / chunks, 1),
              "index_file_bytes_per_chunk": round((folder / MetadataIndex.FILE).stat().st_size / chunks, 1),
              "filters": {}}
    index.search(queries[:2], 10)  # the stemmer and bm25s warm
    unfiltered, _ = timed(lambda t: index.search(t, 10), queries)
    report["unfiltered"] = summary_ms(unfiltered)
    for name, where in FILTERS.items():
        mask_s = []
        for _ in queries:
            start = time.perf_counter()
            selected = metadata.mask(where)
            mask_s.append(time.perf_counter() - start)
        after, answers_after = timed(lambda t: index.search(t, 10, where=where), queries)
        before, answers_before = timed(lambda t: search_scan(index, t, 10, where), queries)
        assert answers_after == answers_before, f"{name}: the index and the scan disagree at {chunks} chunks"
        report["filters"][name] = {"selected": int(selected.sum()), "before": summary_ms(before),
                                   "after": summary_ms(after), "mask_only": summary_ms(mask_s)}
    return report


def table(reports: list[dict]) -> str:
    lines = ["| chunks | filter | selected | before median / p95 ms | after median / p95 ms | index mask ms |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in reports:
        u = r["unfiltered"]
        lines.append(f"| {r['chunks']:,} | (none) | {r['chunks']:,} | {u['median_ms']} / {u['p95_ms']} "
                     f"| {u['median_ms']} / {u['p95_ms']} | - |")
        for name, f in r["filters"].items():
            b, a, m = f["before"], f["after"], f["mask_only"]
            lines.append(f"| {r['chunks']:,} | {name} | {f['selected']:,} | {b['median_ms']} / {b['p95_ms']} "
                         f"| {a['median_ms']} / {a['p95_ms']} | {m['median_ms']} |")
    lines += ["", "| chunks | BM25 build s | version load s | metadata index: build s | load saved s "
              "| bytes/chunk in memory | on disk |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['chunks']:,} | {r['build_s']} | {r['load_s']} | {r['index_build_s']} | {r['index_load_s']} "
              f"| {r['index_bytes_per_chunk']} | {r['index_file_bytes_per_chunk']} |" for r in reports]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8_000, 41_000, 163_000, 490_000])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds one size's build may take")
    args = parser.parse_args()
    queries = [json.loads(line)["text"] for line in (SCIFACT / "queries.jsonl").open(encoding="utf-8")]
    queries = queries[:args.queries]
    reports, rate = [], None
    with tempfile.TemporaryDirectory(prefix="bm25-filter-") as tmp:
        for chunks in args.sizes:
            if rate is not None and rate * chunks > args.budget:
                print(f"skipped {chunks:,} chunks: the build would take ~{rate * chunks:.0f} s (budget {args.budget:.0f} s)")
                continue
            report = measure(chunks, queries, Path(tmp))
            rate = report["build_s"] / chunks
            reports.append(report)
            print(json.dumps(report), flush=True)
    print(table(reports))
    print(f"saved {save('bm25_filter', {'reports': reports})}")


if __name__ == "__main__":
    main()
