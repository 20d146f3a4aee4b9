"""Answer generation with citations [n] that map back to the inserted source documents."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, EvidenceAnswer, Query, Source
from ragline.flows.resources.models.llm_output import MarkupFilter, clip, normalize_text, parse_citations, sentences, strip_markup
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import Completion, LLMClient, LLMUnavailable
from ragline.tasks.retrieve.examples import Example

REFUSAL = "I cannot answer this question"
SYSTEM_VARIABLES = ("pipeline",)  # what every system template may read, besides `system_variables`


class SystemPrompt(BaseModel):
    """The operator's instructions (tone, persona, language), sent as the system message. Rendered
    from the pipeline's own values only: no request text reaches it, and a client's system messages
    are dropped before the pipeline runs (flows/serve/routers/openai_api.py), so a caller cannot replace it."""

    system: str | None = Field(None, min_length=1, description="the system message, as written")
    system_prompt: str | None = Field(None, min_length=1, description="a template in prompts/ (name without .j2) "
                                                                      "rendered as the system message")
    system_variables: dict[str, str] = Field(default_factory=dict, description="values the system template "
                                                                               "reads, besides `pipeline`")

    @field_validator("system_variables")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [k for k in value if not k.isidentifier() or k in SYSTEM_VARIABLES]
        if bad:
            raise ValueError(f"not usable as a template variable: {', '.join(map(repr, bad))}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> SystemPrompt:
        if self.system and self.system_prompt:
            raise ValueError("give `system` (text) or `system_prompt` (a template), not both")
        if self.system_variables and not self.system_prompt:
            raise ValueError("`system_variables` are read by a `system_prompt` template; none is named")
        return self


def system_templates(params: SystemPrompt) -> dict[str, tuple[str, ...]]:
    """The system template a step renders, with its variables (checked by `ragline validate`)."""
    return {params.system_prompt: (*SYSTEM_VARIABLES, *params.system_variables)} if params.system_prompt else {}


def system_message(params: SystemPrompt, ctx: StepContext) -> str | None:
    if params.system_prompt:
        return ctx.prompt_for(params.system_prompt, pipeline=ctx.pipeline, **params.system_variables)
    return params.system


def with_system(prompt: str, system: str | None) -> str | list[dict[str, str]]:
    """The user prompt, preceded by the pipeline's system message when it has one."""
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}] if system else prompt


class Params(SystemPrompt):
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
    history_turns: int = Field(0, ge=0, le=100, description="without a recall_history step: the last messages "
                                                            "of the history shown before the question (0: none)")
    max_conversation_chars: int = Field(4000, ge=100, description="bound of the conversation shown: its oldest "
                                                                   "messages are left out beyond it")


@stage("generate", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="answer_with_citations",
       prompt_variables=("question", "instruction", "documents", "refusal", "examples", "conversation"),
       other_prompts=system_templates)
def generate(query: Query, context: Context, params: Params, ctx: StepContext, llm: LLMClient,
             examples: list[Example] | None = None, evidence: EvidenceAnswer | None = None) -> Answer:
    """Generate from the numbered references (after worked examples, when a step retrieved them);
    record token logprobs for the confidence check. After an evidence step (``extract_answer``):
    no call where the evidence refuses (the answer could not be grounded in it), and an LLM that
    fails or times out is a refusal with its reason, which ``verify`` replaces by the evidence."""
    if not context.documents:
        return refusal(query, params.refusal, context.withheld or "no relevant documents were found")
    if evidence is not None and evidence.refused:
        return refusal(query, params.refusal, f"the evidence refuses: {evidence.reason}")
    prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), instruction=query.instruction,
                        documents=context.documents, refusal=params.refusal, examples=examples or [],
                        conversation=conversation(query, params))
    try:
        completion = complete(with_system(prompt, system_message(params, ctx)), params, ctx, llm)
    except LLMUnavailable as exc:
        if evidence is None:
            raise
        ctx.logger.warning("generation failed (%s); the evidence answer stands", exc)
        return refusal(query, params.refusal, f"the LLM failed: {exc}")
    return answer_from(query, completion, context, params.refusal,
                       min_overlap=params.min_overlap if params.attribute else None)


def conversation(query: Query, params: Params) -> list[dict[str, str]]:
    """The chat turns shown before the question: those recall_history chose, else the last
    ``history_turns`` messages; the newest that fit ``max_conversation_chars``, each clipped."""
    turns = query.conversation if query.conversation is not None else \
        query.history[-params.history_turns:] if params.history_turns else []
    shown: list[dict[str, str]] = []
    left = params.max_conversation_chars
    for turn in reversed(turns):
        content = clip(str(turn.get("content", "")), params.max_request_chars)
        if turn.get("role") not in ("user", "assistant") or not content.strip():
            continue
        if len(content) > left:
            break
        shown.append({"role": turn["role"], "content": content})
        left -= len(content)
    return shown[::-1]


def complete(messages: str | list[dict[str, str]], params: Params, ctx: StepContext, llm: LLMClient) -> Completion:
    """The answer call, with token logprobs: streamed to the caller when asked (the prompt's tags
    filtered out), else in one piece."""
    if not params.stream:
        return llm.chat(messages, max_tokens=params.max_tokens, logprobs=True, stop=params.stop)
    shown = MarkupFilter(ctx.on_token) if ctx.on_token else None  # the prompt's tags never reach a client
    completion = llm.stream(messages, on_token=shown.feed if shown else None, max_tokens=params.max_tokens,
                            logprobs=True, stop=params.stop)
    if shown:
        shown.flush()
    return completion


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
