"""Request rewriting (RETA-LLM and the RAG literature): conversational rewrite, multi-query
(RAG-fusion), HyDE (with ``keyword``, query2doc: its pseudo-document also expands the BM25 query),
decomposition, and separating an answer-format instruction from the search."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources.llm_output import clip, parse_json, parse_lines
from ragline.flows.spec.registry import stage
from ragline.flows.resources.llm import LLMClient

Mode = Literal["conversational", "multi_query", "hyde", "decompose", "instruction"]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: the query passes unchanged (a query2doc step `ragline tune` "
                                            "turns on or off)")
    mode: Mode = Field("conversational", description="which rewrite this step performs")
    n: int = Field(3, ge=1, le=10, description="multi_query: variants; decompose: at most this many sub-questions")
    include_original: bool = Field(True, description="also search with the request itself")
    max_tokens: int = Field(128, ge=8, le=2048, description="length of the LLM's reply")
    max_request_chars: int = Field(2000, ge=100, description="longer requests are clipped inside the prompt")
    history_turns: int = Field(6, ge=1, description="conversational: turns of history shown to the LLM (after "
                                                    "recall_history: the turns it chose instead)")
    keyword: bool = Field(False, description="hyde: also append the pseudo-document to the BM25 query (query2doc)")
    query_repeats: int = Field(5, ge=1, le=20, description="hyde with keyword: times the request opens the BM25 "
                                                          "query, so its own terms outweigh the pseudo-document's")

    @model_validator(mode="after")
    def _keyword_needs_hyde(self) -> "Params":
        if self.keyword and self.mode != "hyde":
            raise ValueError(f"keyword (query2doc) appends the HyDE pseudo-document; mode is {self.mode!r}, "
                             f"not 'hyde'")
        return self


@stage("rewrite", params=Params, produces="query", kind="query", uses={"llm": ("openai_compatible",)},
       prompt=lambda p: f"rewrite_{p.mode}",
       prompt_variables=lambda p: ("question", "history") if p.mode == "conversational" else ("question", "n"))
def rewrite(query: Query, params: Params, ctx: StepContext, llm: LLMClient) -> Query:
    """Rewrite the request for retrieval; the result says what to search and how to answer."""
    if not params.enabled:
        return query
    query = query if query.original else query.model_copy(update={"original": query.text})
    question = clip(query.text, params.max_request_chars)
    if params.mode == "conversational":
        return _conversational(query, question, params, ctx, llm)
    reply = llm.chat(ctx.prompt(question=question, n=params.n), max_tokens=params.max_tokens).text
    if params.mode in ("multi_query", "decompose"):
        found = [q for q in parse_lines(reply, params.n) if q.lower() != query.text.lower()]
        variants = ([query.text] if params.include_original else []) + found
        return query.model_copy(update={"variants": variants or [query.text]})
    if params.mode == "hyde":
        document = reply.strip()
        keyword = [query2doc(t, document, params.query_repeats) for t in query.search_texts()] \
            if params.keyword and document else []
        return query.model_copy(update={"hypothetical": [document] if document else [],
                                        "hyde_only": not params.include_original, "keyword_texts": keyword})
    return _instruction(query, reply, ctx)


def query2doc(text: str, document: str, repeats: int) -> str:
    """Query2doc's sparse query (Wang et al., 2023): the request ``repeats`` times, then the pseudo-document."""
    return " ".join([text] * repeats + [document])


def _conversational(query: Query, question: str, params: Params, ctx: StepContext, llm: LLMClient) -> Query:
    """'How about the School of Economics?' after a question on another school becomes a full request.
    The conversation a recall_history step chose, when one ran; else the last ``history_turns`` messages."""
    turns = query.conversation if query.conversation is not None else query.history[-params.history_turns:]
    if not turns:
        return query
    history = [{"role": t.get("role", "user"), "content": clip(t.get("content", ""), params.max_request_chars)}
               for t in turns]
    reply = llm.chat(ctx.prompt(question=question, history=history), max_tokens=params.max_tokens).text
    rewritten = next(iter(parse_lines(reply, 1)), "")
    if not rewritten:
        ctx.logger.warning("empty conversational rewrite; searching with the request as written")
        return query
    return query.model_copy(update={"text": rewritten})


def _instruction(query: Query, reply: str, ctx: StepContext) -> Query:
    """Split {"search": ..., "format": ...}; a reply that is not that JSON falls back to
    'SEARCH: ... / FORMAT: ...' lines, and then to the request unchanged (logged)."""
    parsed = parse_json(reply, None)
    if isinstance(parsed, dict) and str(parsed.get("search", "")).strip():
        search, instruction = str(parsed["search"]).strip(), str(parsed.get("format") or "").strip()
    else:
        found = re.search(r"search\s*:\s*(.+)", reply, re.I)
        fmt = re.search(r"format\s*:\s*(.+)", reply, re.I)
        if not found:
            ctx.logger.warning("the LLM did not separate search and format (%r); unchanged", reply[:120])
            return query
        search, instruction = found.group(1).strip(), fmt.group(1).strip() if fmt else ""
    instruction = "" if instruction.upper().startswith("NONE") else instruction
    return query.model_copy(update={"text": search, "instruction": query.instruction or instruction})
