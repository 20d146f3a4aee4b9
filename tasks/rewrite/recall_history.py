"""Conversation memory (retrieving context history): from a long chat history, the turns the LLM is
shown, so a question that refers back to something said long ago still finds it.

A turn is an exchange: a user message and the assistant's replies to it. The last ``recent_turns``
are kept verbatim (the conversation's thread); of the earlier ones, the ``k`` most relevant to the
request are added: cosine with the pipeline's embedder, blended by ``lexical_weight`` with the
turn's BM25 score divided by the best one (exact names and numbers count). All of it fits
``max_tokens``: recent turns newest first, then recalled ones best first; a turn that does not fit
is left out. The result, in conversation order, is ``Query.conversation``: the conversational
``rewrite`` reads it instead of its last ``history_turns`` messages, and ``generate`` shows it,
fenced as data, before the question. Measured in bench/conversation_memory.py.

Turns are embedded and counted once per process (a bounded memo keyed by their text), so each new
request of a conversation embeds only the turns it has not seen. Tokens are the LLM's (its
/tokenize, the unit of the prompt) when the step has one, else the embedder's tokenizer.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources.stores.bm25 import BM25Spec, in_memory, tokenize
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.spec.registry import stage
from ragline.tasks.refine.expand_context import token_counts

ROLES = ("user", "assistant")  # a client's system messages are never shown as conversation
MEMO_SIZE = 4096  # turns remembered per resource (vectors, token counts)
_BM25 = BM25Spec(type="bm25")  # the index's defaults (k1, b, Lucene's variant)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recent_turns: int = Field(2, ge=0, le=100, description="last turns (user message and replies) kept verbatim")
    k: int = Field(3, ge=0, le=50, description="earlier turns added, the most relevant to the request first")
    max_tokens: int = Field(800, ge=16, le=32_768, description="budget of the whole conversation shown (within "
                                                               "generate's max_conversation_chars, 4000)")
    lexical_weight: float = Field(0.3, ge=0, le=1, description="share of the relevance from BM25 over the turns "
                                                              "(0: embeddings only)")
    min_similarity: float | None = Field(None, ge=-1, le=1, description="leave out earlier turns whose relevance "
                                                                        "is below this")
    max_turn_chars: int = Field(2000, ge=100, description="longer messages are clipped")


@dataclass(frozen=True)
class Turn:
    """One exchange of the history: where it starts, and its messages."""

    index: int
    messages: tuple[tuple[str, str], ...]

    @property
    def text(self) -> str:
        return "\n".join(f"{role}: {content}" for role, content in self.messages)


@stage("recall_history", params=Params, produces="query", kind="query",
       uses={"embedder": ("sentence_transformer",), "llm": ("openai_compatible",)})
def recall_history(query: Query, params: Params, ctx: StepContext, embedder: Embedder,
                   llm: LLMClient | None = None) -> Query:
    """The recent turns and the earlier turns most relevant to the request, within a token budget,
    as the query's conversation."""
    turns = turns_of(query.history, params.max_turn_chars)
    counter = (lambda texts: memoised(llm, "tokens", texts, llm.count_tokens)) if llm is not None else \
        (lambda texts: memoised(embedder, "tokens", texts, lambda t: token_counts(embedder, t)))
    chosen = select(turns, query.text, params, counter, lambda texts: vectors(embedder, texts))
    earlier = set(turns[:max(0, len(turns) - params.recent_turns)])
    recalled = [t.index for t in chosen if t in earlier]
    ctx.logger.info("conversation: %d of %d turns, earlier ones recalled at messages %s", len(chosen), len(turns),
                    recalled)
    return query.model_copy(update={"conversation": [{"role": r, "content": c} for t in chosen
                                                     for r, c in t.messages]})


def turns_of(history: list[dict[str, str]], max_chars: int) -> list[Turn]:
    """The history's user and assistant messages as exchanges, each opened by a user message."""
    groups: list[tuple[int, list[tuple[str, str]]]] = []
    for index, message in enumerate(history):
        role, content = message.get("role", "user"), str(message.get("content", "")).strip()
        if role not in ROLES or not content:
            continue
        if role == "user" or not groups:
            groups.append((index, []))
        groups[-1][1].append((role, clip(content, max_chars)))
    return [Turn(index, tuple(messages)) for index, messages in groups]


def select(turns: list[Turn], request: str, params: Params, count: Callable[[list[str]], list[int]],
           embed: Callable[[list[str]], np.ndarray]) -> list[Turn]:
    """The turns shown, in conversation order: recent ones newest first while they fit the budget,
    then up to ``k`` earlier ones by relevance, each if it fits."""
    if not turns:
        return []
    split = max(0, len(turns) - params.recent_turns)
    earlier, recent = turns[:split], turns[split:]
    tokens = dict(zip(turns, count([t.text for t in turns])))
    chosen, used = set(), 0
    for turn in reversed(recent):
        if used + tokens[turn] > params.max_tokens:
            break  # the thread is kept unbroken: nothing older than a turn that did not fit
        chosen.add(turn)
        used += tokens[turn]
    if params.k and earlier:
        scores = relevance(earlier, request, params.lexical_weight, embed)
        added = 0
        for i in sorted(range(len(earlier)), key=lambda i: (-scores[i], -i)):  # ties: the later turn
            if added == params.k or (params.min_similarity is not None and scores[i] < params.min_similarity):
                break
            if used + tokens[earlier[i]] <= params.max_tokens:
                chosen.add(earlier[i])
                used += tokens[earlier[i]]
                added += 1
    return sorted(chosen, key=lambda t: t.index)


def relevance(turns: list[Turn], request: str, lexical_weight: float,
              embed: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """Each turn's relevance to the request: cosine, blended with BM25 scaled to [0, 1] when asked."""
    vectors_ = embed([request] + [t.text for t in turns])
    scores = vectors_[1:] @ vectors_[0]
    if lexical_weight:
        scores = (1 - lexical_weight) * scores + lexical_weight * lexical(turns, request)
    return scores


def lexical(turns: list[Turn], request: str) -> np.ndarray:
    """BM25 scores of the turns for the request (English stems, stopwords out), divided by the best."""
    terms = tokenize([request] + [t.text for t in turns])
    if not terms[0] or not any(terms[1:]):
        return np.zeros(len(turns))
    scores = np.asarray(in_memory([t or ["\x00"] for t in terms[1:]], _BM25).get_scores(terms[0]), dtype=float)
    best = scores.max()
    return scores / best if best > 0 else scores




def vectors(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """Unit vectors of the texts (the first one a request, the rest turns), turns memoised."""
    request = _unit(embedder.encode_queries(texts[:1]))
    turns = memoised(embedder, "vectors", texts[1:], lambda t: list(_unit(embedder.encode_passages(t))))
    return np.vstack([request, *turns]) if turns else request


_MEMOS: weakref.WeakKeyDictionary[Any, dict[str, OrderedDict[str, Any]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def memoised(owner: Any, kind: str, texts: list[str], compute: Callable[[list[str]], list[Any]]) -> list[Any]:
    """``compute`` over the texts ``owner`` (a resource) has not seen yet; the last MEMO_SIZE kept."""
    with _LOCK:
        memo = _MEMOS.setdefault(owner, {}).setdefault(kind, OrderedDict())
        missing = list(dict.fromkeys(t for t in texts if t not in memo))
    found = dict(zip(missing, compute(missing))) if missing else {}
    with _LOCK:
        for text in texts:
            if text in memo:
                memo.move_to_end(text)
                found.setdefault(text, memo[text])
        memo.update(found)
        while len(memo) > MEMO_SIZE:
            memo.popitem(last=False)
    return [found[t] for t in texts]


def _unit(vectors_: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors_, axis=1, keepdims=True)
    return vectors_ / np.where(norms == 0, 1, norms)
