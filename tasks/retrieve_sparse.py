"""Sparse BM25 retrieval (bm25s) for every search text of the query."""
from __future__ import annotations

import sqlite3
import time

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query, Ranking
from ragline.flows.registry import stage
from ragline.flows.resources.bm25 import BM25Index
from ragline.flows.resources.state import IndexState
from ragline.tasks.retrieve_dense import Params, combined_filter

LEASE_STALE_SECONDS = 30.0  # as the index sink's lease: a holder silent this long is gone
BEHIND = "BM25 index is behind the index state (interrupted ingestion?): rebuilding"
RESET = "BM25 settings changed since the index was built (pipelines.yaml or its tuned overlay): rebuilding"


@stage("retrieve_sparse", params=Params, produces="rankings", kind="query",
       uses={"sparse": ("bm25",), "state": ("index_state",)})
def retrieve_sparse(query: Query, params: Params, ctx: StepContext, sparse: BM25Index,
                    state: IndexState) -> list[Ranking]:
    """Best BM25 matches per search text; the same metadata filters as dense retrieval."""
    catch_up(sparse, state, ctx)
    texts = query.search_texts()
    hits = sparse.search(texts, params.k, where=combined_filter(params.where, query.filters))
    rankings = []
    for text, results in zip(texts, hits):
        passages = []
        for chunk_id, score, meta in results:
            meta = dict(meta)
            passages.append(Passage(chunk_id=chunk_id, source_id=str(meta.pop("source_id", "")),
                                    title=str(meta.pop("title", "")), text=str(meta.pop("text", "")),
                                    score=score, retriever=ctx.step_id, metadata=meta))
        rankings.append(Ranking(retriever=ctx.step_id, query=text, passages=passages))
    return rankings


def catch_up(sparse: BM25Index, state: IndexState, ctx: StepContext) -> bool:
    """Rebuild BM25 when it lags the state, so hybrid search never silently runs dense-only after
    an ingestion run that died before publishing. One meta read per query when in step; concurrent
    queries rebuild once (``sync`` re-checks under its lock). True if this call rebuilt.

    While an ingestion run holds the writer lease, the state moves batch by batch and that run
    publishes BM25 itself at its end: the published version is searched, with a note in the log.
    An index this process cannot write (a read-only copy) is searched as published, loudly."""
    try:
        holder = state.lease_holder()
        if holder is not None and not holder.stale(time.time(), LEASE_STALE_SECONDS) and sparse.lags(state):
            ctx.logger.info("the index is being updated by %s: BM25 searches the last published version",
                            holder.describe())
            return False
        published = sparse.published_version()
        behind = published is None or published["generation"] != state.generation
        return sparse.sync(state, on_rebuild=lambda: ctx.logger.warning(BEHIND) if behind else ctx.logger.info(RESET))
    except (OSError, sqlite3.Error) as exc:
        ctx.logger.error("could not bring BM25 in step with the index state (%s: %s): searching the "
                         "published version", type(exc).__name__, exc)
        return False
