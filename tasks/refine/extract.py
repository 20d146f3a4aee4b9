"""RETA-LLM passage extraction: the LLM copies the fragments relevant to the request, window by window."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.llm_output import clip, sentences
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import LLMClient


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window: int = Field(512, ge=32, description="tokens of passage per LLM call (generator's tokenizer)")
    step: int = Field(256, ge=16, description="tokens between window starts")
    max_tokens: int = Field(256, ge=8, description="length of each extraction")

    @model_validator(mode="after")
    def _step_within_window(self) -> "Params":
        if self.step > self.window:
            raise ValueError(f"step ({self.step}) must not exceed window ({self.window})")
        return self


@stage("refine_extract", params=Params, produces="passages", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="refine_extract", prompt_variables=("question", "window"))
def refine_extract(query: Query, passages: list[Passage], params: Params, ctx: StepContext,
                   llm: LLMClient) -> list[Passage]:
    """Keep only what the LLM extracts from each passage; a passage with nothing relevant is dropped."""
    question = clip(query.text, 1000)

    def refine(passage: Passage) -> Passage | None:
        pieces = []
        for window in windows(passage.text, params, llm):
            reply = llm.chat(ctx.prompt(question=question, window=window), max_tokens=params.max_tokens).text.strip()
            if reply and not reply.upper().startswith("NONE") and reply not in pieces:
                pieces.append(reply)
        if not pieces:
            return None
        return passage.model_copy(update={"text": "\n".join(pieces), "original_text": passage.text})

    refined = llm.map(refine, passages)
    dropped = sum(r is None for r in refined)
    if dropped:
        ctx.logger.info("dropped %d passages with nothing relevant", dropped)
    return [r for r in refined if r is not None]


def windows(text: str, params: Params, llm: LLMClient) -> list[str]:
    """Sentence-aligned windows of about ``window`` tokens starting every ``step`` tokens."""
    parts = sentences(text)
    counts = llm.count_tokens(parts)
    if sum(counts) <= params.window:
        return [text]
    result, start = [], 0
    while start < len(parts):
        end, used = start, 0
        while end < len(parts) and (used + counts[end] <= params.window or end == start):
            used += counts[end]
            end += 1
        result.append(" ".join(parts[start:end]))
        if end >= len(parts):
            break
        advanced, next_start = 0, start
        while next_start < end - 1 and advanced + counts[next_start] <= params.step:
            advanced += counts[next_start]
            next_start += 1
        start = max(next_start, start + 1)
    return result
