"""Incremental BM25 (segments, flows/resources/stores/bm25_segments.py) against the full rebuild it replaced,
measured in the same run on the same index state.

Per size (SciFact-worded passages with realistic metadata, bench/bm25_filter.py's corpus):
- one changed chunk: wall time and peak RSS of the sync in a fresh process (as an ingestion run's
  finalize does it): before = the old sync (every chunk row read, bm25s index of all, meta.json of
  all written), after = ``BM25Index.sync`` (the change log, one small segment, a deletion bitmap);
- the full build, before and after (``ragline check --repair`` still rebuilds whole);
- query latency, unfiltered and filtered, over SciFact test queries: before = the old version format
  read by the old code path (bm25s precomputed scores), after = the incrementally updated index;
  and whether both return the same top-100 ids and scores.
Then SciFact test nDCG@10 (one passage per abstract): bm25s built whole vs the segmented index built
over five runs with deletions and re-adds (and merges).

Usage: .venv/bin/python bench/bm25_incremental.py [--sizes 25000 100000] [--queries 100]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bm25_filter import ACL, corpus
from common import REPO, SCIFACT, save, summary_ms

from ragline.flows.contracts import Chunk, Document
from ragline.flows.evaluation.retrieval import load_beir, score
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, MetadataIndex, tokenize
from ragline.flows.resources.stores.state import IndexState, StateSpec

FILTER = {"$and": [ACL, {"year": {"$gte": 2010}}]}


def open_state(folder: Path) -> IndexState:
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=folder)
    state.conn
    return state


def record(state: IndexState, rows: list[tuple[str, str, dict]], batch: int = 5000) -> None:
    """Rows as sources of their ``source_id`` (1-3 chunks each), recorded in batches as ingestion does."""
    by_source: dict[str, list] = {}
    for cid, text, meta in rows:
        by_source.setdefault(meta["source_id"], []).append((cid, text, meta))
    sources = list(by_source.items())
    for start in range(0, len(sources), batch):
        part = sources[start:start + batch]
        docs = [Document(source_id=sid, text="", content_hash=sid) for sid, _ in part]
        chunks = [Chunk(chunk_id=cid, source_id=sid, ordinal=i, text=text, metadata=meta)
                  for sid, chunk_rows in part for i, (cid, text, meta) in enumerate(chunk_rows)]
        state.record("bench", "fp", docs, chunks)


def change_one(state: IndexState, source: str, text: str) -> None:
    """One document changed: its old chunks forgotten, one new chunk recorded (the sink's two steps)."""
    state.forget([source])
    state.record("bench", "fp", [Document(source_id=source, text=text, content_hash=text[:16])],
                 [Chunk(chunk_id=f"{source}#changed-{time.time_ns()}", source_id=source, ordinal=0, text=text,
                        metadata={"source_id": source, "year": 2024, "ragline_acl.g1": True})])


def old_sync(index: BM25Index, state: IndexState) -> int:
    """The sync before segments, as main had it: every chunk row, one bm25s index, meta.json of all."""
    import bm25s

    generation = state.generation
    rows = state.chunk_rows()
    version = f"v-{generation}-old{time.time_ns() % 10**5:05d}"
    folder = index.path / version
    retriever = bm25s.BM25(k1=index.spec.k1, b=index.spec.b, method=index.spec.method)
    retriever.index(tokenize([r[1] for r in rows]), show_progress=False)
    folder.mkdir(parents=True)
    retriever.save(str(folder), show_progress=False)
    (folder / "ids.json").write_text(json.dumps([r[0] for r in rows]))
    meta = [{**r[2], "text": r[1]} for r in rows]
    (folder / "meta.json").write_text(json.dumps(meta))
    MetadataIndex.build(meta).save(folder)
    (index.path / index.POINTER).write_text(json.dumps({"version": version, "generation": generation,
                                                       "settings": index.settings, "count": len(rows)}))
    return len(rows)


CHILD = r"""
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "bench"))
import bm25_incremental as b
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
import bm25s, psutil, Stemmer  # imported before the clock starts, as in a running ingestion process
folder, mode = Path(sys.argv[2]), sys.argv[3]
state = b.open_state(folder)
index = BM25Index(BM25Spec(type="bm25", path=f"bm25-{mode}"), base_dir=folder)
b.change_one(state, sys.argv[4], "penguins lose breeding grounds as glaciers retreat in the southern ocean")
b.tokenize(["warm the stemmer"])
me, done, peak = psutil.Process(), threading.Event(), [0]
rss_before = me.memory_info().rss

def sample():  # the RSS reached during the sync (ru_maxrss would be the imports' peak)
    while not done.is_set():
        peak[0] = max(peak[0], me.memory_info().rss)
        time.sleep(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
start = time.perf_counter()
b.old_sync(index, state) if mode == "old" else index.sync(state)
seconds = time.perf_counter() - start
done.set()
sampler.join()
peak[0] = max(peak[0], me.memory_info().rss)
print(json.dumps({"seconds": round(seconds, 3), "rss_before_mb": round(rss_before / 2**20, 1),
                  "peak_rss_mb": round(peak[0] / 2**20, 1), "sync_rss_mb": round((peak[0] - rss_before) / 2**20, 1)}))
"""


def child_sync(folder: Path, mode: str, source: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(folder), mode, source], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=1800)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def latencies(index: BM25Index, queries: list[str], where: dict | None) -> tuple[list[float], list]:
    index.search(queries[:2], 100, where=where)  # warm: stemmer, mapped arrays, metadata index
    seconds, answers = [], []
    for text in queries:
        start = time.perf_counter()
        answers.append(index.search([text], 100, where=where)[0])
        seconds.append(time.perf_counter() - start)
    return seconds, answers


def agreement(before: list, after: list) -> dict:
    same_ids = sum([h[0] for h in a] == [h[0] for h in b] for a, b in zip(before, after))
    diffs = [abs(x[1] - y[1]) for a, b in zip(before, after) for x, y in zip(a, b) if x[0] == y[0]]
    return {"queries_with_identical_top100_ids": f"{same_ids}/{len(before)}",
            "max_abs_score_diff": max(diffs, default=0.0)}


def measure(chunks: int, queries: list[str], folder: Path) -> dict:
    rows = corpus(chunks)
    state = open_state(folder)
    record(state, rows)
    changed = rows[len(rows) // 2][2]["source_id"]
    del rows
    old, new = (BM25Index(BM25Spec(type="bm25", path=f"bm25-{m}"), base_dir=folder) for m in ("old", "new"))
    start = time.perf_counter()
    old_sync(old, state)
    full_before = time.perf_counter() - start
    start = time.perf_counter()
    new.sync(state)
    full_after = time.perf_counter() - start
    state.close()
    after = child_sync(folder, "new", changed)
    before = child_sync(folder, "old", changed)  # its change replaced the new child's chunk again:
    state = open_state(folder)
    new.sync(state)  # so the incremental index takes it too, and both hold the same final chunks
    state.close()
    old.close()
    new.close()
    report = {"chunks": chunks, "full_build_s": {"before": round(full_before, 2), "after": round(full_after, 2)},
              "one_change_sync": {"before": before, "after": after,
                                  "time_ratio": round(before["seconds"] / after["seconds"], 1)},
              "segments_after": [p.docs for p in new._current().segments]}
    for name, where in (("unfiltered", None), ("filtered", FILTER)):
        for rep in ("first pass", "second pass"):  # the segments score a term once per version, then reuse it
            t_before, a_before = latencies(old, queries, where)
            t_after, a_after = latencies(new, queries, where)
            report[f"{name}, {rep}"] = {"before": summary_ms(t_before), "after": summary_ms(t_after),
                                        "ratio_after_over_before": round(np.median(t_after) / np.median(t_before), 2),
                                        **agreement(a_before, a_after)}
    return report


def ndcg(folder: Path) -> dict:
    """SciFact test nDCG@10, one passage (title and abstract) per document: bm25s built whole, and the
    segmented index built incrementally over five runs with deletions and re-adds."""
    dataset = load_beir(SCIFACT)
    docs = [json.loads(line) for line in (SCIFACT / "corpus.jsonl").open(encoding="utf-8")]
    rng = random.Random(3)
    state = open_state(folder)
    order = list(range(len(docs)))
    rng.shuffle(order)

    placeholder = set()

    def put(i: int, text: str | None = None) -> None:
        (placeholder.add if text else placeholder.discard)(i)
        doc, sid = docs[i], str(docs[i]["_id"])
        body = text or f"{doc['title']} {doc['text']}"
        state.forget([sid])
        state.record("bench", "fp", [Document(source_id=sid, text=body, content_hash=body[:16])],
                     [Chunk(chunk_id=f"{sid}#{len(body)}", source_id=sid, ordinal=0, text=body,
                            metadata={"doc_id": sid})])

    new = BM25Index(BM25Spec(type="bm25", path="bm25-new"), base_dir=folder)
    runs = 5
    for run in range(runs):
        for i in order[run::runs]:
            put(i, "placeholder text about nothing" if rng.random() < 0.05 else None)  # replaced again below
        if run:
            for i in rng.sample(order[:run * len(order) // runs], 200):
                put(i)  # every replaced passage gets its real text back: re-adds into the newest segment
        new.sync(state)
    for i in sorted(placeholder):
        put(i)
    new.sync(state)
    old = BM25Index(BM25Spec(type="bm25", path="bm25-old"), base_dir=folder)
    old_sync(old, state)
    figures = {}
    for label, index in (("bm25s full build (before)", old), ("segments, incremental (after)", new)):
        run_ = {}
        for qid, text in dataset.queries.items():
            [hits] = index.search([text], 100)
            run_[qid] = {h[2]["doc_id"]: h[1] for h in hits}
        figures[label] = score(run_, dataset.qrels)["ndcg@10"]
    figures["segments_after"] = [p.docs for p in new._current().segments]
    state.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[25000, 100000])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--skip-ndcg", action="store_true")
    args = parser.parse_args()
    queries = list(load_beir(SCIFACT).queries.values())[:args.queries]
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_average_before": [round(x, 2) for x in os.getloadavg()], "sizes": []}
    for chunks in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bm25inc-") as folder:
            report = measure(chunks, queries, Path(folder))
        result["sizes"].append(report)
        print(json.dumps(report, indent=1), flush=True)
    if not args.skip_ndcg:
        with tempfile.TemporaryDirectory(prefix="bm25ndcg-") as folder:
            result["ndcg@10"] = ndcg(Path(folder))
        print(json.dumps(result["ndcg@10"], indent=1), flush=True)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"saved {save('bm25_incremental', result)}")


if __name__ == "__main__":
    main()
