"""Abstractive compression: the LLM rewrites each passage into a short summary of what it says
about the request, so more sources fit the context; each passage keeps its identity for citation."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.llm import Completion, LLMClient
from ragline.flows.resources.models.llm_output import clip, sentences, strip_markup
from ragline.flows.spec.registry import stage
from ragline.tasks.refine.notes import ask_each_passage

IRRELEVANT = "IRRELEVANT"
WORDS_PER_TOKEN = 0.75  # what the prompt asks for, so most summaries end before the token cap cuts them
_IRRELEVANT_REPLY = re.compile(rf"^\W*{IRRELEVANT}\b", re.IGNORECASE)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(96, ge=16, le=1024, description="token budget of each summary (the generator's tokens)")
    drop_irrelevant: bool = Field(True, description="remove passages the LLM says say nothing about the request")
    max_passage_chars: int = Field(4000, ge=100, description="passage text shown to the LLM")


@stage("refine_abstractive", params=Params, produces="passages", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="refine_abstractive", prompt_variables=("question", "passage", "n"))
def refine_abstractive(query: Query, passages: list[Passage], params: Params, ctx: StepContext,
                       llm: LLMClient) -> list[Passage]:
    """Replace each passage's text by the LLM's summary of it for the request (the original kept
    as ``original_text``); a failed or unusable summary keeps the original, with the reason logged."""
    question = clip(query.text, 1000)
    words = max(8, int(params.max_tokens * WORDS_PER_TOKEN))

    def compress(passage: Passage, reply: Completion | RuntimeError) -> Passage | None:
        if isinstance(reply, RuntimeError):  # the endpoint failed for this passage: the rest still get compressed
            return _kept(passage, f"the LLM failed: {reply}")
        summary = strip_markup(reply.text)
        if _IRRELEVANT_REPLY.match(summary):
            return None if params.drop_irrelevant else _kept(passage, "the LLM called it irrelevant")
        if reply.finish_reason == "length":  # cut by the budget: keep the whole sentences
            whole = sentences(summary)
            summary = " ".join(whole if whole and whole[-1].endswith((".", "!", "?")) else whole[:-1])
        if not summary:
            return _kept(passage, "the summary was empty or cut off within its first sentence")
        if len(summary) >= len(passage.text):
            return _kept(passage, "the summary was no shorter than the passage")
        return passage.model_copy(update={"text": summary, "original_text": passage.original_text or passage.text})

    def _kept(passage: Passage, reason: str) -> Passage:
        ctx.logger.warning("passage %s (%s) kept uncompressed: %s", passage.chunk_id, passage.source_id, reason)
        return passage

    replies = ask_each_passage(llm, passages, lambda shown: ctx.prompt(question=question, passage=shown, n=words),
                               max_chars=params.max_passage_chars, max_tokens=params.max_tokens,
                               tolerate_failures=True)
    refined = [compress(passage, reply) for passage, reply in zip(passages, replies)]
    dropped = sum(r is None for r in refined)
    if dropped:
        ctx.logger.info("dropped %d passages the LLM called irrelevant", dropped)
    return [r for r in refined if r is not None]
