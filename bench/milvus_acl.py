"""What document-level access costs on the Milvus engine at scale (issue 22 item 3): dense and BM25
top-10 with a credential's access clause read from the chunks' access field (``array_contains_any``)
against the same clause read from the JSON metadata (what every query paid before that field), on the
same milvus-lite collection, in the same run, with no filter as the floor.

N chunks of SciFact text (cycled, each made unique) go in through ``MilvusStore.upsert`` with the
access metadata ingestion writes (``access.acl_metadata``): chunk i readable by two of 50 groups, every
third one public; vectors are the hash stand-in's (tests/helpers/hash_embed.py, words hashed). The
JSON baseline is the same store reading the collection as one without the access field does
(its columns without ``ACCESS_COLUMN``, so ``expression`` writes the JSON comparison).

Usage: .venv/bin/python bench/milvus_acl.py [--chunks 300000] [--queries 20] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import SCIFACT, save

from ragline.flows.access import acl_metadata, clause
from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.milvus import ACCESS_COLUMN, MilvusSpec, MilvusStore
from tests.helpers.hash_embed import words_vector

GROUPS = 50
QUERIES = ["protein folding in yeast", "vitamin D deficiency and bone density", "stem cell differentiation",
           "antibiotic resistance genes", "tumour suppressor p53 mutations"]
ACCESSES = {"no filter": None, "public only": frozenset(), "one group": frozenset({"g3"}),
            "three groups": frozenset({"g1", "g17", "g42"})}


def texts() -> list[str]:
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as src:
        return [json.loads(line)["text"][:600] for line in src]


def fill(store: MilvusStore, chunks: int, batch: int = 2000) -> float:
    """``chunks`` rows through the store's upsert; seconds taken."""
    corpus, rng = texts(), random.Random(7)
    started = time.perf_counter()
    for start in range(0, chunks, batch):
        rows = []
        for i in range(start, min(chunks, start + batch)):
            text = f"{corpus[i % len(corpus)]} (copy {i})"
            groups = [] if i % 3 == 0 else sorted({f"g{rng.randrange(GROUPS)}", f"g{rng.randrange(GROUPS)}"})
            rows.append(Chunk(chunk_id=f"doc-{i}#0", source_id=f"doc-{i}", ordinal=0, text=text,
                              metadata={"source": f"doc-{i}", **acl_metadata(groups)}))
        store.upsert([r.model_copy(update={"embedding": words_vector(r.text, 384).tolist()}) for r in rows])
    return time.perf_counter() - started


def timed(store: MilvusStore, access, queries: int) -> dict[str, float]:
    where = clause(access)
    vectors = [words_vector(q, 384) for q in QUERIES]
    dense, sparse, found = [], [], set()
    for i in range(queries):
        text, vector = QUERIES[i % len(QUERIES)], vectors[i % len(QUERIES)][None, :]
        started = time.perf_counter()
        hits = store.query(np.asarray(vector), 10, where=where)[0]
        dense.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.search([text], 10, where=where)
        sparse.append(time.perf_counter() - started)
        found |= {p.chunk_id for p in hits}
    return {"dense_ms": round(1000 * statistics.median(dense), 1), "bm25_ms": round(1000 * statistics.median(sparse), 1),
            "hits": len(found)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--dir", type=Path, help="keep the collection here (reused when it holds --chunks)")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="milvus-acl-"))
    store = MilvusStore(MilvusSpec(type="milvus", uri="acl.db", collection="acl"), folder)
    filled = None
    if not (folder / "acl.db").exists() or store.count() != args.chunks:
        if (folder / "acl.db").exists():
            store.reset()
        filled = round(fill(store, args.chunks), 1)
    field = {name: timed(store, access, args.queries) for name, access in ACCESSES.items()}
    with_field = store.columns
    store._columns[store.name] = with_field - {ACCESS_COLUMN}  # read as a collection without the field
    json_read = {name: timed(store, access, args.queries) for name, access in ACCESSES.items() if access is not None}
    store._columns[store.name] = with_field
    store.close()
    print(f"milvus-lite, {args.chunks:,} chunks ({filled or 'kept'} s to fill), median of {args.queries} queries, "
          f"top-10:\n")
    print("| access | dense: field / JSON | BM25: field / JSON |")
    print("|---|---|---|")
    for name, got in field.items():
        old = json_read.get(name)
        if old is None:
            print(f"| {name} | {got['dense_ms']} ms | {got['bm25_ms']} ms |")
            continue
        assert old["hits"] == got["hits"], f"{name}: the field and the JSON found different chunks"
        print(f"| {name} | {got['dense_ms']} / {old['dense_ms']} ms ({old['dense_ms'] / got['dense_ms']:.1f}x) | "
              f"{got['bm25_ms']} / {old['bm25_ms']} ms ({old['bm25_ms'] / got['bm25_ms']:.1f}x) |")
    save("milvus_acl", {"chunks": args.chunks, "fill_seconds": filled, "field": field, "json": json_read})


if __name__ == "__main__":
    main()
