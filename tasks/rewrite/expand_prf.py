"""Pseudo-relevance feedback (RM3): the query expanded with terms of the passages a first retrieval
ranked highest, for a second retrieval.

Placed between a first retrieval (its fused or reranked passages) and a second one: the expanded
query it produces makes ``retrieve_sparse`` score RM3's weighted keyword query (the request's own
terms mixed with the feedback model, ``query_weight`` : 1 - ``query_weight``) and, with ``dense``,
gives ``retrieve_dense`` a second search text (the request followed by the feedback terms as
written). Terms are the BM25 index's own (its stemmer and stop words), so they match the index;
the index is only read.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Feedback, Passage, Query
from ragline.flows.resources.stores.bm25 import tokenize
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.collection_index import by_collection


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: the query passes unchanged (a step `ragline tune` turns on, "
                                            "with its settings, where feedback helps on the corpus)")
    docs: int = Field(10, ge=1, le=100, description="top passages taken as relevant (RM3's fbDocs)")
    terms: int = Field(10, ge=1, le=100, description="feedback terms kept (RM3's fbTerms)")
    query_weight: float = Field(0.5, ge=0, le=1, description="share of the request's own terms in the keyword "
                                                             "query (RM3's originalQueryWeight)")
    max_df: float = Field(1.0, gt=0, le=1, description="leave out terms found in more than this share of "
                                                      "the indexed passages (1: keep all)")
    dense: bool = Field(True, description="also give dense retrieval the request followed by the feedback terms")


@stage("expand_prf", params=Params, produces="query", kind="query", uses={"sparse": ("bm25", "milvus")})
def expand_prf(query: Query, passages: list[Passage], params: Params, sparse: SparseIndex,
               ctx: StepContext | None = None) -> Query:
    """Expand the query with the top passages' terms (RM3) for a second retrieval."""
    if not params.enabled:
        return query
    return with_feedback(query, passages, params, sparse, ctx)


def with_feedback(query: Query, passages: list[Passage], params: Params, sparse: SparseIndex,
                  ctx: StepContext | None = None) -> Query:
    """The query with RM3's feedback from ``passages`` (the tuner replays it on its own index)."""
    feedback = passages[: params.docs]
    if not feedback:
        return query
    weights = relevance_model(sparse.terms([p.text for p in feedback]), passage_weights(feedback))
    if params.max_df < 1:
        frequencies, total = document_frequencies(weights, sparse, ctx, query.collections)
        weights = {t: w for t, w in weights.items() if frequencies.get(t, 0) <= params.max_df * total}
    top = sorted(weights.items(), key=lambda item: (-item[1], item[0]))[: params.terms]
    mass = sum(w for _, w in top)
    if not mass:
        return query
    terms = {t: w / mass for t, w in top}
    text = ""
    if params.dense:
        written = surface_forms([p.text for p in feedback], sparse)
        text = " ".join([query.text, *(written.get(t, t) for t in terms)])
    return query.model_copy(update={"feedback": Feedback(terms=terms, query_weight=params.query_weight, text=text)})


def document_frequencies(terms: dict[str, float], sparse: SparseIndex, ctx: StepContext | None,
                         collections: list[str] | None) -> tuple[dict[str, int], int]:
    """Each term's passage count and the passage count, summed over the collections the query
    searches (the step's own index without collections)."""
    indexes = by_collection(ctx, "sparse", sparse, collections).values() if ctx is not None else [sparse]
    frequencies: dict[str, int] = {}
    total = 0
    for index in indexes:
        found, count = index.document_frequencies(terms)
        total += count
        for term, n in found.items():
            frequencies[term] = frequencies.get(term, 0) + n
    return frequencies, total


def passage_weights(passages: list[Passage]) -> list[float]:
    """P(Q|D) as RM3 approximates it: the retrieval scores, normalised to sum 1 (all equal when a
    score is not positive: scores of another scale, or none)."""
    scores = [p.score for p in passages]
    if min(scores) <= 0:
        return [1 / len(scores)] * len(scores)
    total = sum(scores)
    return [s / total for s in scores]


def relevance_model(documents: list[list[str]], weights: list[float]) -> dict[str, float]:
    """RM1: P(t|R) = sum over feedback documents of P(t|D) * P(Q|D), with P(t|D) = tf / |D|."""
    model: dict[str, float] = defaultdict(float)
    for terms, weight in zip(documents, weights):
        for term, count in Counter(terms).items():
            model[term] += weight * count / len(terms)
    return dict(model)


def surface_forms(texts: list[str], sparse: SparseIndex) -> dict[str, str]:
    """The most frequent written word behind each index term (a stem reads badly to an embedder)."""
    words = [w for ws in tokenize(texts, stemmer="none", stopwords=sparse.spec.stopwords) for w in ws]
    stems = sparse.terms([" ".join(words)])[0] if sparse.spec.stemmer != "none" else words
    if len(stems) != len(words):  # the stemmer dropped or split a word: keep the stems as they are
        return {}
    seen: dict[str, Counter] = defaultdict(Counter)
    for stem, word in zip(stems, words):
        seen[stem][word] += 1
    return {stem: counts.most_common(1)[0][0] for stem, counts in seen.items()}
