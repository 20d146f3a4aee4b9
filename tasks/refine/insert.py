"""Insertion of passages into the prompt: a token budget (generator's tokenizer) and an ordering."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Context, ContextDocument, Passage
from ragline.flows.errors import MissingResource
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import LLMClient

Order = Literal["relevance", "reversed", "lost_in_the_middle"]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    order: Order = Field("relevance", description="lost_in_the_middle puts the best at both ends: 1,3,5,…,6,4,2")
    max_tokens: int = Field(1500, ge=16, description="token budget for all inserted passages")
    max_documents: int = Field(10, ge=1, le=200)
    count: Literal["llm", "words"] = Field("llm", description="how passages are counted against max_tokens: the "
                                                              "LLM's tokenizer, or words (4/3 token each: no LLM "
                                                              "is read, as in ask_extractive)")


WORD_TOKENS = 4 / 3  # tokens per word, for a budget counted without the LLM's tokenizer


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM's tokenizer only when the budget is counted with it."""
    return {"llm": ("count", "count: llm counts tokens with the LLM's tokenizer")} if params.count == "llm" else {}


@stage("insert", params=Params, produces="context", kind="query", uses={"llm": ("openai_compatible",)},
       reads_roles=reads_roles)
def insert(passages: list[Passage], params: Params, llm: LLMClient | None = None) -> Context:
    """Take passages by relevance while they fit the budget, then lay them out and number them."""
    candidates = _dedupe(passages)[: params.max_documents]
    if params.count == "llm" and llm is None:
        raise MissingResource("insert counts tokens with an openai_compatible resource: add one, or set count: words")
    counts = (llm.count_tokens([p.text for p in candidates]) if params.count == "llm"
              else [round(len(p.text.split()) * WORD_TOKENS) for p in candidates])
    chosen, used = [], 0
    for passage, tokens in zip(candidates, counts):
        if used + tokens <= params.max_tokens:
            chosen.append((passage, tokens))
            used += tokens
    laid_out = arrange(chosen, params.order)
    documents = [ContextDocument(number=i, passage=p, tokens=t) for i, (p, t) in enumerate(laid_out, start=1)]
    return Context(documents=documents, tokens=used, dropped=len(passages) - len(documents))


def arrange(items: list, order: Order) -> list:
    """Relevance-ordered items in prompt order."""
    if order == "reversed":
        return items[::-1]
    if order == "lost_in_the_middle":
        return items[0::2] + items[1::2][::-1]
    return list(items)


def _dedupe(passages: list[Passage]) -> list[Passage]:
    seen: set[str] = set()
    unique = []
    for p in passages:
        if p.chunk_id not in seen:
            seen.add(p.chunk_id)
            unique.append(p)
    return unique
