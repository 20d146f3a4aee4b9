"""Metadata enrichment at ingestion, between ``chunk`` and ``embed``: per document, its keywords
(KeyBERT-style, with the embedder) and a short document-level context (contextual retrieval).

- ``keywords``: candidate 1-2-word phrases of the document (English stopwords left out), ranked by the
  cosine similarity of their embedding to the document's (the vector of its opening, as much as the
  model's max sequence length holds, as KeyBERT does), chosen with maximal marginal relevance so
  they are not all variants of one phrase. Every chunk of the document carries them as scalar
  metadata (Chroma stores no lists, filters compare scalars): ``keywords`` ("a, b, c") and ``topic``
  (the best one), so a ``where`` such as ``{"topic": "penguins"}`` selects a document's chunks.
- ``context``: a document-level line the embedder sees before each chunk's text (``Chunk.context``);
  the stored and shown text stays the chunk's own. ``title``: the document's title; ``keywords``:
  its keywords; ``llm``: one sentence the LLM writes per document (prompt ``enrich_context``), also
  kept as ``summary`` metadata.

Not in any shipped pipeline: its params enter the ingestion fingerprint like every step's, so adding
it re-embeds once, and indexes without it are untouched.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import cache
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Passage
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import sentences, strip_markup
from ragline.flows.spec.registry import stage

CLAUSE_BREAK = re.compile(r"[^\w\s'-]+|\n")  # a phrase never spans punctuation or lines
WORD = re.compile(r"\b[^\W\d_][\w'-]*[^\W_]\b")  # two letters or more, no bare number
CHARS_PER_TOKEN = 3  # the reply budget: max_chars in tokens, with room to end the sentence


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keywords: int = Field(0, ge=0, le=20, description="keywords per document, stored as `keywords` and `topic` "
                                                      "metadata (0: off)")
    diversity: float = Field(0.5, ge=0, le=1, description="MMR: 0 ranks by similarity to the document alone, "
                                                          "1 by difference from the keywords already chosen")
    candidates: int = Field(100, ge=1, le=1000, description="most frequent 1-2-word phrases embedded per document")
    context: Literal["none", "title", "keywords", "llm"] = Field(
        "none", description="document-level context the embedder sees before each chunk (not stored): title, "
                            "keywords, or one sentence from the LLM (prompt enrich_context)")
    max_chars: int = Field(200, ge=20, le=1000, description="longest context (llm: the sentence is cut at a word)")
    max_document_chars: int = Field(8000, ge=200, description="document text shown to the LLM and scanned for "
                                                              "keyword candidates")

    @model_validator(mode="after")
    def _keywords_for_keyword_context(self) -> "Params":
        if self.context == "keywords" and not self.keywords:
            raise ValueError("context 'keywords' needs keywords > 0")
        return self


@stage("enrich", params=Params, produces="chunks", kind="ingestion",
       uses={"embedder": ("sentence_transformer",), "llm": ("openai_compatible",)},
       prompt=lambda p: "enrich_context" if p is not None and p.context == "llm" else None,
       prompt_variables=("passage", "title"), shaping_roles=lambda params: _shaping_roles(params),
       reads_roles=lambda params: reads_roles(params))
def enrich(chunks: list[Chunk], params: Params, ctx: StepContext, embedder: Embedder | None = None,
           llm: LLMClient | None = None) -> list[Chunk]:
    """Add each document's keywords (metadata) and context (what the embedder sees) to its chunks."""
    if params.context == "llm" and llm is None:
        raise MissingResource("context 'llm' needs an openai_compatible resource: add one and name it in `uses`")
    if params.keywords and embedder is None:
        raise MissingResource("keywords need the sentence_transformer embedder: name it in `uses`")
    documents = _documents(chunks, params.max_document_chars)
    if not documents:
        return []
    ids = list(documents)
    keywords = dict(zip(ids, keywords_of(list(documents.values()), embedder, params))) \
        if params.keywords else {}
    summaries = _summaries(documents, {c.source_id: c.title for c in chunks}, params, ctx, llm) \
        if params.context == "llm" else {}
    enriched: list[Chunk] = []
    for c in chunks:
        if params.context == "llm" and c.source_id not in summaries:
            continue  # its document failed (reported): none of its chunks is indexed half-enriched
        found = keywords.get(c.source_id, [])
        meta = {"keywords": ", ".join(found), "topic": found[0]} if found else {}
        if summaries.get(c.source_id):
            meta["summary"] = summaries[c.source_id]
        context = _context(c, params, found, summaries.get(c.source_id, ""))
        enriched.append(c.model_copy(update={"metadata": {**c.metadata, **meta}, "context": context}))
    ctx.progress("enriched", len(documents))
    return enriched


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The embedder for keywords, the LLM for its context sentence; neither otherwise."""
    reads = {}
    if params.keywords:
        reads["embedder"] = ("keywords", f"keywords: {params.keywords} ranks phrases with the embedder")
    if params.context == "llm":
        reads["llm"] = ("context", "context 'llm' has the LLM write a sentence per document")
    return reads


def _shaping_roles(params: Params) -> set[str]:
    """The resources this configuration uses: only they enter the index fingerprint."""
    return ({"embedder"} if params.keywords else set()) | ({"llm"} if params.context == "llm" else set())


def _documents(chunks: list[Chunk], max_chars: int) -> dict[str, str]:
    """Each document's text, rebuilt from its chunks in order: the title once (``chunk`` opens every
    piece with it), then the pieces (overlaps repeat a little: harmless here)."""
    parts: dict[str, list[Chunk]] = {}
    for c in chunks:
        parts.setdefault(c.source_id, []).append(c)
    texts = {}
    for sid, cs in parts.items():
        title = cs[0].title
        pieces = [c.text.removeprefix(f"{title}\n") if title else c.text for c in sorted(cs, key=lambda c: c.ordinal)]
        texts[sid] = "\n".join([title, *pieces] if title else pieces)[:max_chars]
    return texts


def keywords_of(texts: list[str], embedder: Embedder, params: Params) -> list[list[str]]:
    """KeyBERT's method for each text: candidate phrases ranked by similarity to the text, with MMR.
    Two encode calls for the whole batch (the texts, then every text's candidates)."""
    candidates = [_candidates(text, params.candidates) for text in texts]
    vectors = _unit(embedder.encode_documents(texts))
    flat = [phrase for phrases in candidates for phrase in phrases]
    phrase_vectors = _unit(embedder.encode_documents(flat)) if flat else np.zeros((0, vectors.shape[1]))
    found, start = [], 0
    for vector, phrases in zip(vectors, candidates):
        own = phrase_vectors[start:start + len(phrases)]
        start += len(phrases)
        found.append([phrases[i] for i in mmr(vector, own, params.keywords, params.diversity)])
    return found


def _candidates(text: str, limit: int) -> list[str]:
    """The ``limit`` most frequent 1-2-word phrases of the text: words (no stopwords, no numbers) and
    pairs of them that stand next to each other within a clause, as written (lowercased)."""
    stop = stop_words()
    counts: Counter[str] = Counter()
    for clause in CLAUSE_BREAK.split(text.lower()):
        words = WORD.findall(clause)
        for i, word in enumerate(words):
            if word not in stop:
                counts[word] += 1
                if i + 1 < len(words) and words[i + 1] not in stop:
                    counts[f"{word} {words[i + 1]}"] += 1
    return [phrase for phrase, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]


@cache
def stop_words() -> frozenset[str]:
    """scikit-learn's English stopwords, imported on first use: importing scikit-learn loads SciPy and
    pandas (~1.5 s, several seconds on a loaded machine), which every process that registers the
    builtin stages (every `ragline` command that runs a pipeline) paid at start-up, enrich or not."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS)


def mmr(document: np.ndarray, phrases: np.ndarray, n: int, diversity: float) -> list[int]:
    """Maximal marginal relevance: indices of ``n`` phrases, each the most similar to the document
    less ``diversity`` times its greatest similarity to those already chosen."""
    if len(phrases) == 0:
        return []
    relevance = phrases @ document
    chosen = [int(np.argmax(relevance))]
    while len(chosen) < min(n, len(phrases)):
        redundancy = (phrases @ phrases[chosen].T).max(axis=1)
        score = (1 - diversity) * relevance - diversity * redundancy
        score[chosen] = -np.inf
        chosen.append(int(np.argmax(score)))
    return chosen


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)


def _summaries(documents: dict[str, str], titles: dict[str, str], params: Params, ctx: StepContext,
               llm: LLMClient) -> dict[str, str]:
    """One sentence per document from the LLM; a document whose call fails is reported and left out."""
    def ask(source_id: str) -> str | None:
        shown = Passage(chunk_id="", source_id=source_id, title=titles[source_id], text=documents[source_id])
        try:
            reply = llm.chat(ctx.prompt(passage=shown, title=titles[source_id]),
                             max_tokens=max(16, params.max_chars // CHARS_PER_TOKEN), temperature=0.0)
        except RuntimeError as exc:
            ctx.fail(source_id, f"the LLM failed to write its context: {exc}")
            return None
        return one_sentence(strip_markup(reply.text), params.max_chars)

    ids = list(documents)
    return {sid: text for sid, text in zip(ids, llm.map(ask, ids)) if text is not None}


def one_sentence(text: str, max_chars: int) -> str:
    """The reply's first sentence on one line, cut at a word within ``max_chars``."""
    first = " ".join((sentences(text) or [""])[0].split())
    if len(first) <= max_chars:
        return first
    return first[:max_chars].rsplit(" ", 1)[0].rstrip(",;:") + " …"


def _context(c: Chunk, params: Params, keywords: list[str], summary: str) -> str:
    if params.context == "title":
        return "" if not c.title or c.text.startswith(c.title) else c.title[:params.max_chars]
    if params.context == "keywords" and keywords:
        return one_sentence(", ".join(keywords), params.max_chars)
    return summary if params.context == "llm" else ""
