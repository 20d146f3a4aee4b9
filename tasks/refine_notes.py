"""Chain-of-note: a note per passage saying whether it answers, gives context, or is irrelevant."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.llm_output import clip
from ragline.flows.spec.registry import stage
from ragline.flows.resources.llm import LLMClient

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

    def note(passage: Passage) -> tuple[str, str]:
        shown = passage.model_copy(update={"text": clip(passage.text, params.max_passage_chars)})
        reply = llm.chat(ctx.prompt(question=question, passage=shown), max_tokens=params.max_tokens).text.strip()
        label = next((lab for lab in LABELS if reply.upper().startswith(lab)), "CONTEXT")
        return label, reply

    notes = llm.map(note, passages)
    kept = [(LABELS.index(label), i, p.model_copy(update={"note": text}))
            for i, (p, (label, text)) in enumerate(zip(passages, notes))
            if not (params.drop_irrelevant and label == "IRRELEVANT")]
    return [p for _, _, p in sorted(kept, key=lambda item: (item[0], item[1]))]
