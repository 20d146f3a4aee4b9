"""Answerability gate: refuse before generation when the references do not bear on the question.

Generation is the most expensive call of a query and, with unrelated references, the one most
likely to produce a confident wrong answer. Two signals, cheapest first:

- ``similarity``: the best cosine similarity between the question and an inserted passage (the
  pipeline's embedder). It catches questions about something the collection does not cover at all;
  it cannot tell a passage *on* the topic from one that *answers* (RGB's negatives score as high
  as its positives), so its floor is set low, where pseudo-queries almost never fall.
- ``llm``: the LLM's probability that the documents contain the answer, asked with the answer
  prompt's own opening (instructions, documents, question), so vLLM's prefix cache reuses that
  prefill for the generation that follows: the check costs one output token.

A threshold of 0 turns a signal off. ``ragline tune`` sets them from pseudo-queries (no labels):
see ``tasks/tune_retrieval.py``. The refusal is the generator's own text and an empty context, so
``generate`` returns it with the gate's reason and without calling the LLM.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Context, Query
from ragline.flows.llm_output import clip, option_probabilities
from ragline.flows.registry import stage
from ragline.flows.resources.embedder import Embedder
from ragline.flows.resources.llm import LLMClient

YES_NO = {"yes": ("yes",), "no": ("no",)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_similarity: float = Field(0.0, ge=-1, le=1, description="refuse when no inserted passage is at least this "
                                                               "similar to the question (embedder cosine); 0: off")
    min_probability: float = Field(0.0, ge=0, le=1, description="refuse when the LLM gives the documents less than "
                                                               "this probability of containing the answer; 0: off")
    max_request_chars: int = Field(2000, ge=100, description="longer questions are clipped inside the prompt")


class Scores(BaseModel):
    """The gate's signals for one question and its references."""

    similarity: float | None = None
    probability: float | None = None


@stage("answerable", params=Params, produces="context", kind="query",
       uses={"embedder": ("sentence_transformer",), "llm": ("openai_compatible",)},
       prompt="answerable", prompt_variables=("question", "documents"))
def answerable(query: Query, context: Context, params: Params, ctx: StepContext, embedder: Embedder | None = None,
               llm: LLMClient | None = None) -> Context:
    """The context unchanged when the question looks answerable from it; else an empty context
    that carries the reason, so generation refuses without a call."""
    if not context.documents:
        return context
    scores = Scores()
    for threshold, resource, kind in (("min_similarity", embedder, "sentence_transformer"),
                                      ("min_probability", llm, "openai_compatible")):
        if getattr(params, threshold) > 0 and resource is None:
            raise ValueError(f"{threshold} needs a {kind} resource in the file (or set it to 0)")
    if params.min_similarity > 0:
        scores.similarity = similarity(embedder, query.text, [d.passage.text for d in context.documents])
        if scores.similarity < params.min_similarity:
            return withheld(context, scores, f"no reference is close to the question (similarity "
                                             f"{scores.similarity:.2f} < {params.min_similarity:.2f})")
    if params.min_probability > 0:
        prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), documents=context.documents)
        scores.probability = probability(llm, prompt)
        if scores.probability < params.min_probability:
            return withheld(context, scores, f"the references do not seem to contain the answer (P(answerable) "
                                             f"{scores.probability:.2f} < {params.min_probability:.2f})")
    return context.model_copy(update={"answerability": scores.model_dump()})


def similarity(embedder: Embedder, question: str, texts: list[str]) -> float:
    """The highest cosine similarity between the question and one of the texts."""
    return max_cosine(embedder.encode_queries([question])[0], embedder.encode_documents(texts))


def max_cosine(query: np.ndarray, vectors: np.ndarray) -> float:
    """The highest cosine similarity between ``query`` and one of ``vectors`` (what the gate's floor
    is compared with; the tuner places the floor with the same measure)."""
    query, vectors = np.asarray(query, dtype=np.float32), np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
    return float(np.max(vectors @ query / np.maximum(norms, 1e-12)))


def probability(llm: LLMClient, prompt: str) -> float:
    """P(yes) of a yes/no question, from the first token's top logprobs (one output token)."""
    reply = llm.chat(prompt, max_tokens=1, logprobs=True, top_logprobs=10)
    return option_probabilities(reply, YES_NO).get("yes", 0.0)


def withheld(context: Context, scores: Scores, reason: str) -> Context:
    return Context(documents=[], tokens=0, dropped=len(context.documents) + context.dropped,
                   withheld=reason, answerability=scores.model_dump())
