"""Deterministic rankings: equal scores are ordered by chunk id in dense (Chroma), sparse (BM25) and
the tuner's in-memory BM25, whatever order the chunks were written in, so the same index gives the
same ranking from the CLI, in-process, and run after run (issue 17)."""
from __future__ import annotations

import random

import numpy as np

from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, ranked, tokenize
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.tasks.jobs.tune_retrieval import sparse_rankings

IDS = [f"c{i:02d}" for i in range(12)]


def test_ranked_breaks_ties_by_chunk_id_and_cuts_inside_a_tie():
    scores = np.array([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    ids = ["f", "e", "d", "c", "b", "a"]
    assert ranked(scores, 2, ids).tolist() == [4, 2]  # b and d of the three tied at 3.0 (not index order)
    assert ranked(scores, 10, ids).tolist() == [4, 2, 1, 5, 0]  # nothing scoring 0
    assert ranked(scores, 3).tolist() == [1, 2, 4]  # without ids: by index


def test_bm25_ties_come_out_by_chunk_id_whatever_the_build_order(tmp_path):
    for seed in range(3):
        rows = [(cid, "identical abstract about cell division", {"lang": "en"}) for cid in IDS]
        rows.append(("a", "other text", {"lang": "en"}))
        random.Random(seed).shuffle(rows)
        index = BM25Index(BM25Spec(type="bm25", path=f"b{seed}"), base_dir=tmp_path)
        index.build(rows, generation=1, settings="s")
        assert [hit[0] for hit in index.search(["cell division"], k=5)[0]] == IDS[:5]
        assert [hit[0] for hit in index.search(["cell division"], k=3, where={"lang": "en"})[0]] == IDS[:3]


def test_tuner_bm25_ties_come_out_by_chunk_index():
    spec = BM25Spec(type="bm25")
    tokens = tokenize(["identical abstract about cell division"] * 8 + ["other"], spec.stemmer, spec.stopwords)
    ranking = sparse_rankings(["cell division"], 4, tokens, spec)[0]
    assert [c for c, _ in ranking] == [0, 1, 2, 3]


def test_chroma_ties_come_out_by_chunk_id_whatever_the_write_order(tmp_path):
    vector = np.ones(8, dtype=np.float32) / np.sqrt(8)
    for seed in range(3):
        order = IDS[:]
        random.Random(seed).shuffle(order)
        store = ChromaStore(ChromaSpec(type="chroma", path=f"c{seed}", collection="ties"), base_dir=tmp_path)
        store.upsert([Chunk(chunk_id=cid, source_id="s", ordinal=0, text=cid, metadata={"chunk": 0},
                            embedding=vector.tolist()) for cid in order])
        hits = store.query(np.array([vector]), 12)[0]
        assert [p.chunk_id for p in hits] == IDS
