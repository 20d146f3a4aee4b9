"""Prose of marked sentences and the chunk stage run on one document, shared by the structure-aware
chunking tests (tasks/ingest/test_chunk_structure.py, tasks/ingest/test_chunk_tables.py)."""
from __future__ import annotations

import random

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.chunk import Params, chunk


WORDS = "protein membrane receptor pathway signal tumour cohort treatment antibody vaccine".split()


def prose(marker: str, n: int, seed: int = 0, words: list[str] = WORDS) -> str:
    rng = random.Random(seed)
    return " ".join(f"{marker} {' '.join(rng.choice(words) for _ in range(rng.randint(5, 10)))}." for _ in range(n))


def run(document: Document, embedder, **params):
    return chunk.fn(documents=[document], params=Params(**params), ctx=StepContext(pipeline="t", step_id="c"),
                    embedder=embedder)
