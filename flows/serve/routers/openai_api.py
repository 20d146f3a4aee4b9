"""The OpenAI-compatible surface: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Each query pipeline of the file is a model (``model`` picks the pipeline). The last message is
the question (it must be the user's), earlier user/assistant messages the history; system (and
developer) messages are dropped: the pipeline's prompts and its own system prompt (``generate``'s
``system``) decide how it answers, and a caller must not override them. The stock ``openai``
client works unchanged: ragline's extras are top-level JSON fields it keeps in ``model_extra``,
``sources``, ``verification`` ({verdict, refused, reason, confidence}), ``evidence`` (the extractive
evidence answer: its sentences, their offsets in the cited passages, its sources; null without an
evidence step) and ``answered_by`` (llm, evidence or ''), on the response or, when streaming, on
the last chunk (``finish_reason: "stop"``), as RAGFlow and Perplexity do. A stream also sends the
evidence as soon as it is ready, on a chunk of its own with an empty delta, before any generated
text.

Streaming cannot take back what it sent: when verification replaces the streamed draft by the
refusal or by the evidence answer, one more content delta says so and carries the answer's text (a
client that only joins the deltas shows the withdrawal), and ``verification.replaced_by_refusal``
(or ``replaced_by_evidence``) is true. Usage figures are
estimates (~4 characters per token): one answer may take several LLM calls (rewrite, generate,
fact check), none of them billed by this server. A search pipeline answers with its passages as a
numbered list.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Source
from ragline.flows.serve.query_service import ANSWER_ID_HEADER, ERRORS, STREAM_HEADERS, ApiError, EarlyEvidence, Outcome
from ragline.flows.serve.query_service import QueryService
from ragline.flows.serve.query_service import request_id, sse
from ragline.flows.serve.query_service import estimate_tokens
from ragline.flows.serve.auth.principals import may_query, principal_of, query_collections, scope_query
from ragline.flows.resources.stores.filters import FilterError, validate

WITHDRAWN = "\n\n[Verification withdrew the text above.] "


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = Field(description="only `text` parts are read")
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = Field(False, description="send a last chunk with `usage` (and `usage: null` on the others)")


class ChatRequest(BaseModel):
    """OpenAI's request; sampling fields (temperature, max_tokens, ...) are accepted and ignored: the
    pipeline's own settings decide."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="a query pipeline of the served file (see GET /v1/models)")
    messages: list[ChatMessage] = Field(min_length=1, description="the last one is the question")
    stream: bool = False
    stream_options: StreamOptions | None = None
    filters: dict[str, Any] | None = Field(None, description="ragline extension (openai: `extra_body`): a "
                                                             "Chroma-style metadata filter")
    collections: list[str] | None = Field(None, min_length=1, description="ragline extension (openai: "
                                          "`extra_body`): the named collections to search; default: all this "
                                          "credential may query")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragline"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatCompletion(BaseModel):
    """OpenAI's ``chat.completion`` plus ragline's ``sources`` and ``verification``."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]
    sources: list[dict[str, Any]] = Field(description="the references cited (or, for search, the passages)")
    answer_id: str | None = Field(None, description="ragline: this answer's id (also the X-Answer-ID header), for "
                                                    "POST /v1/feedback")
    verification: dict[str, Any] = Field(description="verdict, refused, reason, confidence")
    evidence: dict[str, Any] | None = Field(None, description="ragline: the extractive evidence answer (text, "
                                            "spans with offsets into their sources' passages, sources); null "
                                            "without an evidence step")
    answered_by: str = Field("", description="ragline: llm (the generated text, grounded in the evidence), "
                                             "evidence (the evidence answer's text) or '' (a refusal, or no evidence)")


def openai_router(service: QueryService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    @router.get("/models", response_model=ModelList, responses=ERRORS,
                summary="The query pipelines this credential may query, as models")
    async def models(request: Request) -> dict[str, Any]:
        principal = principal_of(request)
        return {"object": "list", "data": [_card(service, name) for name, pipeline in service.queries.items()
                                           if may_query(principal, pipeline)]}

    @router.get("/models/{model}", response_model=ModelCard, responses=ERRORS, summary="One query pipeline")
    async def model(model: str, request: Request) -> Response:
        if model not in service.queries:
            return _unknown(service, model).response()
        try:
            query_collections(request, service.queries[model], None)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(_card(service, model))

    @router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS,
                 summary="Answer the last user message with a query pipeline (OpenAI-compatible)")
    async def chat(body: ChatRequest, request: Request) -> Response:
        """With `stream: true`: `chat.completion.chunk` frames (`data: {...}`): the role, then (with an
        evidence step) a chunk with an empty delta and `evidence` before any text, the text, the last
        with `finish_reason: "stop"`, `sources`, `verification`, `evidence` and `answered_by`; a usage
        chunk when `stream_options.include_usage`; then `data: [DONE]`."""
        rid = request_id(request)
        try:
            pipeline, query = _parse(service, body)
            principal = scope_query(request, pipeline, query, body.collections)
        except ApiError as exc:
            return exc.response()
        reply = Reply(body, query)
        answer_id = service.new_answer_id()
        if body.stream:
            return EventSourceResponse(_chunks(service, pipeline, query, reply, rid, answer_id, principal.id),
                                       headers={**STREAM_HEADERS, ANSWER_ID_HEADER: answer_id})
        try:
            outcome = await service.run(pipeline, query, surface="chat", answer_id=answer_id, request_id=rid,
                                        principal=principal.id)
        except Exception as exc:  # noqa: BLE001 - classified, logged, never a traceback
            return service.failure(exc, rid).response()
        return JSONResponse(reply.completion(outcome), headers={ANSWER_ID_HEADER: answer_id})

    return router


def _card(service: QueryService, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": service.started, "owned_by": "ragline"}


def _unknown(service: QueryService, model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist; models (query pipelines): "
                         f"{', '.join(service.queries) or 'none'}", param="model", code="model_not_found")


def _parse(service: QueryService, body: ChatRequest) -> tuple[Any, dict[str, Any]]:
    """The pipeline and the engine's query: the last message as the question, the rest as history."""
    if body.model not in service.queries:
        raise _unknown(service, body.model)
    last = body.messages[-1]
    if last.role != "user":
        raise ApiError(400, f"field 'messages': the last message must be the user's question, not "
                            f"'{last.role}'", param="messages", code="invalid_messages")
    question = _text(last, len(body.messages) - 1)
    if not question.strip():
        raise ApiError(400, "field 'messages': the last user message is empty", param="messages",
                       code="invalid_messages")
    service.check_question(question, f"messages[{len(body.messages) - 1}].content", 400)
    history = [{"role": m.role, "content": _text(m, i)} for i, m in enumerate(body.messages[:-1])
               if m.role in ("user", "assistant")]
    try:
        validate(body.filters)
    except FilterError as exc:
        raise ApiError(400, exc.client_message(), param=exc.field, code=exc.error_code) from None  # 400 here
    pipeline = service.pipeline(body.model, param="model", stream=body.stream and service.answers(body.model))
    return pipeline, {"text": question, "history": history, "filters": body.filters}


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise ApiError(400, f"field 'messages[{index}].content': only text parts are supported",
                       param=f"messages[{index}].content", code="unsupported_content")
    return "".join(part.text or "" for part in message.content)


class Reply:
    """The response objects of one request: same id and creation time on every chunk."""

    def __init__(self, body: ChatRequest, query: dict[str, Any]):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.prompt_tokens = sum(estimate_tokens(m["content"]) for m in query["history"]) + \
            estimate_tokens(query["text"])

    def completion(self, outcome: Outcome) -> dict[str, Any]:
        text = content(outcome)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": "stop"}],
                "usage": self.usage(text), **extras(outcome)}

    def chunk(self, delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        frame: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model}
        frame["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": finish}]
        if self.include_usage:
            frame["usage"] = None
        return sse(None, {**frame, **extra})

    def usage(self, text: str) -> dict[str, int]:
        completion = estimate_tokens(text)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def content(outcome: Outcome) -> str:
    if outcome.is_answer:
        return outcome.value.text
    lines = [f"[{n}] {p.title or p.source_id}{_page_suffix(p)}: {' '.join(p.text.split())[:300]}"
             for n, p in enumerate(outcome.value, start=1)]
    return "\n".join(lines) or "No passages found."


def _page_suffix(passage: Any) -> str:
    page = Source.of(0, passage).page
    return f", {page}" if page else ""


def extras(outcome: Outcome) -> dict[str, Any]:
    """``sources``, ``verification``, ``evidence``, ``answered_by`` and ``answer_id``: read by the
    stock client from ``model_extra``."""
    if not outcome.is_answer:
        sources = [{**Source.of(n, p).model_dump(mode="json"), "score": p.score}
                   for n, p in enumerate(outcome.value, start=1)]
        return {"sources": sources, "verification": {"verdict": None, "refused": False, "reason": "",
                                                     "confidence": None}, "evidence": None, "answered_by": "",
                "answer_id": outcome.answer_id}
    answer = outcome.answer_json()  # redacted: no server path in sources, evidence or reason
    return {"sources": [] if answer["refused"] else answer["sources"],
            "verification": {"verdict": answer["verdict"], "refused": answer["refused"], "reason": answer["reason"],
                             "confidence": answer["confidence"]}, "evidence": answer.get("evidence"),
            "answered_by": answer.get("answered_by", ""), "answer_id": outcome.answer_id}


async def _chunks(service: QueryService, pipeline: Any, query: dict[str, Any], reply: Reply,
                  rid: str, answer_id: str, principal: str) -> AsyncIterator[bytes]:
    yield reply.chunk({"role": "assistant", "content": ""})
    try:
        async for item in service.stream(pipeline, query, surface="chat", answer_id=answer_id, request_id=rid,
                                         principal=principal):
            if item is None:
                yield sse(None, None)
            elif isinstance(item, EarlyEvidence):  # before any text: the client can show it at once
                yield reply.chunk({}, evidence=item.evidence)
            elif isinstance(item, Outcome):
                for frame in _final(reply, item):
                    yield frame
            else:
                yield reply.chunk({"content": item})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, as OpenAI does
        yield sse(None, service.failure(exc, rid).body())
    yield sse(None, "[DONE]")


def _final(reply: Reply, outcome: Outcome) -> list[bytes]:
    """Whatever text the tokens did not carry, the stop chunk with the extras, the usage chunk."""
    frames, text = [], content(outcome)
    streamed = "".join(outcome.tokens)
    replaced = outcome.replaced_by_refusal() or outcome.replaced_by_evidence()
    if replaced:
        frames.append(reply.chunk({"content": WITHDRAWN + text}))
    elif not outcome.tokens:
        frames.append(reply.chunk({"content": text}))
    tail = extras(outcome)
    tail["verification"]["replaced_by_refusal"] = outcome.replaced_by_refusal()
    tail["verification"]["replaced_by_evidence"] = outcome.replaced_by_evidence()
    frames.append(reply.chunk({}, "stop", **tail))
    if reply.include_usage:
        sent = streamed + (WITHDRAWN + text if replaced else "" if outcome.tokens else text)
        frames.append(reply.chunk(None, usage=reply.usage(sent)))
    return frames
