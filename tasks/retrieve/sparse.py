"""Sparse BM25 retrieval (bm25s) for every search text of the query.

A query only reads: the published BM25 version is searched as it is. A version that lags the
index state (an ingestion run died before publishing, or the tuned settings changed since) is
reported, never rebuilt here: rebuilding is the writers' job (ingestion, ``ragline tune``,
``ragline check --repair``), so a query can never publish over the index (once, a query after
the state file was lost published an empty version and deleted the valid one). A version that
is missing or unreadable while the state holds chunks fails a BM25-only pipeline and is a
warning in a hybrid one (``retrieve_dense.store_fault``).
"""
from __future__ import annotations

import time

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query, Ranking
from ragline.flows.spec.registry import stage
from ragline.flows.resources.stores.state import REMEDY, IndexState, StoreDamaged, StoreMissing
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.tasks.retrieve.dense import Params, combined_filter, store_fault

LEASE_STALE_SECONDS = 30.0  # as the index sink's lease: a holder silent this long is gone
BEHIND = f"BM25 index is behind the index state (an interrupted ingestion?): searching the published version; {REMEDY}"
RESET = ("BM25 settings changed since the index was built (pipelines.yaml or its tuned overlay): searching the "
         f"version built with the old ones; {REMEDY}")


@stage("retrieve_sparse", params=Params, produces="rankings", kind="query",
       uses={"sparse": ("bm25", "milvus"), "state": ("index_state",)})
def retrieve_sparse(query: Query, params: Params, ctx: StepContext, sparse: SparseIndex,
                    state: IndexState) -> list[Ranking]:
    """Best BM25 matches per search text (query2doc's and PRF's expansions when upstream steps made
    them); the same metadata filters as dense retrieval."""
    texts = query.keyword_search_texts()
    where = combined_filter(params.where, query.filters, query.access)
    try:
        report_lag(sparse, state, ctx)
        if query.feedback is not None and query.feedback.terms:  # expand_prf ran upstream: RM3's weighted query
            hits = sparse.search_weighted([query.feedback.weighted(terms) for terms in sparse.terms(texts)],
                                          params.k, where=where)
        else:
            hits = sparse.search(texts, params.k, where=where)
    except StoreDamaged as exc:
        store_fault(ctx, exc)
        hits = [[] for _ in texts]
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


def report_lag(sparse: SparseIndex, state: IndexState, ctx: StepContext) -> None:
    """Say (never repair) when the published version is not the state's; raise StoreDamaged when
    there is none, or it is unreadable, while the state holds chunks. Read-only: a pointer read, a
    meta read, and a count only when nothing is published.

    While an ingestion run holds the writer lease, the state moves batch by batch and that run
    publishes BM25 itself at its end: that lag is only a note in the log."""
    published = sparse.published_version()  # StoreDamaged when the pointer is garbage
    if not state.exists():
        return  # nothing indexed (or the state is lost: ingestion says so); the published version is searched
    if published is None:
        chunks = state.counts()[1]
        if chunks:
            raise StoreMissing(f"{sparse.location}: no BM25 index is published while the index state holds "
                               f"{chunks} chunks; {REMEDY}")
        return
    behind = published["generation"] != state.generation
    if not behind and published["settings"] == sparse.settings:
        return
    holder = state.lease_holder()
    if holder is not None and not holder.stale(time.time(), LEASE_STALE_SECONDS):
        ctx.logger.info("the index is being updated by %s: BM25 searches the last published version",
                        holder.describe())
    elif behind:
        ctx.logger.warning(BEHIND)
    else:
        ctx.logger.warning(RESET)
