"""BM25 terms as bm25s makes them, without importing bm25s: its package imports scipy.sparse and tqdm
(~0.27 s of a cold ``ragline search`` on 2 cores, issue 38) where splitting a question needs a
regular expression, 33 stopwords and PyStemmer. ``bm25s.tokenize`` (its defaults: lower-cased,
scikit-learn's ``(?u)\\b\\w\\w+\\b``, stopwords dropped before stemming, each distinct word stemmed
once); tests/flows/resources/stores/test_bm25_terms.py checks the two equal on SciFact and on edge
cases, and this list equal to ``bm25s.stopwords.STOPWORDS_EN``. Indexes and queries both use it."""
from __future__ import annotations

import re
from itertools import chain

SPLIT = re.compile(r"(?u)\b\w\w+\b").findall  # bm25s.tokenize's token_pattern
STOPWORDS_EN = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not",
    "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was",
    "will", "with"))


def tokenize(texts: list[str], stemmer: str = "english", stopwords: str = "en") -> list[list[str]]:
    """Texts as BM25 terms, exactly as the index and its searches split them."""
    stop = STOPWORDS_EN if stopwords == "en" else frozenset()
    words = [[w for w in SPLIT(text.lower()) if w not in stop] for text in texts]
    if stemmer == "none":
        return words
    distinct = list(dict.fromkeys(chain.from_iterable(words)))
    import Stemmer

    stems = dict(zip(distinct, Stemmer.Stemmer(stemmer).stemWords(distinct)))  # one a call: not thread-safe
    return [[stems[w] for w in doc] for doc in words]
