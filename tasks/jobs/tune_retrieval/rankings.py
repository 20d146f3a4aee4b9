"""Each pseudo-query ranked once per retriever: dense from the store, BM25 per candidate setting in memory."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ragline.flows.context import StepContext
from ragline.flows.contracts import PseudoQuery
from ragline.flows.resources.stores.bm25 import in_memory, ranked, tokenize
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.state import IndexState
from ragline.tasks.generate.answerable import max_cosine
from ragline.tasks.ingest.pseudo_queries import without
from ragline.flows.resources.stores.protocols import DenseStore
from ragline.tasks.jobs.tune_retrieval.params import Params, QUERY_BATCH


@dataclass
class Rankings:
    """Per query, each retriever's ranking at full depth: (chunk index, score) pairs, best first."""

    docs: np.ndarray  # the document index of every chunk index
    dense: list[list[tuple[int, float]]]
    sparse: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)  # by BM25 variant name
    # per query, the cosine similarity of its source's closest chunk (without the cut): what an
    # answerability gate sees when the question is answerable (None: no source)
    source_similarity: list[float | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # every chunk's text as BM25 scored it (sources without the cut)
    tokens: dict[str, list[list[str]]] = field(default_factory=dict)  # those texts' BM25 terms, by stemmer


# ----------------------------------------------------------------------------- the corpus and rankings
@dataclass
class Corpus:
    ids: list[str]  # chunk ids, sorted (fuse breaks score ties by chunk id)
    texts: list[str]
    docs: np.ndarray  # document index of each chunk
    doc_ids: list[str]
    doc_index: dict[str, int]
    chunks_of: dict[int, list[int]]

    @classmethod
    def from_state(cls, state: IndexState) -> "Corpus":
        return cls.from_rows(state.chunk_rows())

    @classmethod
    def from_rows(cls, rows: list[tuple[str, str, dict[str, Any]]]) -> "Corpus":
        rows = sorted(rows, key=lambda r: r[0])
        doc_ids = sorted({str(r[2]["source_id"]) for r in rows})
        doc_index = {d: i for i, d in enumerate(doc_ids)}
        docs = np.fromiter((doc_index[str(r[2]["source_id"])] for r in rows), dtype=np.int64, count=len(rows))
        chunks_of: dict[int, list[int]] = {}
        for i, d in enumerate(docs.tolist()):
            chunks_of.setdefault(d, []).append(i)
        return cls([r[0] for r in rows], [r[1] for r in rows], docs, doc_ids, doc_index, chunks_of)

    def masked(self, pairs: list[PseudoQuery]) -> dict[int, str]:
        """chunk index -> its text without what a pair cut out of its document (changed chunks only)."""
        changed: dict[int, str] = {}
        for pair in pairs:
            if not pair.cut or pair.source_id not in self.doc_index:
                continue
            for c in self.chunks_of[self.doc_index[pair.source_id]]:
                text = without(changed.get(c, self.texts[c]), pair.cut)
                if text != self.texts[c]:
                    changed[c] = text
        return changed


def bm25_variants(params: Params, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The BM25 settings to try, the current one first (it is always tried, whatever the budget)."""
    grid = [{"k1": k1, "b": b, "stemmer": s}
            for s, k1, b in itertools.product(params.bm25_stemmer, params.bm25_k1, params.bm25_b)]
    current = dict(base["bm25"])
    return [current] + [v for v in grid if v != current]


def variant_name(v: dict[str, Any]) -> str:
    return f"bm25 k1={v['k1']:g} b={v['b']:g} {v['stemmer']}"


def rank_pairs(pairs: list[PseudoQuery], corpus: Corpus, store: DenseStore, embedder: Embedder, spec: Any,
               params: Params, base: dict[str, Any], deadline: float | None,
               ctx: StepContext | None = None, timings: dict[str, float] | None = None) -> tuple[Rankings, bool]:
    """Each retriever's ranking of every pseudo-query, at the deepest depth tried, with every
    source scored without the text cut out of it."""
    depth = max([*params.depths, base["depth_dense"], base["depth_sparse"]])
    return rank_queries([p.text for p in pairs], corpus, store, embedder, spec, bm25_variants(params, base), depth,
                        corpus.masked(pairs), [corpus.doc_index.get(p.source_id) for p in pairs], deadline,
                        ctx, timings)


def rank_queries(queries: list[str], corpus: Corpus, store: DenseStore, embedder: Embedder, spec: Any,
                 variants: list[dict[str, Any]], depth: int, changed: dict[int, str] | None = None,
                 sources: list[int | None] | None = None, deadline: float | None = None,
                 ctx: StepContext | None = None, timings: dict[str, float] | None = None) -> tuple[Rankings, bool]:
    """Dense and BM25 (each variant) rankings of ``queries``, on the corpus with ``changed`` chunk
    texts; ``sources[i]``: the document query i was cut from, re-scored without the cut."""
    timings = {} if timings is None else timings
    changed = changed or {}
    clock = time.perf_counter()
    similarity: list[float | None] = []
    dense = dense_rankings(queries, depth, corpus, store, embedder, changed, sources or [None] * len(queries),
                           similarity)
    cache = Rankings(docs=corpus.docs, dense=dense, source_similarity=similarity)
    timings["dense"] = time.perf_counter() - clock
    clock = time.perf_counter()
    texts = cache.texts = [changed.get(i, t) for i, t in enumerate(corpus.texts)]
    exhausted = False
    tokens = cache.tokens
    for variant in variants:
        if cache.sparse and deadline is not None and time.monotonic() > deadline:
            exhausted = True
            if ctx is not None:
                ctx.logger.warning("tune: time budget spent after %d BM25 variants", len(cache.sparse))
            break
        if variant["stemmer"] not in tokens:
            tokens[variant["stemmer"]] = tokenize(texts, variant["stemmer"], spec.stopwords)
        vspec = spec.model_copy(update=variant)
        cache.sparse[variant_name(variant)] = sparse_rankings(queries, depth, tokens[variant["stemmer"]], vspec)
    timings["bm25"] = time.perf_counter() - clock
    return cache, exhausted


def dense_rankings(queries: list[str], depth: int, corpus: Corpus, store: DenseStore, embedder: Embedder,
                   changed: dict[int, str], sources: list[int | None],
                   similarity: list[float | None] | None = None) -> list[list[tuple[int, float]]]:
    """Chroma's ranking per query; the query's own source document is re-scored from its chunks as
    they would be without the cut text (re-embedded), and put back in place. ``similarity``
    receives each query's cosine similarity to its source's closest chunk."""
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    store.check_embedder(embedder.spec.vectors_key(), embedder.spec.model)
    vectors = embedder.encode_queries(queries)
    source_chunks = {c for s in sources if s is not None for c in corpus.chunks_of.get(s, [])}
    stored = store.vectors([corpus.ids[c] for c in sorted(source_chunks - set(changed))])
    order = sorted(set(changed) & source_chunks)
    fresh = dict(zip(order, embedder.encode_documents([changed[c] for c in order]))) if order else {}
    vector_of = {c: fresh[c] if c in fresh else stored.get(corpus.ids[c]) for c in source_chunks}
    extra = max((len(corpus.chunks_of.get(s, [])) for s in sources if s is not None), default=0)
    results = [r for start in range(0, len(vectors), QUERY_BATCH)  # Chroma: a bounded number of SQL variables
               for r in store.query(vectors[start:start + QUERY_BATCH], depth + extra)]
    rankings = []
    for query_vector, passages, source in zip(vectors, results, sources):
        ranking = [(position[p.chunk_id], p.score) for p in passages if p.chunk_id in position]
        own = [c for c in corpus.chunks_of.get(source, []) if vector_of.get(c) is not None] \
            if source is not None else []
        if similarity is not None:
            similarity.append(max_cosine(query_vector, np.stack([vector_of[c] for c in own])) if own else None)
        if own:
            mine = set(own)
            ranking = [r for r in ranking if r[0] not in mine]
            scores = store.score(query_vector, np.stack([vector_of[c] for c in own]))
            floor = ranking[depth - 1][1] if len(ranking) >= depth else -np.inf
            ranking += [(c, float(s)) for c, s in zip(own, scores) if s >= floor]
        ranking.sort(key=lambda r: (-r[1], r[0]))  # chunk indexes sort like chunk ids
        rankings.append(ranking[:depth])
    return rankings


def sparse_rankings(queries: list[str], depth: int, tokens: list[list[str]],
                    spec: Any) -> list[list[tuple[int, float]]]:
    """BM25's ranking per query on an in-memory index of these tokens (hits scoring 0 dropped, as
    the published index's search does)."""
    retriever = in_memory(tokens, spec)
    query_tokens = tokenize(queries, spec.stemmer, spec.stopwords)
    rankings: list[list[tuple[int, float]]] = [[] for _ in queries]
    if not tokens:
        return rankings
    for i, terms in enumerate(query_tokens):
        if terms:
            scores = retriever.get_scores(terms)
            rankings[i] = [(d, float(scores[d])) for d in ranked(scores, depth).tolist()]  # ties: chunk id order
    return rankings
