"""Dense retrieval from Chroma for every search text of the query (one batched call)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query, Ranking
from ragline.flows.registry import stage
from ragline.flows.resources import filters
from ragline.flows.resources.chroma import ChromaStore
from ragline.flows.resources.embedder import Embedder


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(30, ge=1, le=1000, description="passages per search text")
    where: dict[str, Any] | None = Field(None, description="fixed metadata filter, ANDed with the request's")

    @field_validator("where")
    @classmethod
    def _valid_filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        filters.validate(value)
        return value


def combined_filter(fixed: dict[str, Any] | None, requested: dict[str, Any] | None) -> dict[str, Any] | None:
    filters.validate(requested)
    return filters.normalize({"$and": [f for f in (fixed, requested) if f]})


@stage("retrieve_dense", params=Params, produces="rankings", kind="query",
       uses={"store": ("chroma",), "embedder": ("sentence_transformer",)})
def retrieve_dense(query: Query, params: Params, ctx: StepContext, store: ChromaStore,
                   embedder: Embedder) -> list[Ranking]:
    """Nearest chunks by embedding, per search text, honouring metadata filters."""
    texts = query.dense_texts()
    store.check_embedder(embedder.spec.vectors_key(), embedder.spec.model)
    vectors = embedder.encode_queries(texts)
    results = store.query(vectors, params.k, where=combined_filter(params.where, query.filters), retriever=ctx.step_id)
    return [Ranking(retriever=ctx.step_id, query=t, passages=r) for t, r in zip(texts, results)]
