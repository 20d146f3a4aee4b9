"""Embedding of chunks with the shared sentence-transformers model (loaded once per process)."""
from __future__ import annotations

import numpy as np

from ragline.flows import failpoints
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder


@stage("embed", produces="chunks", uses={"embedder": ("sentence_transformer",)}, kind="ingestion")
def embed(chunks: list[Chunk], ctx: StepContext, embedder: Embedder) -> list[Chunk]:
    """Attach a vector to every chunk (of its text after any document context `enrich` set); one
    batched encode call per batch of documents."""
    if not chunks:  # a batch whose documents all failed upstream: no reason to load the model
        ctx.progress("embedded", 0)
        return []
    texts = [f"{c.context}\n{c.text}" if c.context else c.text for c in chunks]
    vectors = _encode_with_progress(texts, ctx, embedder)
    failpoints.hit("embed.after_batch")
    made_by = {"embedder_key": embedder.spec.vectors_key(), "embedder_model": embedder.spec.model}
    return [c.model_copy(update={"embedding": v.tolist(), **made_by}) for c, v in zip(chunks, vectors)]


PROGRESS_CHUNKS = 2048  # a larger batch (one long document: ~720 chunks a MB) is encoded, and told, in parts


def _encode_with_progress(texts: list[str], ctx: StepContext, embedder: Embedder) -> np.ndarray:
    """The texts' vectors; a batch over PROGRESS_CHUNKS is encoded PROGRESS_CHUNKS at a time with a
    progress line after each part (embedding a 10 MB document takes minutes: the run's only sign of life)."""
    if len(texts) <= PROGRESS_CHUNKS:
        vectors = embedder.encode_documents(texts)
        ctx.progress("embedded", len(texts))
        return vectors
    parts = []
    for start in range(0, len(texts), PROGRESS_CHUNKS):
        parts.append(embedder.encode_documents(texts[start:start + PROGRESS_CHUNKS]))
        ctx.progress("embedded", len(parts[-1]))
        ctx.logger.info("embedded %d of %d chunks", min(start + PROGRESS_CHUNKS, len(texts)), len(texts))
    return np.concatenate(parts)
