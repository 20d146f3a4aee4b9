"""Ingestion memory does not grow with the corpus (issue 22): tracemalloc's peak (Python allocations,
deterministic) of a whole full ingest, BM25's full build included, and of a whole one-change run, at
4N and 16N documents, with the real loader, chunker, Chroma, BM25 and state and the hash-based
stand-in embedder (tests/helpers/hash_embed.py).

The slope is checked, the peak's growth per added document, against what a run still holds per
document by design: the listed file paths (~0.2-0.4 KB; the listing sorts them) and, per BM25
segment (BUILD_BATCH passages here), its small record. Both sizes are past the pipeline's warm-up:
the engine keeps two batches in flight, so a run of three batches (N documents) never reaches the
peak of a long one (one batch's chunker offsets, Chroma's write buffers and vectors: ~600 KB more at
160 documents than at 40, the same at 640); N to 4N measured that warm-up as 4.8 KB per document.
Every batch that bounds a run's memory is the pipeline's (16) here, the listing's too, so what
grows with the corpus cannot hide under a constant larger than this test's corpus; and every note
is the same length (``_text``). Measured 2026-11-25: 0.22, -0.18 and 0.46 KB per document (full), 0.33-0.39
KB (one change). Fails: a one-change run that kept the BM25 segments' chunk ids (~0.9 KB a
document here, 1.2 KB in all), a full ingest whose plan held its work list (2.5 KB), and
pydantic-core's string cache filling up from the work list's JSON (~0.35 KB, before
``Document.model_config["cache_strings"]``). Before: a full ingest's BM25 build held every chunk's
text and tokens (~10 KB a chunk) and a one-change run a Document and two dictionary entries per
unchanged document."""
from __future__ import annotations

import gc
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest

from ragline.flows.resources import clear_cache
from tests.helpers.harness import run_index
from tests.helpers.memory import in_a_fresh_process, interned_names
from tests.helpers.notes_corpus import HASH_EMBED, write_corpus

pytestmark = pytest.mark.integration

N = 40
SIZES = (4 * N, 16 * N)  # both past the pipeline's warm-up (10 and 40 batches of 16)
BUILD_BATCH = 64  # passages per BM25 segment of a full build: 4N documents make 34
FULL_SLOPE = 900  # bytes of peak per added document, full ingest (-0.18 to 0.46 KB measured; plan holding the work list: 2.5 KB)
CHANGE_SLOPE = 600  # one changed document among 4N or 16N (0.33 KB; BM25 ids kept: 1.2 KB)


def peak(project) -> tuple[int, object]:
    clear_cache()  # every resource opened by the run itself, as in a fresh process
    gc.collect()
    tracemalloc.start()
    try:
        report = run_index(project)
        return tracemalloc.get_traced_memory()[1], report
    finally:
        tracemalloc.stop()


def scale_peaks(root: str) -> dict[str, list[int]]:
    """(full, one change) peaks at 1 and ``SIZES`` documents below ``root``, in this process
    (``in_a_fresh_process`` calls it). The first size imports what ingestion uses (converters,
    tokenizer): not compared. The listing's work-list transactions as small as the other batches:
    what a run holds is then bounded by its batches at these sizes too (at 1,000 a transaction held
    this whole test corpus)."""
    import ragline.tasks.ingest.load as load_stage

    for name in ("QUEUE_BATCH", "SIGNAL_BATCH", "MARK_BATCH"):
        setattr(load_stage, name, 16)
    yaml = HASH_EMBED.replace("sparse:   {type: bm25, path: idx/bm25}",
                              f"sparse:   {{type: bm25, path: idx/bm25, build_batch: {BUILD_BATCH}}}")
    assert f"build_batch: {BUILD_BATCH}" in yaml
    peaks, names = {}, []
    for size in (1, *SIZES):
        base = Path(root) / str(size)
        base.mkdir()
        (base / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
        (base / "pipelines.yaml").write_text(yaml)
        write_corpus(base / "docs", size, 160)
        again = shutil.copytree(base, Path(root) / f"{size}-again")  # the same full ingest, measured twice
        names += interned_names(base) + interned_names(again)  # held: the interned strings' table not reallocated in a run
        full, report = peak(base / "pipelines.yaml")
        assert (report.added, report.failed) == (size + 5, 0)  # + the corpus's five JSONL records
        # the lower of two: how the pipelined batches overlap moves a full ingest's peak by up to
        # ~300 KB (0.64 and -0.12 KB per document in two runs of this test alone)
        full = min(full, peak(again / "pipelines.yaml")[0])
        changed = base / "docs" / "000" / "note00000.md"
        changed.write_text(changed.read_text() + "A new closing line.\n")
        then = time.time() - 1800
        os.utime(changed, (then, then))
        one, report = peak(base / "pipelines.yaml")
        assert (report.updated, report.added, report.unchanged) == (1, 0, size + 4)
        peaks[str(size)] = [full, one]
    return peaks


@pytest.mark.timeout(1800)
def test_ingestion_memory_does_not_grow_with_the_corpus(tmp_path):
    """Measured in a fresh interpreter: tracemalloc traces every thread, and a test worker's threads
    left by earlier tests allocated inside the window (933 B per document once in CI, 272 B alone)."""
    peaks = in_a_fresh_process(f"{__name__}:scale_peaks", str(tmp_path), result=tmp_path / "peaks.json")
    small, large = SIZES
    slopes = [(peaks[str(large)][i] - peaks[str(small)][i]) / (large - small) for i in (0, 1)]
    print(f"peaks (full, one change): {small} {peaks[str(small)]}, {large} {peaks[str(large)]}; "
          f"per added document {slopes}")
    assert slopes[0] < FULL_SLOPE
    assert slopes[1] < CHANGE_SLOPE
