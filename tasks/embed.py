"""Embedding of chunks with the shared sentence-transformers model (loaded once per process)."""
from __future__ import annotations

from ragline.flows import failpoints
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk
from ragline.flows.spec.registry import stage
from ragline.flows.resources.embedder import Embedder


@stage("embed", produces="chunks", uses={"embedder": ("sentence_transformer",)}, kind="ingestion")
def embed(chunks: list[Chunk], ctx: StepContext, embedder: Embedder) -> list[Chunk]:
    """Attach a vector to every chunk (of its text after any document context `enrich` set); one
    batched encode call per batch of documents."""
    if not chunks:  # a batch whose documents all failed upstream: no reason to load the model
        ctx.progress("embedded", 0)
        return []
    vectors = embedder.encode_documents([f"{c.context}\n{c.text}" if c.context else c.text for c in chunks])
    failpoints.hit("embed.after_batch")
    ctx.progress("embedded", len(chunks))
    made_by = {"embedder_key": embedder.spec.vectors_key(), "embedder_model": embedder.spec.model}
    return [c.model_copy(update={"embedding": v.tolist(), **made_by}) for c, v in zip(chunks, vectors)]
