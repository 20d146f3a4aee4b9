"""BM25 terms without bm25s (flows.resources.stores.bm25_terms, issue 38): what ``bm25s.tokenize``
makes of the same texts, with its stopwords, on SciFact and on the texts a tokenizer gets wrong."""
from __future__ import annotations

import subprocess
import sys

import bm25s
import pytest
import Stemmer
from bm25s.stopwords import STOPWORDS_EN

from ragline.flows.resources.stores import bm25_terms
from tests.helpers.data import require_scifact, scifact_records

EDGES = ["", "   ", "a", "I", "The THE the", "x1 2x __init__ snake_case 3.14 10,000", "don't won't o'clock",
         "ünïcödé ÜNÏCÖDÉ Straße STRASSE", "中文文本 日本語 한국어", "naïve café résumé", "emoji 🙂🙂 end",
         "\u00a0nbsp\u2003em",
         "running runs ran runner", "Running RUNS", "tab\tnew\nline\r\nend", "x" * 5000, "the a an and"]


def by_bm25s(texts: list[str], stemmer: str, stopwords: str) -> list[list[str]]:
    stem = None if stemmer == "none" else Stemmer.Stemmer(stemmer)
    return bm25s.tokenize(texts, stopwords=None if stopwords == "none" else stopwords, stemmer=stem,
                          show_progress=False, return_ids=False)


def test_the_stopwords_are_bm25s_english_ones():
    assert bm25_terms.STOPWORDS_EN == frozenset(STOPWORDS_EN)


@pytest.mark.parametrize("stemmer, stopwords", [("english", "en"), ("none", "en"), ("english", "none"),
                                                 ("none", "none")])
def test_edge_cases_split_as_bm25s_splits_them(stemmer, stopwords):
    assert bm25_terms.tokenize(EDGES, stemmer, stopwords) == by_bm25s(EDGES, stemmer, stopwords)
    for text in EDGES:  # alone, too: bm25s stems per call, over the call's distinct words
        assert bm25_terms.tokenize([text], stemmer, stopwords) == by_bm25s([text], stemmer, stopwords)


def test_scifact_splits_as_bm25s_splits_it():
    require_scifact()
    texts = [f"{r['title']} {r['text']}" for r in scifact_records(2000)]
    assert bm25_terms.tokenize(texts) == by_bm25s(texts, "english", "en")


def test_a_query_does_not_import_bm25s():
    probe = ("import sys\nfrom ragline.flows.resources.stores import bm25\n"
             "bm25.tokenize(['Which drug reduces the risk of stroke?'])\n"
             "from ragline.flows.resources.stores import bm25_segments\nbm25_segments.scorer('lucene', 1.2, 0.75)\n"
             "print(sorted(m for m in ('bm25s', 'scipy', 'tqdm') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "[]"
