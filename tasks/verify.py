"""Fact check of the answer against its references, and a confidence threshold on token logprobs.

An answer the references contradict or do not support, or one generated with low confidence,
becomes the refusal text ("I cannot answer this question"), with the reason kept in the result.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, Query
from ragline.flows.llm_output import clip, normalize_text, option_probabilities, strip_citations
from ragline.flows.registry import stage
from ragline.flows.resources.llm import LLMClient
from ragline.tasks.generate import REFUSAL

Verdict = Literal["supported", "contradicted", "not_enough_information"]
OPTIONS = {"supported": ("supported",), "contradicted": ("contradicted",),
           "not_enough_information": ("insufficient", "not enough")}


YES_NO = {"yes": ("yes",), "no": ("no",)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fact_check: bool = Field(True, description="ask the LLM whether the references support the answer")
    method: Literal["binary", "three_way"] = Field(
        "binary", description="binary: 'supported?' then 'contradicted?' as yes/no questions (robust with small "
                              "models); three_way: one SUPPORTED/CONTRADICTED/INSUFFICIENT question")
    support_threshold: float = Field(0.5, ge=0, le=1, description="binary: P(yes) at which the answer is supported")
    reject: list[Verdict] = Field(["contradicted", "not_enough_information"],
                                  description="verdicts that turn the answer into the refusal")
    min_verdict_probability: float = Field(0.5, ge=0, le=1, description="a verdict counts above this probability")
    min_confidence: float = Field(0.0, ge=0, le=1, description="refuse below this geometric-mean token probability")
    min_grounding: float = Field(0.0, ge=0, le=1, description="refuse when fewer of the answer's own content words "
                                                              "(those not in the question) occur in the references")
    refusal: str = Field(REFUSAL)


@stage("verify", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       prompt=lambda p: "fact_check_support" if p.method == "binary" else "fact_check",
       prompt_variables=("question", "answer", "documents"),
       other_prompts=lambda p: ({"fact_check_contradict": ("question", "answer", "documents")}
                                if p.method == "binary" else {}))
def verify(query: Query, answer: Answer, context: Context, params: Params, ctx: StepContext,
           llm: LLMClient) -> Answer:
    """Judge the answer; keep it, or replace it by the refusal and say why."""
    if answer.refused:
        return answer
    if answer.confidence is not None and answer.confidence < params.min_confidence:
        return _refuse(answer, params, f"low confidence: {answer.confidence:.2f} < {params.min_confidence:.2f}")
    if params.min_grounding > 0:
        found, total = grounding(answer.text, query.text, context)
        if total and found / total < params.min_grounding:
            return _refuse(answer, params, f"not grounded in the references: {found} of {total} answer words found")
    if not params.fact_check:
        return answer
    variables = {"question": clip(query.text, 1000), "answer": clip(answer.text, 2000),
                 "documents": context.documents}
    probabilities = (_binary(variables, params, ctx, llm) if params.method == "binary"
                     else _ask(ctx.prompt(**variables), OPTIONS, llm))
    if not probabilities:
        ctx.logger.warning("fact check unreadable; the answer is kept unverified")
        return answer
    verdict = max(probabilities, key=probabilities.get)
    checked = answer.model_copy(update={"verdict": verdict})
    if verdict in params.reject and probabilities[verdict] >= params.min_verdict_probability:
        return _refuse(checked, params, f"fact check: {verdict.replace('_', ' ')} "
                                        f"(p={probabilities[verdict]:.2f})")
    return checked


STOPWORDS = frozenset("""a an the of in on at to for is was were are be been being by with and or as it its this that
these those from which who whom what when where why how did does do not no i you he she they we there here answer
question documents document according reference references yes true false correct incorrect""".split())
# (a yes/no verdict is the answer to a yes/no question, not a fabricated fact the references should hold)


def grounding(answer: str, question: str, context: Context) -> tuple[int, int]:
    """(found, total): the answer's content words that are not in the question, and how many of
    them occur in the references. A fabricated name or number is rarely in the references."""
    asked = set(normalize_text(question).split())
    words = [w for w in normalize_text(strip_citations(answer)).split() if w not in STOPWORDS and w not in asked]
    known = set(normalize_text(" ".join(d.passage.text for d in context.documents)).split())
    return sum(w in known for w in words), len(words)


def _ask(prompt: str, options: dict[str, tuple[str, ...]], llm: LLMClient) -> dict[str, float]:
    return option_probabilities(llm.chat(prompt, max_tokens=2, logprobs=True, top_logprobs=10), options)


def _binary(variables: dict, params: Params, ctx: StepContext, llm: LLMClient) -> dict[str, float]:
    """Two yes/no questions; the verdict's probability is the answer to the deciding one."""
    support = _ask(ctx.prompt(**variables), YES_NO, llm)
    if not support:
        return {}
    p_support = support["yes"]
    if p_support >= params.support_threshold:
        return {"supported": p_support}
    contradict = _ask(ctx.prompt_for("fact_check_contradict", **variables), YES_NO, llm)
    p_contradict = contradict.get("yes", 0.0)
    return {"contradicted": p_contradict} if p_contradict >= 0.5 else {"not_enough_information": 1 - p_contradict}


def _refuse(answer: Answer, params: Params, reason: str) -> Answer:
    return answer.model_copy(update={"refused": True, "reason": reason, "draft": answer.text,
                                     "text": params.refusal})
