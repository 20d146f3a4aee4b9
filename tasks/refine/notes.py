"""Chain-of-note: a note per passage saying whether it answers, gives context, or is irrelevant."""
from __future__ import annotations

from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.llm import Completion, LLMClient
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.spec.registry import stage

LABELS = ("ANSWERS", "CONTEXT", "IRRELEVANT")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drop_irrelevant: bool = Field(True, description="remove passages the note calls irrelevant")
    max_tokens: int = Field(64, ge=8, le=512)
    max_passage_chars: int = Field(1500, ge=100)


@stage("refine_notes", params=Params, produces="passages", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="refine_notes", prompt_variables=("question", "passage"))
def refine_notes(query: Query, passages: list[Passage], params: Params, ctx: StepContext,
                 llm: LLMClient) -> list[Passage]:
    """Attach a note to each passage; passages that answer come first, irrelevant ones go."""
    question = clip(query.text, 1000)
    replies = ask_each_passage(llm, passages, lambda shown: ctx.prompt(question=question, passage=shown),
                               max_chars=params.max_passage_chars, max_tokens=params.max_tokens)
    kept = []
    for i, (passage, reply) in enumerate(zip(passages, replies)):
        text = reply.text.strip()
        label = next((lab for lab in LABELS if text.upper().startswith(lab)), "CONTEXT")
        if not (params.drop_irrelevant and label == "IRRELEVANT"):
            kept.append((LABELS.index(label), i, passage.model_copy(update={"note": text})))
    return [p for _, _, p in sorted(kept, key=lambda item: (item[0], item[1]))]


def ask_each_passage(llm: LLMClient, passages: list[Passage], render: Callable[[Passage], str], *,
                     max_chars: int, max_tokens: int, tolerate_failures: bool = False) -> list:
    """One LLM call per passage (its text clipped to ``max_chars``), in order, on the LLM resource's
    own concurrency lanes: what chain-of-note, abstractive compression and map-reduce share. A failed
    call fails the step, or with ``tolerate_failures`` comes back as its error (a RuntimeError in
    place of the Completion), so the other passages still count."""

    def ask(passage: Passage) -> Completion | RuntimeError:
        shown = passage.model_copy(update={"text": clip(passage.text, max_chars)})
        try:
            return llm.chat(render(shown), max_tokens=max_tokens)
        except RuntimeError as exc:
            if not tolerate_failures:
                raise
            return exc

    return llm.map(ask, passages)
