"""LLM reranking: pointwise yes/no relevance from token logprobs, or a listwise permutation of the top few."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.llm_output import clip, option_probabilities, parse_permutation
from ragline.flows.spec.registry import stage
from ragline.flows.resources.llm import LLMClient
from ragline.tasks.rerank import BlendParams, blend


class Params(BlendParams):
    method: Literal["pointwise", "listwise"] = "pointwise"
    candidates: int = Field(10, ge=1, le=100, description="top passages the LLM judges (listwise: a few)")
    max_passage_chars: int = Field(1500, ge=100, description="passage text shown to the LLM")


@stage("rerank_llm", params=Params, produces="passages", kind="query", uses={"llm": ("openai_compatible",)},
       prompt=lambda p: f"rerank_{p.method}",
       prompt_variables=lambda p: ("question", "passage") if p.method == "pointwise" else ("question", "passages"))
def rerank_llm(query: Query, passages: list[Passage], params: Params, ctx: StepContext,
               llm: LLMClient) -> list[Passage]:
    """Reorder the top candidates by the LLM's judgement; the rest follow in retrieval order."""
    pool, rest = passages[: params.candidates], passages[params.candidates:]
    shown = [p.model_copy(update={"text": clip(p.text, params.max_passage_chars)}) for p in pool]
    question = clip(query.text, 1000)
    if params.method == "pointwise":
        relevance = _pointwise(question, shown, ctx, llm)
    else:
        order = parse_permutation(llm.chat(ctx.prompt(question=question, passages=shown), max_tokens=64).text,
                                  len(pool), "listwise ranking")
        relevance = [0.0] * len(pool)
        for rank, index in enumerate(order):
            relevance[index] = 1.0 - rank / max(1, len(pool))
    return (blend(pool, relevance, params) + rest)[: params.top_k]


def _pointwise(question: str, passages: list[Passage], ctx: StepContext, llm: LLMClient) -> list[float]:
    """P(Yes) for each passage, asked concurrently (the client caps requests in flight)."""

    def judge(passage: Passage) -> float:
        reply = llm.chat(ctx.prompt(question=question, passage=passage), max_tokens=1, logprobs=True, top_logprobs=10)
        return option_probabilities(reply, {"yes": ("yes",), "no": ("no",)}).get("yes", 0.0)

    return llm.map(judge, passages)
