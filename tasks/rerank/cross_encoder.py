"""Cross-encoder reranking, optionally blended with the retrieval score and a recency boost."""
from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Passage, Query
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.cross_encoder import CrossEncoderModel


class BlendParams(BaseModel):
    """How a reranker's relevance mixes with the retrieval score and recency (shared by rerankers)."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(5, ge=1, le=1000, description="passages kept")
    retrieval_weight: float = Field(0.0, ge=0, le=1, description="share of the (normalised) retrieval score")
    recency_field: str | None = Field(None, description="metadata field with a unix time, e.g. 'modified'")
    recency_half_life_days: float = Field(365.0, gt=0)
    recency_weight: float = Field(0.0, ge=0, le=1, description="share of the recency boost")


class Params(BlendParams):
    candidates: int = Field(50, ge=1, le=10_000, description="top passages that are rescored")


@stage("rerank", params=Params, produces="passages", kind="query", uses={"reranker": ("cross_encoder",)})
def rerank(query: Query, passages: list[Passage], params: Params, reranker: CrossEncoderModel) -> list[Passage]:
    """Rescore the top candidates with a cross-encoder and keep the best ``top_k``."""
    pool = passages[: params.candidates]
    relevance = normalise(reranker.score(query.text, [p.text for p in pool]))
    return blend(pool, relevance, params)[: params.top_k]


def normalise(scores: list[float]) -> list[float]:
    if not scores:
        return []
    low, high = min(scores), max(scores)
    return [(s - low) / (high - low) if high > low else 1.0 for s in scores]


def blend(pool: list[Passage], relevance: list[float], params: BlendParams) -> list[Passage]:
    """Final score: relevance, mixed with the retrieval score and recency when asked; stable order."""
    retrieval = normalise([p.score for p in pool])
    now = time.time()
    scored = []
    for i, (passage, rel) in enumerate(zip(pool, relevance)):
        score = (1 - params.retrieval_weight - params.recency_weight) * rel + params.retrieval_weight * retrieval[i]
        if params.recency_weight and params.recency_field:
            stamp = passage.metadata.get(params.recency_field)
            age_days = max(0.0, (now - float(stamp)) / 86400) if isinstance(stamp, (int, float)) else None
            recency = 0.5 ** (age_days / params.recency_half_life_days) if age_days is not None else 0.0
            score += params.recency_weight * recency
        scored.append((score, i, passage))
    scored.sort(key=lambda item: (-item[0], item[1]))
    return [p.model_copy(update={"score": s}) for s, _, p in scored]
