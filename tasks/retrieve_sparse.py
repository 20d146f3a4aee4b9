"""Sparse BM25 retrieval (bm25s) for every search text of the query."""
from __future__ import annotations

from flows.context import StepContext
from flows.contracts import Passage, Query, Ranking
from flows.registry import stage
from flows.resources.bm25 import BM25Index
from tasks.retrieve_dense import Params, combined_filter


@stage("retrieve_sparse", params=Params, produces="rankings", kind="query", uses={"sparse": ("bm25",)})
def retrieve_sparse(query: Query, params: Params, ctx: StepContext, sparse: BM25Index) -> list[Ranking]:
    """Best BM25 matches per search text; the same metadata filters as dense retrieval."""
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
