"""Ingestion memory does not grow with the corpus (issue 22): tracemalloc's peak (Python allocations,
deterministic) of a whole full ingest, BM25's full build included, and of a whole one-change run, at
N and 4N documents, with the real loader, chunker, Chroma, BM25 and state and the hash-based stand-in
embedder (tests/helpers/hash_embed.py).

The slope is checked, the peak's growth per added document, against what a run still holds per
document by design: the listed file paths (~0.2 KB; the listing sorts them) and little else. A full
ingest's work list is kept in the state (``IndexState.queue``: load writes it a transaction per
1,000 documents, the plan and the engine read it a page at a time), and an unchanged source is
only marked listed in the state and planned in SQL. Measured in three runs: 0.15, 0.53 and 0.71 KB
per document for a full ingest (the peak's moment moves with the pipelined batches' timing, ±50 KB
on a ~5.9 MB peak, i.e. ±0.4 KB per document over 120), 0.13 KB for a one-change run. FULL_SLOPE is
1.2 KB: the highest seen plus that noise, and half of what the engine that held the work list in
memory measures here (an unread Document per document, with its planning sets: 2.5 KB), which it
fails. Before that: a full ingest's BM25 build held every chunk's text and tokens
(~10 KB a chunk, ~4 chunks a document here) and a one-change run a Document and two dictionary
entries per unchanged document."""
from __future__ import annotations

import gc
import os
import time
import tracemalloc

import pytest

from ragline.flows.resources import clear_cache
from tests.helpers.harness import run_index
from tests.integration.test_streaming_ingest import HASH_EMBED, _corpus

pytestmark = pytest.mark.integration

N = 40
BUILD_BATCH = 64  # passages per BM25 segment of a full build: 4N documents make ten
FULL_SLOPE = 1_200  # bytes of peak per added document, full ingest (0.15-0.71 KB; work list in memory: 2.5 KB)
CHANGE_SLOPE = 1_000  # one changed document among N or 4N


def peak(project) -> tuple[int, object]:
    clear_cache()  # every resource opened by the run itself, as in a fresh process
    gc.collect()
    tracemalloc.start()
    try:
        report = run_index(project)
        return tracemalloc.get_traced_memory()[1], report
    finally:
        tracemalloc.stop()


@pytest.mark.xfail(strict=True, reason=(
    "issue 22, open: measured 2026-11-25 at 4.8 KB per added document (full ingest) and 1.27 KB (one change). "
    "The 0.15-0.71 / 0.13 KB measured before were masked: loading the chunker's tokenizer through "
    "transformers made a ~5.9 MB peak that did not depend on the corpus, above what the run holds per "
    "document; the Rust tokenizer removed that peak. Remaining growth to find (the BM25 segments' "
    "chunk ids are ~0.8 KB of the one-change figure here)"))
@pytest.mark.timeout(1800)
def test_ingestion_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    yaml = HASH_EMBED.replace("sparse:   {type: bm25, path: idx/bm25}",
                              f"sparse:   {{type: bm25, path: idx/bm25, build_batch: {BUILD_BATCH}}}")
    assert f"build_batch: {BUILD_BATCH}" in yaml
    # the listing's work-list transactions as small as the other batches: what a run holds is then
    # bounded by its batches at these sizes too (at 1,000 a transaction held this whole test corpus)
    monkeypatch.setattr("ragline.tasks.load.QUEUE_BATCH", 16)
    peaks = {}
    for size in (1, N, 4 * N):  # the first size imports what ingestion uses (converters, tokenizer): not counted
        base = tmp_path / str(size)
        base.mkdir()
        (base / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
        (base / "pipelines.yaml").write_text(yaml)
        _corpus(base / "docs", size, 160)
        full, report = peak(base / "pipelines.yaml")
        assert (report.added, report.failed) == (size + 5, 0)  # + the corpus's five JSONL records
        changed = base / "docs" / "000" / "note00000.md"
        changed.write_text(changed.read_text() + "A new closing line.\n")
        then = time.time() - 1800
        os.utime(changed, (then, then))
        one, report = peak(base / "pipelines.yaml")
        assert (report.updated, report.added, report.unchanged) == (1, 0, size + 4)
        peaks[size] = (full, one, report)
    slopes = [(peaks[4 * N][i] - peaks[N][i]) / (3 * N) for i in (0, 1)]
    print(f"peaks (full, one change): N {peaks[N][:2]}, 4N {peaks[4 * N][:2]}; per added document {slopes}")
    assert slopes[0] < FULL_SLOPE
    assert slopes[1] < CHANGE_SLOPE
