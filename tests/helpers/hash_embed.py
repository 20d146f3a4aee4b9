"""A stand-in for ``embed`` (same contract, no model): a vector drawn from each chunk's text hash, so
tests and benchmarks of the engine and the stores (bench/scale.py) time and measure only those."""
from __future__ import annotations

import hashlib

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk
from ragline.flows.spec.registry import stage


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dimension: int = Field(384, ge=2, le=4096)


@stage("hash_embed", params=Params, produces="chunks", kind="ingestion")
def hash_embed(chunks: list[Chunk], params: Params, ctx: StepContext) -> list[Chunk]:
    """A unit vector per chunk, seeded by its text's hash (the same text, the same vector)."""
    out = []
    for chunk in chunks:
        seed = int.from_bytes(hashlib.blake2b(chunk.text.encode(), digest_size=8).digest(), "little")
        vector = np.random.default_rng(seed).standard_normal(params.dimension).astype(np.float32)
        vector /= np.linalg.norm(vector)
        out.append(chunk.model_copy(update={"embedding": vector.tolist(), "embedder_key": "hash",
                                            "embedder_model": "hash"}))
    ctx.progress("embedded", len(chunks))
    return out
