"""The lexical half of an incremental BM25 index: immutable segments of raw term frequencies, scored at
query time with the statistics of the live passages (their count, mean length and each term's
document frequency), by bm25s's own idf and term-frequency functions in bm25s's own dtypes and order.

Why raw frequencies: bm25s stores finished scores, which depend on every passage (idf, mean length),
so one changed passage meant rebuilding all of them. Kept raw, a changed passage is a small new
segment plus a deletion mark in an old one, and scores still equal those of a bm25s index built from
scratch over the same live passages (tests/flows/resources/stores/test_bm25_segments.py compares them).
"""
from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable

import numpy as np

DELTA = 0.5  # bm25s's default delta for BM25L and BM25+ (the index never set another)
NONOCCURRING = ("bm25l", "bm25+")  # the variants that score a term's absence too


@dataclass(frozen=True)
class Scorer:
    """bm25s.scoring's idf and term-frequency functions for one variant, with its parameters."""

    method: str
    k1: float
    b: float
    idf: Callable[..., float] = field(repr=False)
    tfc: Callable[..., Any] = field(repr=False)

    @property
    def nonoccurring(self) -> bool:
        return self.method in NONOCCURRING

    def term_weights(self, df: int, n: int, avgdl: np.float64) -> tuple[np.float32, np.float32]:
        """The term's idf and its absence score, stored as float32 exactly as bm25s's idf and
        non-occurrence arrays hold them (``_build_idf_array``, ``_build_nonoccurrence_array``)."""
        idf = self.idf(df, N=n)
        absent = 0.0
        if self.nonoccurring:
            absent = idf * self.tfc(tf_array=0, l_d=avgdl, l_avg=avgdl, k1=self.k1, b=self.b, delta=DELTA)
        return np.float32(idf), np.float32(absent)


def scorer(method: str, k1: float, b: float) -> Scorer:
    return Scorer(method, k1, b, IDF[method], TFC[method])


# bm25s.scoring's idf and term-frequency functions (``_score_idf_*``, ``_score_tfc_*``; Kamphuis et al.,
# ECIR 2020), restated so that a query does not import bm25s (scipy.sparse, tqdm: ~0.27 s of a cold
# `ragline search`, issue 38); test_bm25_segments.py checks each equal to bm25s's own.
def _robertson_tfc(tf_array, l_d, l_avg, k1, b, delta=None):
    return tf_array / (k1 * ((1 - b) + b * l_d / l_avg) + tf_array)


def _atire_tfc(tf_array, l_d, l_avg, k1, b, delta=None):
    return (tf_array * (k1 + 1)) / (tf_array + k1 * (1 - b + b * l_d / l_avg))


def _bm25l_tfc(tf_array, l_d, l_avg, k1, b, delta):
    c_array = tf_array / (1 - b + b * l_d / l_avg)
    return ((k1 + 1) * (c_array + delta)) / (k1 + c_array + delta)


def _bm25plus_tfc(tf_array, l_d, l_avg, k1, b, delta):
    return ((k1 + 1) * tf_array) / (k1 * (1 - b + b * l_d / l_avg) + tf_array) + delta


IDF: dict[str, Callable[..., float]] = {
    "robertson": lambda df, N: math.log(max((N - df + 0.5) / (df + 0.5), 1)),
    "lucene": lambda df, N: math.log(1 + (N - df + 0.5) / (df + 0.5)),
    "atire": lambda df, N: math.log(N / df),
    "bm25l": lambda df, N: math.log((N + 1) / (df + 0.5)),
    "bm25+": lambda df, N: math.log((N + 1) / df),
}
TFC: dict[str, Callable[..., Any]] = {"robertson": _robertson_tfc, "lucene": _robertson_tfc, "atire": _atire_tfc,
                                      "bm25l": _bm25l_tfc, "bm25+": _bm25plus_tfc}


class Postings:
    """One segment's terms (sorted) and, per term, the positions of the passages holding it with how
    often (CSC: ``docs[indptr[t]:indptr[t + 1]]``, ascending), plus each passage's length in terms."""

    ARRAYS = ("indptr", "docs", "tf", "lengths")
    TERMS = "terms.json"

    def __init__(self, terms: list[str], indptr: np.ndarray, docs: np.ndarray, tf: np.ndarray, lengths: np.ndarray):
        self.terms, self.indptr, self.docs, self.tf, self.lengths = terms, indptr, docs, tf, lengths
        self._vocab: dict[str, int] | None = None

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {term: column for column, term in enumerate(self.terms)}
        return self._vocab

    @classmethod
    def build(cls, token_lists: list[list[str]]) -> Postings:
        tokens = list(chain.from_iterable(token_lists))
        terms = sorted(dict.fromkeys(tokens))
        column = {term: i for i, term in enumerate(terms)}
        flat = np.fromiter(map(column.__getitem__, tokens), dtype=np.int64, count=len(tokens))
        lengths = np.fromiter(map(len, token_lists), dtype=np.int32, count=len(token_lists))
        docs = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
        pairs, tf = np.unique((flat << 32) | docs, return_counts=True)  # sorted by term, then passage
        return cls._from_pairs(terms, pairs >> 32, pairs & 0xFFFFFFFF, tf, lengths)

    @classmethod
    def _from_pairs(cls, terms: list[str], columns: np.ndarray, docs: np.ndarray, tf: np.ndarray,
                    lengths: np.ndarray) -> Postings:
        """From postings sorted by (term, passage); terms without a posting are dropped."""
        counts = np.bincount(columns, minlength=len(terms))
        held = np.flatnonzero(counts)
        if len(held) < len(terms):
            terms = [terms[i] for i in held.tolist()]
            counts = counts[held]
        indptr = np.zeros(len(terms) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        # tf as float32, the dtype bm25s scores it in (exact for any count below 2**24)
        return cls(terms, indptr, docs.astype(np.int32), tf.astype(np.float32), lengths.astype(np.int32))

    @classmethod
    def merge(cls, parts: list[tuple[Postings, np.ndarray | None]]) -> Postings:
        """The live passages of ``parts`` (postings, live mask or None for all) as one segment, in
        order; the frequencies are copied, nothing is tokenized again."""
        terms = sorted(set().union(*(p.terms for p, _ in parts)))
        column = {term: i for i, term in enumerate(terms)}
        columns, docs, tfs, lengths, offset = [], [], [], [], 0
        for postings, live in parts:
            live = np.ones(postings.size, dtype=bool) if live is None else live
            moved = np.cumsum(live, dtype=np.int64) - 1 + offset  # each live passage's new position
            own = np.fromiter((column[t] for t in postings.terms), dtype=np.int64, count=len(postings.terms))
            kept = live[postings.docs]
            columns.append(np.repeat(own, np.diff(postings.indptr))[kept])
            docs.append(moved[postings.docs[kept]])
            tfs.append(postings.tf[kept])
            lengths.append(np.asarray(postings.lengths)[live])
            offset += int(live.sum())
        columns_all, docs_all = np.concatenate(columns or [np.empty(0, np.int64)]), np.concatenate(
            docs or [np.empty(0, np.int64)])
        order = np.lexsort((docs_all, columns_all))
        return cls._from_pairs(terms, columns_all[order], docs_all[order],
                               np.concatenate(tfs or [np.empty(0, np.float32)])[order],
                               np.concatenate(lengths or [np.empty(0, np.int32)]))

    def save(self, folder: Path) -> None:
        for name in self.ARRAYS:
            with open(folder / f"{name}.npy", "wb") as out:
                np.save(out, getattr(self, name))
        (folder / self.TERMS).write_text(json.dumps(self.terms), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> Postings:
        # mapped, read as plain arrays (numpy's memmap subclass costs microseconds on every slice)
        arrays = [np.load(folder / f"{name}.npy", mmap_mode="r").view(np.ndarray) for name in cls.ARRAYS]
        terms = json.loads((folder / cls.TERMS).read_text(encoding="utf-8"))
        if len(arrays[0]) != len(terms) + 1 or len(arrays[1]) != len(arrays[2]) or \
                (len(terms) and arrays[0][-1] != len(arrays[1])):
            raise ValueError(f"segment {folder.name}: its postings do not add up")
        return cls(terms, *arrays)

    def column(self, term: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The passages holding ``term`` and its frequency in each, or None if none does."""
        at = self.vocab.get(term)
        if at is None:
            return None
        start, end = int(self.indptr[at]), int(self.indptr[at + 1])
        return self.docs[start:end], self.tf[start:end]


class LiveCorpus:
    """The live passages of one published version across its segments, laid end to end (segment
    ``i`` at ``offsets[i]``): their statistics, and scores over every position (a deleted passage
    scores 0), computed as bm25s computes them for an index of the live passages alone."""

    CACHE_POSTINGS = 4_000_000  # scored postings kept per loaded version (~32 MB: positions and scores)

    def __init__(self, parts: list[tuple[Postings, np.ndarray | None]], scorer: Scorer):
        self.parts, self.scorer = parts, scorer
        sizes = [p.size for p, _ in parts]
        self.offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)
        self.size = int(self.offsets[-1])
        self.live = None if all(live is None for _, live in parts) else np.concatenate(
            [np.ones(p.size, dtype=bool) if live is None else live for p, live in parts])
        self.count = self.size if self.live is None else int(self.live.sum())
        total = sum(int(np.asarray(p.lengths, dtype=np.int64).sum()) if live is None else
                    int(np.asarray(p.lengths, dtype=np.int64)[live].sum()) for p, live in parts)
        self.avgdl = np.float64(total) / self.count if self.count else np.float64(0)
        self._weights: dict[str, tuple[int, np.float32, np.float32]] = {}
        self._cached: OrderedDict[str, list[tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self._cached_size = 0
        self._cache_lock = threading.Lock()

    def df(self, term: str) -> int:
        """How many live passages hold ``term``."""
        return self._term(term)[0]

    def _term(self, term: str) -> tuple[int, np.float32, np.float32]:
        cached = self._weights.get(term)
        if cached is None:
            df = 0
            for postings, live in self.parts:
                found = postings.column(term)
                if found is not None:
                    df += len(found[0]) if live is None else int(np.count_nonzero(live[found[0]]))
            idf, absent = self.scorer.term_weights(df, self.count, self.avgdl) if df else (np.float32(0),) * 2
            cached = self._weights[term] = (df, idf, absent)  # a race computes the same value twice
        return cached

    def known(self, terms: list[str]) -> list[str]:
        """The terms some live passage holds, in order, repeats kept (bm25s scores a repeat twice)."""
        return [t for t in terms if self._term(t)[0]]

    def _add(self, scores: np.ndarray, term: str) -> None:
        """Add ``term``'s score to every passage holding it (deleted ones get some too: masked later)."""
        for positions, values in self._postings(term):
            scores[positions] += values  # a term holds a passage once: no repeated position

    def _postings(self, term: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """``term``'s (positions, float32 scores) per segment, as bm25s stores them in its score matrix:
        ``idf * tfc`` (less the absence score for BM25L and BM25+). The most recently used terms are
        kept, up to CACHE_POSTINGS postings, for the life of this version (its statistics never change)."""
        with self._cache_lock:
            found = self._cached.get(term)
            if found is not None:
                self._cached.move_to_end(term)
                return found
        _, idf, absent = self._term(term)
        s, found = self.scorer, []
        for (postings, _), offset in zip(self.parts, self.offsets.tolist()):
            column = postings.column(term)
            if column is None:
                continue
            docs, tf = column
            values = idf * s.tfc(tf_array=tf, l_d=postings.lengths[docs], l_avg=self.avgdl, k1=s.k1, b=s.b,
                                 delta=DELTA)
            if s.nonoccurring:
                values -= absent
            found.append((docs + offset if offset else docs, values.astype(np.float32)))
        size = sum(len(values) for _, values in found)
        with self._cache_lock:
            if term not in self._cached and size <= self.CACHE_POSTINGS:
                self._cached[term] = found
                self._cached_size += size
                while self._cached_size > self.CACHE_POSTINGS:
                    self._cached_size -= sum(len(v) for _, v in self._cached.popitem(last=False)[1])
        return found

    def scores(self, terms: list[str]) -> np.ndarray | None:
        """bm25s's ``get_scores`` over the known ``terms``, float32, one per position; None if no term is known."""
        known = self.known(terms)
        if not known:
            return None
        scores = np.zeros(self.size, dtype=np.float32)
        for term in known:
            self._add(scores, term)
        if self.scorer.nonoccurring:
            scores += np.array([self._term(t)[2] for t in known], dtype=np.float32).sum()
        return scores

    def term_scores(self, term: str) -> np.ndarray:
        """One known term's scores (``get_scores_from_ids([term])``)."""
        return self.scores([term])


def unpack_deleted(path: Path, size: int) -> np.ndarray:
    """A segment's deletion bitmap (packed bits on disk) as a bool array, True where deleted."""
    packed = np.load(path)
    if packed.dtype != np.uint8 or len(packed) != math.ceil(size / 8):
        raise ValueError(f"deletion bitmap {path.name} is not one of {size} passages")
    return np.unpackbits(packed, count=size).astype(bool)


def pack_deleted(path: Path, deleted: np.ndarray) -> None:
    with open(path, "wb") as out:
        np.save(out, np.packbits(deleted))
