"""Synthetic documents and chunks (random words, random 16-d vectors) for store fault tests."""
from __future__ import annotations

import numpy as np

from ragline.flows.contracts import Chunk, Document

WORDS = "okapi ranking saturates term frequency and normalises document length in every field".split()

def doc(source: str) -> Document:
    return Document(source_id=source, text=f"text of {source}", title=source, content_hash=f"h-{source}")

def chunks(source: str, n: int, size: int = 300) -> list[Chunk]:
    rng = np.random.default_rng(abs(hash(source)) % 2**32)
    return [Chunk(chunk_id=f"{source}:{i}", source_id=source, ordinal=i, title=source,
                  text=" ".join(rng.choice(WORDS, size // 6)), embedding=rng.standard_normal(16).tolist())
            for i in range(n)]
