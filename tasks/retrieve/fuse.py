"""Fusion of rankings from several retrievers and search texts (RRF, or score combination).

A retriever weighed 0 contributes nothing, not even its passages at score 0, so the query runner
does not run it at all (the stage's ``ignores``, read by the query runner): `ragline tune`
choosing dense or BM25 alone costs one retriever's time, not two.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
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
    weights = np.array([[params.weights.get(r.retriever, 1.0) for r in rankings]])
    fused = fused_scores([[(p.chunk_id, p.score) for p in r.passages] for r in rankings], weights,
                         np.array([[params.k]]), np.array([[params.method == "rrf"]]))
    if fused is None:
        return []
    chunk_ids, scores, kept = fused
    best: dict[str, Passage] = {}
    for ranking, weight in zip(rankings, weights[0]):
        for passage in ranking.passages if weight else ():  # switched off: the same result whether it ran or not
            best.setdefault(passage.chunk_id, passage)
    return [best[chunk_ids[i]].model_copy(update={"score": float(scores[0, i]), "retriever": "fuse"})
            for i in fused_order(scores[0], kept[0], params.top_k)]


def fused_scores(rankings: Sequence[Sequence[tuple[Any, float]]], weights: np.ndarray, ks: np.ndarray,
                 rrf: np.ndarray) -> tuple[list[Any], np.ndarray, np.ndarray] | None:
    """Fusion of one query's rankings (``(key, score)`` best first) under one or many settings at once
    (the tuner scores hundreds): every key, sorted, with its fused score per row of settings, and per
    row whether a ranking of non-zero weight holds it (the others add nothing, not even the key).
    ``weights``: rows x rankings; ``ks`` (the RRF constant) and ``rrf`` (RRF, else the weighted sum of
    min-max normalised scores): rows x 1. None when no ranking holds anything."""
    keys = sorted({key for ranking in rankings for key, _ in ranking})
    if not keys:
        return None
    at = {key: i for i, key in enumerate(keys)}
    scores = np.zeros((len(weights), len(keys)))
    kept = np.zeros((len(weights), len(keys)), dtype=bool)
    for column, ranking in enumerate(rankings):
        weight = weights[:, column:column + 1]
        if not ranking or not weight.any():
            continue
        where = np.array([at[key] for key, _ in ranking])
        values = np.array([score for _, score in ranking], dtype=np.float64)
        spread = values.max() - values.min()
        normalised = (values - values.min()) / spread if spread else np.ones(len(values))
        contribution = np.where(rrf, 1.0 / (ks + np.arange(1, len(ranking) + 1)), normalised)
        np.add.at(scores, (slice(None), where), weight * contribution)
        kept[:, where] |= weight != 0
    return keys, scores, kept


def fused_order(scores: np.ndarray, kept: np.ndarray, top_k: int) -> np.ndarray:
    """Positions of one row's kept keys, best first (ties: the smaller key), at most ``top_k``."""
    valid = np.flatnonzero(kept)
    return valid[np.lexsort((valid, -scores[valid]))][:top_k]


