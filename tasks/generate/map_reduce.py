"""Map-reduce generation ("one document at a time, then combine"): the LLM first notes what each
inserted document says about the question, one call per document, then answers from the notes.

For questions whose answer is spread over more documents than one prompt reads well: each map call
sees one document, and the reduce call sees only the notes, each under its document's own number,
so a citation [n] names the inserted document it came from and ``verify`` checks it as usual.
"""
from __future__ import annotations

import re

from pydantic import Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, ContextDocument, Query
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, strip_markup
from ragline.flows.spec.registry import stage
from ragline.tasks.generate.generate import Params as GenerateParams
from ragline.tasks.generate.generate import answer_from, complete, conversation, refusal, system_message, system_templates, \
    with_system
from ragline.tasks.refine.notes import ask_each_passage

_NOTHING_REPLY = re.compile(r"^\W*nothing relevant\b", re.IGNORECASE)  # what map_passage asks for
_SCORE = re.compile(r"[\s(*_]*\bscore\W{0,4}(\d{1,3})\b[^\n]*$", re.IGNORECASE)  # map_summary's last line
UNSCORED = 50
MAP_VARIABLES = ("question", "passage")


class Params(GenerateParams):
    max_passages: int = Field(20, ge=1, le=100, description="documents read one by one (the first, in prompt "
                                                            "order); the rest are left out and logged")
    map_prompt: str = Field("map_passage", min_length=1, description="the template of each per-document call")
    map_tokens: int = Field(96, ge=8, le=1024, description="token budget of each document's note")
    max_passage_chars: int = Field(4000, ge=100, description="document text shown to each map call")
    score_notes: bool = Field(False, description="each note ends with 'Score: N' (0-100, how helpful it is, as "
                                                 "GraphRAG's global search asks): notes scored 0 are dropped and "
                                                 "the reduce call reads the best max_notes, best first; a note "
                                                 "without a score counts as 50")
    max_notes: int = Field(10, ge=1, le=100, description="with score_notes: the notes the reduce call reads")


def _prompts(params: Params) -> dict[str, tuple[str, ...]]:
    return {params.map_prompt: MAP_VARIABLES, **system_templates(params)}


@stage("generate_map_reduce", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       prompt="reduce_notes", prompt_variables=("question", "instruction", "documents", "refusal", "conversation"),
       other_prompts=_prompts)
def generate_map_reduce(query: Query, context: Context, params: Params, ctx: StepContext,
                        llm: LLMClient) -> Answer:
    """Map: a note per document on what it says about the question ("nothing relevant" drops it);
    reduce: one cited answer from the notes, resolved against the documents the notes came from."""
    if not context.documents:
        return refusal(query, params.refusal, context.withheld or "no relevant documents were found")
    read = context.documents[: params.max_passages]
    if len(read) < len(context.documents):
        ctx.logger.info("map-reduce reads the first %d of %d documents (max_passages)", len(read),
                        len(context.documents))
    notes = _map(query, read, params, ctx, llm)
    if not notes:
        return refusal(query, params.refusal, "no document says anything about the question")
    prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), instruction=query.instruction,
                        documents=notes, refusal=params.refusal, conversation=conversation(query, params))
    completion = complete(with_system(prompt, system_message(params, ctx)), params, ctx, llm)
    noted = {d.number for d in notes}  # a number the reduce call never saw is no valid citation
    sources = Context(documents=[d for d in read if d.number in noted], tokens=context.tokens,
                      dropped=context.dropped)
    return answer_from(query, completion, sources, params.refusal,
                       min_overlap=params.min_overlap if params.attribute else None)


def _map(query: Query, documents: list[ContextDocument], params: Params, ctx: StepContext,
         llm: LLMClient) -> list[ContextDocument]:
    """Each document's note, as a document under the same number; irrelevant and failed ones left out."""
    question = clip(query.text, params.max_request_chars)
    replies = ask_each_passage(llm, [d.passage for d in documents],
                               lambda shown: ctx.prompt_for(params.map_prompt, question=question, passage=shown),
                               max_chars=params.max_passage_chars, max_tokens=params.map_tokens,
                               tolerate_failures=True)
    failed = [r for r in replies if isinstance(r, RuntimeError)]
    if failed and len(failed) == len(replies):  # the endpoint is down, not the documents irrelevant
        raise failed[0]
    notes, scores = [], []
    for document, reply in zip(documents, replies):
        if isinstance(reply, RuntimeError):
            ctx.logger.warning("document %d (%s) left out: its map call failed: %s", document.number,
                               document.passage.source_id, reply)
            continue
        note = strip_markup(reply.text).strip()
        if not note or _NOTHING_REPLY.match(note):
            continue
        score = UNSCORED
        if params.score_notes and (found := _SCORE.search(note)):
            score, note = min(int(found.group(1)), 100), note[: found.start()].strip()
            if score == 0 or not note:
                continue
        notes.append(document.model_copy(update={"passage": document.passage.model_copy(
            update={"text": note, "score": float(score) if params.score_notes else document.passage.score})}))
        scores.append(score)
    if params.score_notes:  # the most helpful first (a stable sort: ties keep the prompt order)
        order = sorted(range(len(notes)), key=lambda i: -scores[i])[: params.max_notes]
        if len(order) < len(notes):
            ctx.logger.info("reduce reads the %d best-scored of %d notes (max_notes)", len(order), len(notes))
        notes = [notes[i] for i in order]
    return notes
