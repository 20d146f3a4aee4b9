"""Extractive refinement without an LLM: keep the passage sentences most similar to the request."""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.llm_output import sentences
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_sentences: int = Field(3, ge=1, le=100, description="sentences kept per passage")
    min_similarity: float = Field(0.2, ge=-1, le=1, description="cosine below which a sentence is dropped")


@stage("refine_sentences", params=Params, produces="passages", kind="query",
       uses={"embedder": ("sentence_transformer",)})
def refine_sentences(query: Query, passages: list[Passage], params: Params, embedder: Embedder) -> list[Passage]:
    """Each passage shrinks to its best sentences, in their original order; none left, it is dropped."""
    split = [sentences(p.text) for p in passages]
    flat = [s for parts in split for s in parts]
    if not flat:
        return []
    question = embedder.encode_queries([query.text])[0]
    similarity = embedder.encode_passages(flat) @ question
    refined, offset = [], 0
    for passage, parts in zip(passages, split):
        scores = similarity[offset:offset + len(parts)]
        offset += len(parts)
        best = [i for i in np.argsort(-scores)[: params.max_sentences] if scores[i] >= params.min_similarity]
        if best:
            text = " ".join(parts[i] for i in sorted(best))
            refined.append(passage.model_copy(update={"text": text, "original_text": passage.text}))
    return refined
