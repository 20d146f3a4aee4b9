"""Fact check of the answer against its references, and a confidence threshold on token logprobs.

An answer the references contradict or do not support, or one generated with low confidence,
becomes the refusal text ("I cannot answer this question"), with the reason kept in the result.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flows.context import StepContext
from flows.contracts import Answer, Context, Query
from flows.llm_output import clip, option_probabilities
from flows.registry import stage
from flows.resources.llm import LLMClient
from tasks.generate import REFUSAL

Verdict = Literal["supported", "contradicted", "not_enough_information"]
OPTIONS = {"supported": ("supported",), "contradicted": ("contradicted",),
           "not_enough_information": ("insufficient", "not enough")}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fact_check: bool = Field(True, description="ask the LLM whether the references support the answer")
    reject: list[Verdict] = Field(["contradicted", "not_enough_information"],
                                  description="verdicts that turn the answer into the refusal")
    min_verdict_probability: float = Field(0.5, ge=0, le=1, description="a verdict counts above this probability")
    min_confidence: float = Field(0.0, ge=0, le=1, description="refuse below this geometric-mean token probability")
    refusal: str = Field(REFUSAL)


@stage("verify", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="fact_check")
def verify(query: Query, answer: Answer, context: Context, params: Params, ctx: StepContext,
           llm: LLMClient) -> Answer:
    """Judge the answer; keep it, or replace it by the refusal and say why."""
    if answer.refused:
        return answer
    if answer.confidence is not None and answer.confidence < params.min_confidence:
        return _refuse(answer, params, f"low confidence: {answer.confidence:.2f} < {params.min_confidence:.2f}")
    if not params.fact_check:
        return answer
    reply = llm.chat(ctx.prompt(question=clip(query.text, 1000), answer=clip(answer.text, 2000),
                                documents=context.documents), max_tokens=4, logprobs=True, top_logprobs=10)
    probabilities = option_probabilities(reply, OPTIONS)
    if not probabilities:
        ctx.logger.warning("fact check unreadable (%r); the answer is kept unverified", reply.text[:80])
        return answer
    verdict = max(probabilities, key=probabilities.get)
    checked = answer.model_copy(update={"verdict": verdict})
    if verdict in params.reject and probabilities[verdict] >= params.min_verdict_probability:
        return _refuse(checked, params, f"fact check: {verdict.replace('_', ' ')} "
                                        f"(p={probabilities[verdict]:.2f})")
    return checked


def _refuse(answer: Answer, params: Params, reason: str) -> Answer:
    return answer.model_copy(update={"refused": True, "reason": reason, "draft": answer.text,
                                     "text": params.refusal})
