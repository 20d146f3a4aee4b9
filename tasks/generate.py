"""Answer generation with citations [n] that map back to the inserted source documents."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, Query, Source
from ragline.flows.resources.llm_output import MarkupFilter, clip, normalize_text, parse_citations, sentences, strip_markup
from ragline.flows.spec.registry import stage
from ragline.flows.resources.llm import Completion, LLMClient

REFUSAL = "I cannot answer this question"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(256, ge=1, le=8192)
    stream: bool = Field(False, description="pass tokens to the caller as they are generated")
    refusal: str = Field(REFUSAL, description="what the model says when the references lack the answer")
    max_request_chars: int = Field(2000, ge=100, description="longer requests are clipped inside the prompt")
    attribute: bool = Field(True, description="when the model cites nothing, cite the best-overlapping "
                                              "document per sentence (marked as inferred)")
    min_overlap: float = Field(0.6, ge=0, le=1, description="share of a sentence's words a document must "
                                                             "contain to be cited for it")
    stop: list[str] = Field(["\nQuestion:", "\n\n\n"], description="end the answer where small models start "
                                                                  "inventing the next question")


@stage("generate", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="answer_with_citations", prompt_variables=("question", "instruction", "documents", "refusal"))
def generate(query: Query, context: Context, params: Params, ctx: StepContext, llm: LLMClient) -> Answer:
    """Generate from the numbered references; record token logprobs for the confidence check."""
    if not context.documents:
        return refusal(query, params.refusal, context.withheld or "no relevant documents were found")
    prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), instruction=query.instruction,
                        documents=context.documents, refusal=params.refusal)
    if params.stream:
        shown = MarkupFilter(ctx.on_token) if ctx.on_token else None  # the prompt's tags never reach a client
        completion = llm.stream(prompt, on_token=shown.feed if shown else None, max_tokens=params.max_tokens,
                                logprobs=True, stop=params.stop)
        if shown:
            shown.flush()
    else:
        completion = llm.chat(prompt, max_tokens=params.max_tokens, logprobs=True, stop=params.stop)
    return answer_from(query, completion, context, params.refusal,
                       min_overlap=params.min_overlap if params.attribute else None)


def answer_from(query: Query, completion: Completion, context: Context, refusal_text: str,
                min_overlap: float | None = None) -> Answer:
    """Citations resolved against the context; an answer that is the refusal is marked refused."""
    text = re.sub(r"^\s*answer\s*:\s*", "", strip_markup(completion.text), flags=re.I)
    inferred: list[int] = []
    if min_overlap is not None and not parse_citations(text) and not is_refusal(text, refusal_text):
        text, inferred = attribute(text, context, min_overlap)
    cited = parse_citations(text)
    documents = context.by_number()
    sources = [Source.of(n, d.passage) for n in cited if (d := documents.get(n))]
    answer = Answer(question=query.original or query.text, text=text, sources=sources, citations=cited,
                    invalid_citations=[n for n in cited if n not in documents], inferred_citations=inferred,
                    confidence=completion.mean_prob())
    if is_refusal(text, refusal_text):  # the model's own refusal: nothing is withdrawn, so no draft
        answer = answer.model_copy(update={"refused": True, "reason": "the references do not contain the answer",
                                           "text": refusal_text})
    return answer


def attribute(text: str, context: Context, min_overlap: float) -> tuple[str, list[int]]:
    """Post-hoc attribution: each sentence cites the document containing most of its words."""
    from collections import Counter

    documents = [(Counter(normalize_text(d.passage.text).split()), d.number) for d in context.documents]
    out, added = [], []
    for sentence in sentences(text):
        words = Counter(normalize_text(sentence).split())
        total = sum(words.values()) or 1
        scores = [(sum((words & doc).values()) / total, number) for doc, number in documents]
        best, number = max(scores, default=(0.0, 0))
        if best >= min_overlap:
            sentence = re.sub(r"([.!?]?)$", lambda m: f" [{number}]{m.group(1)}", sentence, count=1)
            added.append(number)
        out.append(sentence)
    return " ".join(out), list(dict.fromkeys(added))


def is_refusal(text: str, refusal_text: str) -> bool:
    normalised = " ".join(text.lower().split()).rstrip(".")
    return normalised.startswith(" ".join(refusal_text.lower().split()).rstrip("."))


def refusal(query: Query, text: str, reason: str, draft: str = "") -> Answer:
    return Answer(question=query.original or query.text, text=text, refused=True, reason=reason, draft=draft)
