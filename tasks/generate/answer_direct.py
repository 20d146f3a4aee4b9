"""A direct answer without references: the branch a ``classify`` step routes chit-chat to (no
retrieval, no citations). ``generate`` refuses without documents; this stage is how a pipeline says,
in its own branch, that a request is answered without them.

With ``reply`` set it answers with that text (no LLM: a greeting costs nothing); else the LLM
replies briefly from the ``answer_direct`` prompt, after the pipeline's system message if any.
"""
from __future__ import annotations

from pydantic import ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, strip_markup
from ragline.flows.spec.registry import stage
from ragline.tasks.generate.generate import SystemPrompt, system_message, system_templates, with_system


class Params(SystemPrompt):
    model_config = ConfigDict(extra="forbid")

    reply: str | None = Field(None, min_length=1, description="answer with this text (no LLM call)")
    max_tokens: int = Field(96, ge=1, le=2048)
    max_request_chars: int = Field(1000, ge=50, description="longer requests are clipped inside the prompt")
    max_history: int = Field(6, ge=0, le=50, description="latest chat turns shown to the LLM")


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM unless the step answers with its fixed ``reply``."""
    return {} if params.reply else {"llm": ("reply", "without `reply` the LLM answers")}


@stage("answer_direct", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       reads_roles=reads_roles,
       prompt=lambda p: None if p is not None and p.reply else "answer_direct",
       prompt_variables=("question", "history"), other_prompts=system_templates)
def answer_direct(query: Query, params: Params, ctx: StepContext, llm: LLMClient | None = None) -> Answer:
    """Answer without references: the configured reply, or the LLM's short one."""
    question = query.original or query.text
    if params.reply:
        return Answer(question=question, text=params.reply)
    if llm is None:
        raise MissingResource("answer_direct without `reply` needs an openai_compatible resource: add one and name it "
                         "in `uses`")
    prompt = ctx.prompt(question=clip(query.text, params.max_request_chars),
                        history=query.history[-params.max_history:] if params.max_history else [])
    completion = llm.chat(with_system(prompt, system_message(params, ctx)), max_tokens=params.max_tokens,
                          logprobs=True, stop=["\nUser:", "\n\n\n"])
    return Answer(question=question, text=strip_markup(completion.text).strip(), confidence=completion.mean_prob())
