"""Unit tests for the ``embed`` stage with the real MiniLM embedder."""
from __future__ import annotations

import numpy as np

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.embed import embed

TEXTS = ["Penguins cannot fly.", "Volcanic eruptions release sulfur dioxide.", "Mitochondria make ATP.",
         "Title\nA chunk with a prepended title."]


def chunks() -> list[Chunk]:
    return [Chunk(chunk_id=f"c{i}", source_id=f"s{i % 2}", ordinal=i, text=t, title="T",
                  metadata={"chunk": i}) for i, t in enumerate(TEXTS)]


def run(items, embedder, on_progress=None):
    ctx = StepContext(pipeline="t", step_id="embed", on_progress=on_progress)
    return embed.fn(chunks=items, ctx=ctx, embedder=embedder)


def test_vectors_attached_in_order(minilm):
    items = chunks()
    out = run(items, minilm)
    assert len(out) == len(items)
    assert [c.chunk_id for c in out] == [c.chunk_id for c in items]
    for before, after in zip(items, out):
        assert after.embedding is not None and len(after.embedding) == 384
        assert all(isinstance(x, float) for x in after.embedding)
        made_by = {"embedding", "embedder_key", "embedder_model"}
        assert after.model_dump(exclude=made_by) == before.model_dump(exclude=made_by)
        assert (after.embedder_key, after.embedder_model) == (minilm.spec.vectors_key(), "all-MiniLM-L6-v2")
        assert before.embedding is None  # the input chunks are not modified


def test_matches_a_direct_encode(minilm):
    out = run(chunks(), minilm)
    direct = minilm.encode_documents(TEXTS)
    np.testing.assert_allclose(np.asarray([c.embedding for c in out], dtype=np.float32), direct, atol=1e-6)
    # each vector belongs to its own text, not a neighbour's
    sims = np.asarray([c.embedding for c in out]) @ direct.T
    assert list(sims.argmax(axis=1)) == list(range(len(TEXTS)))


def test_document_prefix_is_used(minilm):
    prefixed = Embedder(EmbedderSpec(type="sentence_transformer", document_prefix="passage: "))
    prefixed._model = minilm._model  # same weights, different prefix
    out = run(chunks()[:1], prefixed)
    np.testing.assert_allclose(out[0].embedding, minilm.encode_documents(["passage: " + TEXTS[0]])[0], atol=1e-6)
    assert not np.allclose(out[0].embedding, minilm.encode_documents([TEXTS[0]])[0], atol=1e-3)


class _NoModel:
    """An embedder that must not be touched: an empty batch needs no model."""

    def __getattr__(self, name):
        raise AssertionError(f"the embedder's {name} was used for an empty batch")


def test_empty_batch(minilm):
    seen = []
    assert run([], minilm, on_progress=lambda unit, n: seen.append((unit, n))) == []
    assert seen == [("embedded", 0)]


def test_empty_batch_does_not_load_the_model():
    cold = Embedder(EmbedderSpec(type="sentence_transformer"))
    assert run([], _NoModel()) == []
    assert run([], cold) == [] and not cold._model.loaded


def test_progress_counts_chunks(minilm):
    seen = []
    run(chunks(), minilm, on_progress=lambda unit, n: seen.append((unit, n)))
    assert seen == [("embedded", len(TEXTS))]


def test_a_large_batch_is_embedded_in_parts_with_progress_lines(minilm, monkeypatch, caplog):
    """Issue 39.6: a 10 MB document is thousands of chunks, minutes of embedding: each part is told."""
    from ragline.tasks.ingest import embed as embed_module

    items = [Chunk(chunk_id=f"c{i}", source_id="long", ordinal=i, text=f"{TEXTS[i % 4]} ({i})", title="T",
                   metadata={"chunk": i}) for i in range(10)]
    whole = run(items, minilm)
    monkeypatch.setattr(embed_module, "PROGRESS_CHUNKS", 4)  # the real bound is 2,048 chunks
    counted = []
    with caplog.at_level("INFO"):
        parts = run(items, minilm, on_progress=lambda key, n: counted.append((key, n)))
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("embedded")] == [
        "embedded 4 of 10 chunks", "embedded 8 of 10 chunks", "embedded 10 of 10 chunks"]
    assert counted == [("embedded", 4), ("embedded", 4), ("embedded", 2)]
    np.testing.assert_allclose([c.embedding for c in parts], [c.embedding for c in whole], atol=1e-5)
