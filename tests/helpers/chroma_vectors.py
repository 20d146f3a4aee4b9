"""Chunks with hand-picked 8-d vectors (unit and basis vectors) and an embedded Chroma store for them:
shared by the Chroma store, reader and read-snapshot tests."""
from __future__ import annotations

import numpy as np

from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore


DIM = 8


def unit(v) -> list[float]:
    v = np.asarray(v, dtype=np.float32)
    return (v / np.linalg.norm(v)).tolist()


def basis(i: int) -> list[float]:
    v = np.zeros(DIM, dtype=np.float32)
    v[i] = 1.0
    return v.tolist()


def chunk(cid: str, vector, source: str = "src", **metadata) -> Chunk:
    return Chunk(chunk_id=cid, source_id=source, ordinal=0, text=f"text of {cid}", title=f"title {source}",
                 metadata={"chunk": 0, **metadata}, embedding=list(vector))


def make(tmp_path, **spec) -> ChromaStore:
    return ChromaStore(ChromaSpec(type="chroma", path="c", collection="test", **spec), base_dir=tmp_path)
