"""Dense retrieval from Chroma for every search text of the query (one batched call).

Read-only: a missing store or collection is never created here. When Chroma is missing, empty
or unreadable while the index state holds chunks, a dense-only pipeline fails and a hybrid one
warns and answers from its other retriever (``store_fault``), in one line naming the store and
the remedy. A store missing while nothing was ever indexed is an empty answer.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragline.flows.access import Access, restrict
from ragline.flows.context import StepContext
from ragline.flows.contracts import Query, Ranking
from ragline.flows.spec.registry import stage
from ragline.flows.resources.stores import filters
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.state import REMEDY, IndexState, StoreDamaged, StoreMissing
from ragline.flows.resources.stores.protocols import DenseStore


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(30, ge=1, le=1000, description="passages per search text")
    where: dict[str, Any] | None = Field(None, description="fixed metadata filter, ANDed with the request's")

    @field_validator("where")
    @classmethod
    def _valid_filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        filters.validate(value)
        return value


def combined_filter(fixed: dict[str, Any] | None, requested: dict[str, Any] | None,
                    access: Access) -> dict[str, Any] | None:
    """The pipeline's and the client's filters, within what the query may read (``Query.access``,
    set by the server): every retriever searches with this, so a client's filter only narrows."""
    filters.validate(requested)
    return filters.normalize(restrict({"$and": [f for f in (fixed, requested) if f]}, access))


@stage("retrieve_dense", params=Params, produces="rankings", kind="query",
       uses={"store": ("chroma", "milvus"), "embedder": ("sentence_transformer",)})
def retrieve_dense(query: Query, params: Params, ctx: StepContext, store: DenseStore,
                   embedder: Embedder) -> list[Ranking]:
    """Nearest chunks by embedding, per search text, honouring metadata filters."""
    texts = query.dense_texts()
    where = combined_filter(params.where, query.filters, query.access)
    try:
        store.check_embedder(embedder.spec.vectors_key(), embedder.spec.model)
        vectors = embedder.encode_queries(texts)
        if query.hypothetical_mean and query.hypothetical:
            texts, vectors = pooled(query, texts, vectors, embedder.spec.normalize)
        results = store.query(vectors, params.k, where=where, retriever=ctx.step_id)
        if not any(results) and store.count() == 0:
            _empty_store(store, ctx)
    except StoreMissing as exc:
        if indexed_chunks(ctx):
            store_fault(ctx, exc)
        else:
            ctx.logger.info("nothing is indexed yet: %s", exc)
        results = [[] for _ in texts]
    except StoreDamaged as exc:
        store_fault(ctx, exc)
        results = [[] for _ in texts]
    except Exception as exc:
        store_fault(ctx, _unreadable(store, exc))
        results = [[] for _ in texts]
    return [Ranking(retriever=ctx.step_id, query=t, passages=r) for t, r in zip(texts, results)]


def pooled(query: Query, texts: list[str], vectors: np.ndarray, normalize: bool) -> tuple[list[str], np.ndarray]:
    """HyDE with several samples (Gao et al., 2022): the request's and the pseudo-documents' vectors
    averaged into one query vector (unit length again when the embedder's are), searched once; the
    feedback query (PRF), when there is one, stays a search of its own. Its ranking is named by the request."""
    n = len(query.hypothetical) + (0 if query.hyde_only else len(query.search_texts()))
    mean = vectors[:n].mean(axis=0)
    if normalize and np.linalg.norm(mean) > 0:
        mean = mean / np.linalg.norm(mean)
    return [query.text, *texts[n:]], np.vstack([mean[None, :].astype(vectors.dtype), vectors[n:]])


def _empty_store(store: DenseStore, ctx: StepContext) -> None:
    chunks = indexed_chunks(ctx)
    if chunks:
        raise StoreDamaged(f"{store.location}: the collection is empty while the index state holds {chunks} "
                           f"chunks; {REMEDY}")


def _unreadable(store: DenseStore, exc: Exception) -> Exception:
    """Chroma's own error for a damaged embedded store (``database disk image is malformed``) as
    one line naming the folder and the remedy; any other error unchanged."""
    from chromadb.errors import InternalError

    if store.spec.host or not isinstance(exc, InternalError):
        raise exc
    return StoreDamaged(f"{store.location} is unreadable ({exc}): move it aside (mv {store.path} "
                        f"{store.path}.damaged) and run `ragline index` to re-embed every source")


def indexed_chunks(ctx: StepContext) -> int:
    """Chunks the project's index state names (read-only; 0 without a state, or with several: then
    which one goes with this store is unknown)."""
    project = ctx.project
    if project is None:
        return 0
    names = [n for n, spec in project.spec.resources.items() if spec.type == "index_state"]
    if len(names) != 1:
        return 0
    state: IndexState = project.resource(names[0])
    try:
        return state.counts()[1]
    except StoreMissing:
        return 0


def store_fault(ctx: StepContext, exc: StoreDamaged) -> None:
    """A store that is missing or damaged while the state says otherwise: a pipeline with another
    retriever answers from it with a warning; a pipeline with only this one fails (never a
    silently empty or one-sided answer)."""
    if not _hybrid(ctx):
        raise exc
    ctx.logger.warning("%s; answering from the other retrievers only", exc)


def _hybrid(ctx: StepContext) -> bool:
    project = ctx.project
    if project is None or ctx.pipeline not in project.pipelines:
        return False
    retrievers = [s for s in project.pipeline(ctx.pipeline).steps if s.stage.name.startswith("retrieve_")]
    return len(retrievers) > 1
