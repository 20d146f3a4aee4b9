"""What a query process pays to read an embedded Chroma store through a private copy
(``flows/resources/stores/read_snapshot.py``): the copy alone, and the first query of a fresh store
object (copy, open, HNSW load) against opening the folder itself, for a store of N vectors.

Usage: .venv/bin/python bench/read_snapshot.py [--vectors 20000]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from common import save

from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores import read_snapshot
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore

DIM = 384
TEXT = "a passage of about five hundred characters " * 12


def build(folder: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="bench"), base_dir=folder)
    for start in range(0, n, 4096):
        store.upsert([Chunk(chunk_id=f"c{i}", source_id=f"s{i}", text=TEXT, ordinal=0,
                            embedding=rng.standard_normal(DIM).astype(np.float32).tolist())
                      for i in range(start, min(n, start + 4096))])
    store.close()


def first_query_seconds(folder: Path, writes: bool) -> float:
    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="bench"), base_dir=folder)
    store._writes = writes  # True: open the folder itself, as before the copy existed
    started = time.perf_counter()
    store.query(np.ones((1, DIM), dtype=np.float32), 10)
    seconds = time.perf_counter() - started
    store.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vectors", type=int, default=20_000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ragline-bench-"))
    try:
        build(folder, args.vectors)
        size = sum(f.stat().st_size for f in (folder / "c").rglob("*") if f.is_file())
        copies = []
        for _ in range(3):
            started = time.perf_counter()
            read_snapshot.discard(read_snapshot.take(folder / "c", "bench"))
            copies.append(time.perf_counter() - started)
        result = {"vectors": args.vectors, "store_mb": round(size / 2**20, 1),
                  "copy_s_median": round(sorted(copies)[1], 3),
                  "first_query_s_copy": round(first_query_seconds(folder, writes=False), 3),
                  "first_query_s_in_place": round(first_query_seconds(folder, writes=True), 3)}
        print(result)
        save("read_snapshot", result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
