"""Fusion of rankings from several retrievers and search texts (RRF, or score combination).

A retriever weighed 0 contributes nothing, not even its passages at score 0, so the query runner
does not run it at all (the stage's ``ignores``, read by the query runner): `ragline tune`
choosing dense or BM25 alone costs one retriever's time, not two.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Passage, Ranking
from ragline.flows.spec.registry import stage

class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["rrf", "score"] = Field(
        "rrf", description="rrf: sum of weight/(k+rank); score: weighted sum of min-max normalised scores")
    k: int = Field(60, ge=0, description="RRF rank constant")
    weights: dict[str, float] = Field(default_factory=dict, description="per retriever step id; default 1.0")
    top_k: int = Field(100, ge=1, le=10_000, description="passages kept")


def weighed_zero(params: Params, wiring: Mapping[str, list[str]]) -> set[str]:
    """The rankings this fuse step weighs 0: their retrievers' work would be thrown away."""
    return {step for step in wiring.get("rankings", []) if params.weights.get(step, 1.0) == 0}


@stage("fuse", params=Params, produces="passages", kind="query", ignores=weighed_zero)
def fuse(rankings: list[Ranking], params: Params) -> list[Passage]:
    """One ranked list from many: every retriever and every rewritten query contributes."""
    scores: dict[str, float] = {}
    best: dict[str, Passage] = {}
    for ranking in rankings:
        weight = params.weights.get(ranking.retriever, 1.0)
        if weight == 0:
            continue  # switched off: the same result whether it ran or not
        for chunk_id, contribution in _contributions(ranking, params):
            scores[chunk_id] = scores.get(chunk_id, 0.0) + weight * contribution
        for passage in ranking.passages:
            best.setdefault(passage.chunk_id, passage)
    ordered = sorted(scores, key=lambda cid: (-scores[cid], cid))[: params.top_k]
    return [best[cid].model_copy(update={"score": scores[cid], "retriever": "fuse"}) for cid in ordered]


def _contributions(ranking: Ranking, params: Params) -> list[tuple[str, float]]:
    passages = ranking.passages
    if params.method == "rrf":
        return [(p.chunk_id, 1.0 / (params.k + rank)) for rank, p in enumerate(passages, start=1)]
    if not passages:
        return []
    high, low = max(p.score for p in passages), min(p.score for p in passages)
    spread = high - low
    return [(p.chunk_id, (p.score - low) / spread if spread else 1.0) for p in passages]


