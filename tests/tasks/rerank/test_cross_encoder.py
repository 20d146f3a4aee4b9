"""Cross-encoder reranking with a real (tiny, randomly initialised) BERT cross-encoder (tests/conftest.py),
since no cross-encoder ships its weights on PyPI; users point `model` at e.g.
cross-encoder/ms-marco-MiniLM-L6-v2."""
from __future__ import annotations

import time

import pytest

from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.cross_encoder import CrossEncoderModel, CrossEncoderSpec
from ragline.tasks.rerank.cross_encoder import Params, blend, rerank


@pytest.fixture(scope="module")
def tiny_cross_encoder(tiny_cross_encoder_dir):
    return CrossEncoderModel(CrossEncoderSpec(type="cross_encoder", model=str(tiny_cross_encoder_dir), max_length=128))


def passages(n: int) -> list[Passage]:
    return [Passage(chunk_id=f"c{i}", source_id=f"s{i}", text=f"passage number {i} about topic {i % 3}",
                    score=1.0 - i / n, metadata={"modified": time.time() - i * 86400 * 30}) for i in range(n)]


def test_rerank_orders_by_the_cross_encoder(tiny_cross_encoder):
    pool = passages(8)
    scores = tiny_cross_encoder.score("topic 1", [p.text for p in pool])
    expected = [p.chunk_id for _, p in sorted(zip(scores, pool), key=lambda x: -x[0])][:3]
    got = rerank.fn(query=Query(text="topic 1"), passages=pool, params=Params(top_k=3), reranker=tiny_cross_encoder)
    assert [p.chunk_id for p in got] == expected and len(set(scores)) > 1


def test_candidates_limit_what_is_rescored(tiny_cross_encoder):
    got = rerank.fn(query=Query(text="q"), passages=passages(8), params=Params(top_k=5, candidates=2),
                    reranker=tiny_cross_encoder)
    assert {p.chunk_id for p in got} == {"c0", "c1"}


def test_blend_with_retrieval_score_and_recency():
    pool = passages(4)
    flat = [0.5] * 4  # the reranker cannot tell them apart
    by_retrieval = blend(pool, flat, Params(retrieval_weight=0.5))
    assert [p.chunk_id for p in by_retrieval] == ["c0", "c1", "c2", "c3"]
    reversed_pool = pool[::-1]
    by_recency = blend(reversed_pool, flat, Params(recency_weight=0.5, recency_field="modified",
                                                  recency_half_life_days=30))
    assert [p.chunk_id for p in by_recency] == ["c0", "c1", "c2", "c3"]
    assert by_recency[0].score > by_recency[1].score > by_recency[3].score
