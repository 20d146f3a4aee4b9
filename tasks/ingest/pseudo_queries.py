"""Pseudo-queries from the corpus itself: (query, relevant document) pairs for tuning without labels.

Strategies (split evenly when several are named):

- ``inverse_cloze``: a sentence cut out of a passage is the query, its document the answer (ICT,
  Lee et al. 2019). The sentence is still in the index, where it would match itself word for word
  and make BM25 look far better than on real questions; so each pair records the ``cut`` and the
  tuner scores the source document *without* it (see ``without``): the query must find its
  document through the rest of the text, as a real question does.
- ``title``: the document's title is the query, cut out of every chunk of the document in the
  same way (chunks start with their title).
- ``keywords``: a few content words of a cut-out sentence, the ones its document's other text
  shares least (ties: the rarer in the corpus first), in their order: short, keyword-like and
  worded unlike the rest of the source, as users' queries are. Inverse cloze queries share rare
  terms with their surroundings, which favours BM25; these do not. Words in over a tenth of the
  documents (function words, in any language) are never keywords. The sentence is cut as above.
- ``llm``: the configured LLM writes a question the passage answers (doc2query / InPars), from the
  template ``pseudo_query`` (``prompts/pseudo_query.j2``); nothing is cut.

Only the index is read (the state record's chunks, i.e. the corpus as indexed), never queries or
judgements, unless ``labelled`` names a ``ragline feedback export --qrels`` folder: its train split's
rated questions (strategy ``feedback``, its test split never) come first, pseudo-queries fill the
rest up to ``n``. The same seed on the same corpus makes the same pairs; ``n`` and ``max_seconds``
bound the work.
"""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import regex
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import TRAIN_PAIRS, PseudoQuery
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm_output import parse_lines
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.stores.state import IndexState

Strategy = Literal["inverse_cloze", "title", "keywords", "llm"]
# A sentence ends at Unicode sentence-final punctuation of any script (. ! ? ؟ ۔ । 。 ！ ？ …),
# closing quotes and brackets included, before a space, or at once after a full-width one (CJK
# text has no spaces); what follows need not be a capital (Arabic, Chinese, lower-case text).
SENTENCE = regex.compile(r"(?<=\p{Sentence_Terminal}[\p{Pe}\p{Pf}\"']*)\s+"
                         r"|(?<=[。！？｡︒﹒﹗﹖][\p{Pe}\p{Pf}\"']*)(?=\S)")
TOKEN = regex.compile(r"[\p{L}\p{N}][\p{L}\p{M}\p{N}'’-]*")
COMMON_SHARE = 0.1  # keywords: words in more documents than this share are function words
CJK = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}]")  # written without spaces: a character is a word
ABBREVIATION = re.compile(r"\b(?:e\.g|i\.e|et al|vs|Fig|Figs|Dr|Mr|Mrs|No|approx|ca)\.$", re.I)
OVERLAP_WORDS = 4  # a run of this many of the cut's words elsewhere in the document is cut too


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(300, ge=1, le=100_000, description="pairs to make, at most one per document")
    seed: int = Field(0, description="the same seed on the same corpus makes the same pairs")
    strategies: list[Strategy] = Field(["inverse_cloze"], min_length=1,
                                       description="inverse_cloze, title, keywords, llm (needs an LLM "
                                                   "resource); "
                                                   "several share the pairs evenly")
    min_words: int = Field(6, ge=1, le=200, description="shortest query, in words")
    max_words: int = Field(40, ge=1, le=500, description="longest query, in words")
    min_sentences: int = Field(3, ge=1, le=100, description="inverse cloze: documents with fewer sentences are "
                                                             "skipped (the rest must still say what it is about)")
    mask: bool = Field(True, description="score each source without the text cut out of it (inverse cloze, "
                                         "title); off: the query also matches its own words in the index")
    max_seconds: float | None = Field(300.0, gt=0, description="stop making pairs after this long (LLM calls "
                                                               "are the slow part); None: no limit")
    keywords: int = Field(5, ge=2, le=20, description="keywords: words per query (at least 3 must be found)")
    max_tokens: int = Field(64, ge=8, le=512, description="llm: length of the generated question")
    max_passage_chars: int = Field(2000, ge=100, description="llm: longer passages are clipped in the prompt")
    labelled: str | None = Field(None, description="a `ragline feedback export --qrels` folder (relative: to the "
                                                   "pipelines file): its train split's rated questions come first "
                                                   "(strategy feedback), pseudo-queries fill the rest up to n")

    @model_validator(mode="after")
    def _lengths(self) -> "Params":
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) must not exceed max_words ({self.max_words})")
        return self


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM only for the ``llm`` strategy."""
    if "llm" in params.strategies:
        return {"llm": ("strategies", "strategy 'llm' has the LLM write a question per passage")}
    return {}


@stage("pseudo_queries", params=Params, produces="pairs", kind="job",
       uses={"state": ("index_state",), "llm": ("openai_compatible",)}, reads_roles=reads_roles,
       prompt=lambda p: "pseudo_query" if p is not None and "llm" in p.strategies else None,
       prompt_variables=("passage", "title"))
def pseudo_queries(params: Params, ctx: StepContext, state: IndexState,
                   llm: LLMClient | None = None) -> list[PseudoQuery]:
    """Sample documents of the index and make (query, relevant document) pairs from them."""
    if "llm" in params.strategies and llm is None:
        raise MissingResource("strategy 'llm' needs an openai_compatible resource: add one and name it in `uses`")
    documents = corpus_documents(state)
    frequency = document_frequency(documents) if "keywords" in params.strategies else None
    order = sorted(documents)
    random.Random(params.seed).shuffle(order)
    deadline = None if params.max_seconds is None else time.monotonic() + params.max_seconds
    pairs = labelled_pairs(params.labelled, ctx, documents)[:params.n] if params.labelled else []
    tried = 0
    for source_id in order:
        if len(pairs) >= params.n:
            break
        if deadline is not None and time.monotonic() > deadline:
            ctx.logger.warning("pseudo-queries: time budget of %s s spent after %d pairs", params.max_seconds,
                               len(pairs))
            break
        strategy = params.strategies[len(pairs) % len(params.strategies)]
        rng = random.Random(f"{params.seed}:{strategy}:{source_id}")  # a pair does not depend on the others
        tried += 1
        pair = make_pair(strategy, source_id, documents[source_id], rng, params, ctx, llm, frequency)
        if pair is not None:
            pairs.append(pair)
    ctx.logger.info("pseudo-queries: %d pairs from %d of %d documents", len(pairs), tried, len(documents))
    ctx.progress("pairs", len(pairs))
    return pairs


def labelled_pairs(folder: str, ctx: StepContext, documents: dict[str, object]) -> list[PseudoQuery]:
    """The train split of a feedback export whose source is still indexed."""
    path = (Path(ctx.base_dir) / folder).resolve() / TRAIN_PAIRS
    if not path.is_file():
        raise FileNotFoundError(f"labelled: {path} is missing (write it with `ragline feedback export --qrels "
                                f"{folder}`)")
    rows = [PseudoQuery.model_validate(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    kept = [p for p in rows if p.source_id in documents]
    ctx.logger.info("pseudo-queries: %d labelled pairs from %s (%d name documents no longer indexed)", len(kept),
                    path, len(rows) - len(kept))
    return kept


def corpus_documents(state: IndexState) -> dict[str, list[tuple[str, str, str]]]:
    """source id -> its chunks as (chunk id, text, title), in chunk order: the corpus as indexed."""
    documents: dict[str, list[tuple[int, str, str, str]]] = {}
    for chunk_id, text, meta in state.chunk_rows():
        ordinal = meta.get("chunk", 0)
        documents.setdefault(str(meta["source_id"]), []).append(
            (ordinal if isinstance(ordinal, int) else 0, chunk_id, text, str(meta.get("title") or "")))
    return {sid: [(cid, text, title) for _, cid, text, title in sorted(chunks)]
            for sid, chunks in documents.items()}


def document_frequency(documents: dict[str, list[tuple[str, str, str]]]) -> dict[str, float]:
    """Lower-cased word -> the share of documents holding it."""
    counts: dict[str, int] = {}
    for chunks in documents.values():
        for word in {w.lower() for _, text, _ in chunks for w in TOKEN.findall(text)}:
            counts[word] = counts.get(word, 0) + 1
    n = max(1, len(documents))
    return {w: c / n for w, c in counts.items()}


def keyword_query(sentence: str, rest: str, frequency: dict[str, float], n: int) -> str | None:
    """Up to ``n`` content words of ``sentence``: those ``rest`` (its document without it) holds
    least often, the rarer first on a tie, in the sentence's order; None with fewer than 3."""
    elsewhere: dict[str, int] = {}
    for word in TOKEN.findall(rest):
        elsewhere[word.lower()] = elsewhere.get(word.lower(), 0) + 1
    seen: dict[str, str] = {}
    for word in TOKEN.findall(sentence):
        key = word.lower()
        if key not in seen and (len(word) > 2 or CJK.search(word)) and not key.isdigit() \
                and frequency.get(key, 0.0) <= COMMON_SHARE:
            seen[key] = word
    if len(seen) < 3:
        return None
    picked = set(sorted(seen, key=lambda w: (elsewhere.get(w, 0), frequency.get(w, 0.0), w))[:n])
    return " ".join(word for key, word in seen.items() if key in picked)


def make_pair(strategy: str, source_id: str, chunks: list[tuple[str, str, str]], rng: random.Random,
              params: Params, ctx: StepContext, llm: LLMClient | None,
              frequency: dict[str, float] | None = None) -> PseudoQuery | None:
    """One pair from one document, or None when the document does not lend itself to this strategy."""
    title = chunks[0][2]
    if strategy == "title":
        if not _fits(title, params):
            return None
        chunk_id = chunks[0][0]
        return PseudoQuery(text=title, source_id=source_id, chunk_id=chunk_id, strategy=strategy,
                           cut=title if params.mask else "")
    if strategy in ("inverse_cloze", "keywords"):
        sentences = [(cid, s) for cid, text, t in chunks for s in sentences_of(body(text, t))]
        if len({s for _, s in sentences}) < params.min_sentences:
            return None
        fitting = [(cid, s) for cid, s in sentences if _fits(s, params)]
        if not fitting:
            return None
        chunk_id, sentence = rng.choice(fitting)
        query = sentence
        if strategy == "keywords":
            rest = " ".join(without(body(text, t), sentence) for _, text, t in chunks)
            query = keyword_query(sentence, rest, frequency or {}, params.keywords)
            if query is None:
                return None
        return PseudoQuery(text=query, source_id=source_id, chunk_id=chunk_id, strategy=strategy,
                           cut=sentence if params.mask else "")
    chunk_id, text, _ = rng.choice(chunks)
    prompt = ctx.prompt(passage=body(text, title)[:params.max_passage_chars], title=title)
    reply = llm.chat(prompt, max_tokens=params.max_tokens, temperature=0.0).text  # type: ignore[union-attr]
    question = _question(reply)
    if not _fits(question, params):
        ctx.logger.info("pseudo-queries: LLM reply for %s not usable (%r)", source_id, reply[:80])
        return None
    return PseudoQuery(text=question, source_id=source_id, chunk_id=chunk_id, strategy=strategy)


def body(text: str, title: str) -> str:
    """A chunk's text without the title line the chunker puts in front of it."""
    first, sep, rest = text.partition("\n")
    return rest if sep and title and first.lstrip("# ").strip() == title.strip() else text


def sentences_of(text: str) -> list[str]:
    """Sentences, split at sentence-final punctuation of any script (not after e.g., et al. and the like)."""
    pieces: list[str] = []
    for piece in SENTENCE.split(" ".join(text.split())):
        if pieces and ABBREVIATION.search(pieces[-1]):
            pieces[-1] += " " + piece
        else:
            pieces.append(piece)
    return [p.strip() for p in pieces if p.strip()]


def without(text: str, cut: str, overlap: int = OVERLAP_WORDS) -> str:
    """``text`` with ``cut`` removed: every exact occurrence, and any run of ``overlap`` or more
    consecutive words it shares with ``cut`` (the part of a sentence that a neighbouring chunk
    repeats, or a sentence split across two chunks)."""
    if not cut:
        return text
    removed = text.replace(cut, " ")
    words = cut.split()
    grams = {tuple(words[i:i + overlap]) for i in range(len(words) - overlap + 1)}
    tokens = removed.split()
    dropped = [False] * len(tokens)
    for i in range(len(tokens) - overlap + 1):
        if grams and tuple(tokens[i:i + overlap]) in grams:
            dropped[i:i + overlap] = [True] * overlap
    if removed == text and not any(dropped):
        return text  # untouched: keep it as it is (the tuner re-embeds only changed chunks)
    return " ".join(t for t, gone in zip(tokens, dropped) if not gone)


def words(text: str) -> int:
    """Words: what spaces separate, and each CJK character (those scripts use no spaces)."""
    return sum(max(1, len(CJK.findall(token))) for token in text.split())


def _fits(query: str, params: Params) -> bool:
    return params.min_words <= words(query) <= params.max_words


def _question(reply: str) -> str:
    """The first line of the reply, without a 'Question:' label, numbering or quotes."""
    line = next(iter(parse_lines(reply, 1)), "")
    line = re.sub(r"^(?:question|query)\s*[:\-]\s*", "", line.strip(), flags=re.I)
    return line.strip().strip("\"'“”").strip()
