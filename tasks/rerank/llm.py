"""LLM reranking: pointwise yes/no relevance from token logprobs, a listwise permutation of the top
few, or pairwise comparisons (PRP) asked in both orders so the model's position bias cancels."""
from __future__ import annotations

import logging
import math
import re
from itertools import permutations
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.llm import Completion, LLMClient
from ragline.flows.resources.models.llm_output import clip, option_probabilities, parse_permutation
from ragline.flows.spec.registry import stage
from ragline.tasks.rerank.cross_encoder import BlendParams, blend

log = logging.getLogger("ragline.rerank_llm")


class Params(BlendParams):
    method: Literal["pointwise", "listwise", "pairwise"] = "pointwise"
    candidates: int = Field(10, ge=1, le=100, description="top passages the LLM judges (listwise: a few)")
    max_passage_chars: int = Field(1500, ge=100, description="passage text shown to the LLM")
    pairing: Literal["all_pairs", "sliding"] = Field(
        "all_pairs", description="pairwise: every pair (k(k-1) calls), or bubble passes from the bottom (PRP-sliding)")
    passes: int = Field(1, ge=1, le=100, description="pairwise sliding: bubble passes, each settles the next top place")
    max_calls: int = Field(100, ge=2, le=10_000, validate_default=True,
                           description="pairwise: most LLM calls per request (each pair is asked in both orders)")

    @field_validator("max_calls")
    @classmethod
    def _calls_within_bound(cls, value: int, info: ValidationInfo) -> int:
        data = info.data
        if data.get("method") != "pairwise" or not {"candidates", "pairing", "passes"} <= data.keys():
            return value
        needed = pairwise_calls(data["candidates"], data["pairing"], data["passes"])
        if needed > value:
            hint = "use pairing: sliding, " if data["pairing"] == "all_pairs" else "fewer passes, "
            raise ValueError(f"pairwise {data['pairing']} over {data['candidates']} candidates needs up to {needed} "
                             f"LLM calls (each pair in both orders), more than max_calls ({value}): lower "
                             f"candidates, {hint}or raise max_calls")
        return value


def pairwise_calls(candidates: int, pairing: str, passes: int) -> int:
    """LLM calls a pairwise ranking of ``candidates`` passages makes at most (two per comparison)."""
    if pairing == "all_pairs":
        return candidates * (candidates - 1)
    return 2 * sum(candidates - 1 - settled for settled in range(min(passes, candidates - 1)))


def _variables(p: Params) -> tuple[str, ...]:
    return ("question", "passage") if p.method == "pointwise" else ("question", "passages")


@stage("rerank_llm", params=Params, produces="passages", kind="query", uses={"llm": ("openai_compatible",)},
       prompt=lambda p: f"rerank_{p.method}", prompt_variables=_variables)
def rerank_llm(query: Query, passages: list[Passage], params: Params, ctx: StepContext,
               llm: LLMClient) -> list[Passage]:
    """Reorder the top candidates by the LLM's judgement; the rest follow in retrieval order."""
    pool, rest = passages[: params.candidates], passages[params.candidates:]
    shown = [p.model_copy(update={"text": clip(p.text, params.max_passage_chars)}) for p in pool]
    question = clip(query.text, 1000)
    if params.method == "pointwise":
        relevance = _pointwise(question, shown, ctx, llm)
    elif params.method == "pairwise":
        relevance = _pairwise(question, shown, params, ctx, llm)
    else:
        order = parse_permutation(llm.chat(ctx.prompt(question=question, passages=shown), max_tokens=64).text,
                                  len(pool), "listwise ranking")
        relevance = _by_rank(order)
    return (blend(pool, relevance, params) + rest)[: params.top_k]


def _by_rank(order: list[int]) -> list[float]:
    """Relevance 1, 1 - 1/n, ... for the passages at ``order``'s places."""
    relevance = [0.0] * len(order)
    for rank, index in enumerate(order):
        relevance[index] = 1.0 - rank / max(1, len(order))
    return relevance


def _pointwise(question: str, passages: list[Passage], ctx: StepContext, llm: LLMClient) -> list[float]:
    """P(Yes) for each passage, asked concurrently (the client caps requests in flight)."""

    def judge(passage: Passage) -> float:
        reply = llm.chat(ctx.prompt(question=question, passage=passage), max_tokens=1, logprobs=True, top_logprobs=10)
        return option_probabilities(reply, {"yes": ("yes",), "no": ("no",)}).get("yes", 0.0)

    return llm.map(judge, passages)


def _pairwise(question: str, passages: list[Passage], params: Params, ctx: StepContext,
              llm: LLMClient) -> list[float]:
    """PRP: all pairs scored by their summed preferences, or bubble passes from the bottom that
    settle the top ``passes`` places; every comparison is asked as (A, B) and as (B, A)."""

    def ask(pair: tuple[int, int]) -> float | None:
        shown = [passages[pair[0]], passages[pair[1]]]
        reply = llm.chat(ctx.prompt(question=question, passages=shown), max_tokens=4, logprobs=True, top_logprobs=10)
        return first_choice(reply)

    if len(passages) < 2:
        return [1.0] * len(passages)
    if params.pairing == "all_pairs":
        ordered = list(permutations(range(len(passages)), 2))
        answers = dict(zip(ordered, llm.map(ask, ordered)))
        wins = [0.0] * len(passages)
        for i, j in ordered:
            if i < j:
                prefer = _preference(answers[(i, j)], answers[(j, i)], i, j)
                wins[i] += prefer
                wins[j] += 1.0 - prefer
        return [w / (len(passages) - 1) for w in wins]
    order = list(range(len(passages)))
    for settled in range(min(params.passes, len(passages) - 1)):
        for place in range(len(passages) - 1, settled, -1):
            upper, lower = order[place - 1], order[place]
            forward, backward = llm.map(ask, [(lower, upper), (upper, lower)])
            if _preference(forward, backward, lower, upper) > 0.5:
                order[place - 1], order[place] = lower, upper
    return _by_rank(order)


def _preference(forward: float | None, backward: float | None, i: int, j: int) -> float:
    """P(passage i beats j) from P(A) with i shown first and P(A) with j shown first: the mean of
    the two orders, so a model that always says A gives 0.5; an unreadable order is left out."""
    readings = [p for p in (forward, None if backward is None else 1.0 - backward) if p is not None]
    if not readings:
        log.warning("pairwise comparison of candidates %d and %d unreadable in both orders; counted as a tie",
                    i + 1, j + 1)
        return 0.5
    return sum(readings) / len(readings)


_LABEL = re.compile(r"^\W*(?:(?i:passage|document)\s+)?([AB])(?![A-Za-z])")
_TOKEN_JUNK = " \t\n*()[]\"'.:,"


def first_choice(reply: Completion, min_mass: float = 0.1) -> float | None:
    """P(A) normalised over A and B, from the first answer token whose top logprobs give the two
    at least ``min_mass`` together (so "Document A" is read at its second token); else from the
    text ("A", "B.", "Document B"); None (logged) when neither says."""
    for token in reply.tokens[:4]:
        mass = {"A": 0.0, "B": 0.0}
        for text, logprob in (token.top or {token.token: token.logprob}).items():
            label = text.strip(_TOKEN_JUNK)
            if label in mass:
                mass[label] += math.exp(logprob)
        if sum(mass.values()) >= min_mass:
            return mass["A"] / (mass["A"] + mass["B"])
    match = _LABEL.match(reply.text.strip())
    if match:
        return float(match.group(1) == "A")
    log.warning("could not read A or B from the LLM's pairwise reply %r", reply.text[:120])
    return None
