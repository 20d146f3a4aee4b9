"""MCP (issue 36): a served project's collections as tools for the agents and editors people use.

The official ``mcp`` SDK (``MCPServer``), two transports over one server definition:

- streamable HTTP at ``/mcp`` of ``ragline api`` and ``ragline serve`` (``create_app`` mounts it): behind
  the same guard as ``/v1`` (API keys, OIDC bearer tokens, the legacy token; 401 before the body is
  read; the body limit and JSON checks), each call answering as the principal of the request that
  carried it, and a session usable only with the credential that opened it (the SDK's session owner);
- stdio (``ragline mcp``) for desktop clients that start a local process: the local operator, who reads
  every collection and document, and says so (``instructions``, ``list_collections``).

Tools: ``search``, ``ask``, ``list_collections``, ``get_passage``, ``list_documents``; resources
``ragline://<collection>/<source>``. ``search`` and ``ask`` build a ``QueryRequest`` (its validators),
scope it with ``principals.scope_query`` and run it on the ``QueryService``, as ``/v1/query`` does:
collection scopes and document ACLs are applied by the code every surface shares, and results are
the redacted JSON ``/v1/query`` returns (``Outcome``), reduced to what an agent needs. Everything else
reads the index state within the caller's rights (``access.readable`` on every chunk): what a
principal may not read is never found, and a refusal does not say whether it exists.

``ask`` reports progress (retrieved, evidence ready with the evidence answer's text, generating) when
the client sends a progress token; a client's cancellation stops a generating run at its next token.
"""
import asyncio
import concurrent.futures
import io
import json
import os
import threading
import types
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote, unquote

import anyio
import mcp_types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel, Field, ValidationError

from ragline.flows import settings
from ragline.flows.access import readable
from ragline.flows.contracts import EvidenceAnswer, page_label
from ragline.flows.errors import InputError
from ragline.flows.resources import close_resources
from ragline.flows.run.check import indexes
from ragline.flows.serve.routers.catalog import collection_info
from ragline.flows.serve.routers.documents import catalogue
from ragline.flows.serve.auth.guard import BodyProblem, check_json
from ragline.flows.serve.auth.principals import (
    LOCAL,
    Principal,
    collections_of,
    principal_of,
    reading_groups,
    scope_query,
)
from ragline.flows.serve.query_service import ApiError, Outcome, QueryRequest, QueryService, access_for
from ragline.flows.spec.compile import load_project

MCP_PATH = "/mcp"
SCHEME = "ragline"
MAX_LISTED = 1000  # documents one list_documents call or one resources/list page names
SEARCH_NAMES = {"question": "query", "top_k": "k"}  # QueryRequest's fields as the search tool names them


# ----------------------------------------------------------------------------- results
class Hit(BaseModel):
    chunk_id: str = Field(description="the passage's id (get_passage)")
    title: str
    source: str = Field(description="its document below its root ('<root>/<path>') or its public URL; never a "
                                    "server path")
    page: str = Field("", description="'p. 3' or 'pp. 3-4' in paged formats (PDF, slides), else ''")
    score: float = Field(0.0, description="the pipeline's score (higher is better; comparable within one call)")
    collection: str = Field(description="the collection it came from")
    uri: str = Field(description="its document as a resource: ragline://<collection>/<source id>")
    text: str


class SearchResult(BaseModel):
    pipeline: str
    passages: list[Hit] = Field(description="best first")


class Citation(BaseModel):
    number: int = Field(description="the [n] the answer cites it by")
    chunk_id: str
    title: str
    source: str
    page: str = ""
    collection: str
    uri: str
    passage: str = Field(description="the cited passage's text")


class Evidence(BaseModel):
    text: str = Field(description="the sentence(s) of the references that answer, each followed by its [n]")
    refused: bool
    reason: str = Field("", description="why it refuses")
    confidence: float
    citations: list[int]
    spans: list[dict[str, Any]] = Field(description="the cited sentences with their offsets in the cited passage")


class AskResult(BaseModel):
    pipeline: str
    answer_id: str | None = Field(None, description="rate it with POST /v1/feedback")
    answer: str = Field(description="the answer with [n] citations, or the refusal text")
    refused: bool
    reason: str = Field("", description="why it refused, or why the generated answer was replaced")
    answered_by: str = Field("", description="llm (grounded in the evidence), evidence, or '' (a refusal)")
    citations: list[Citation]
    evidence: Evidence | None = Field(None, description="the evidence the answer rests on (pipelines with an "
                                                        "extract_answer step)")


class CollectionEntry(BaseModel):
    name: str
    description: str = ""
    documents: int
    chunks: int


class CollectionsResult(BaseModel):
    caller: str = Field(description="who this server takes the caller to be, and what it reads")
    collections: list[CollectionEntry]


class DocumentEntry(BaseModel):
    source: str = Field(description="the document's source id ('<root>/<path>')")
    collection: str
    uri: str
    status: str = Field(description="indexed, queued, failed or deleting")
    chunks: int = 0
    updated: str | None = None
    reason: str | None = Field(None, description="why it failed")


class DocumentsResult(BaseModel):
    documents: list[DocumentEntry]
    truncated: bool = Field(description=f"more documents than listed (at most {MAX_LISTED}): name a collection")


# ----------------------------------------------------------------------------- collections and callers
@dataclass(frozen=True)
class Shelf:
    """A collection as MCP shows it: a named collection, or the index of a file without them (named
    after its Chroma collection); the ingestion pipeline that writes it and its index state."""

    name: str
    pipeline: str
    state: str
    description: str = ""


def shelves(project: Any) -> dict[str, Shelf]:
    specs = project.spec.resources
    if project.collections:
        return {c.name: Shelf(c.name, c.pipeline, next(own for own in c.resources.values()
                                                         if specs[own].type == "index_state"))
                for c in project.collections.values()}
    found = {}
    for index in indexes(project):
        name = specs[index.store].collection
        found.setdefault(name, Shelf(name, index.pipelines[0], index.state))
    return found


def operator_request(ctx: Context) -> Any:
    """stdio: the local operator (no transport to authenticate), as the CLI's queries are."""
    return types.SimpleNamespace(state=types.SimpleNamespace(principal=LOCAL, request_id=uuid.uuid4().hex[:16]))


def http_request(ctx: Context) -> Any:
    """HTTP: the request that carried this call, with the principal the guard authenticated on it."""
    request = ctx.request_context.request
    if request is None or getattr(request.state, "principal", None) is None:
        raise ToolError("no credential: send `Authorization: Bearer <API key or token>`")
    return request


def describe(principal: Principal) -> str:
    if principal.kind in ("local", "legacy-token"):
        return f"the local operator ({principal.kind}): every collection and every document"
    groups = ", ".join(sorted(principal.groups)) or "none"
    return f"{principal.id} ({principal.name or principal.kind}): its collections; documents public or of groups {groups}"


# ----------------------------------------------------------------------------- the server
class Tools:
    """What the tools share: the service, the collections, who the caller is, the defaults."""

    def __init__(self, service: QueryService, caller: Callable[[Context], Any]):
        self.service, self.caller = service, caller
        self.project = service.project
        self.shelves = shelves(self.project)
        self.documents = catalogue(self.project)
        self.homes: dict[str, str] = {}

    # -- callers and their rights
    def principal(self, ctx: Context) -> Principal:
        return principal_of(self.caller(ctx))

    def readable_shelves(self, principal: Principal, named: str | None = None, param: str = "collection"
                         ) -> list[Shelf]:
        """The collections a principal may query (all, or the one ``named``: 404 unknown, 403 not granted)."""
        if named is None:
            return [s for s in self.shelves.values() if principal.may("query", [s.name])]
        if named not in self.shelves:
            raise ApiError(404, f"field '{param}': no collection '{named[:200]}'; collections: "
                                f"{', '.join(s.name for s in self.readable_shelves(principal)) or 'none'}",
                           param=param, code="collection_not_found")
        missing = principal.missing("query", [named])
        if missing:
            raise ApiError(403, f"forbidden: this credential lacks {missing}", "permission_error", code="forbidden")
        return [self.shelves[named]]

    # -- search and ask
    def body(self, pipeline: str | None, default: str, answers: bool, **fields: Any) -> QueryRequest:
        """The request ``/v1/query`` would get, validated by the same model (errors name the tool's argument)."""
        name = pipeline or self.default_pipeline(default, answers)
        try:
            body = QueryRequest(pipeline=name, **{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(p) for p in error["loc"])
            field = SEARCH_NAMES.get(field, field) if not answers else field
            message = error["msg"].removeprefix("Value error, ")
            raise ApiError(422, f"field '{field}': {message}", param=field) from None
        self.service.pipeline(body.pipeline)  # 404/400 naming the field
        if self.service.answers(body.pipeline) != answers:
            kind = ("answers", "an answering") if not answers else ("returns passages", "a passage")
            raise ApiError(400, f"field 'pipeline': pipeline '{body.pipeline}' {kind[0]}; this tool needs "
                                f"{kind[1]} pipeline: {', '.join(self.pipelines(not answers)) or 'none'}",
                           param="pipeline")
        return body

    def pipelines(self, answers: bool) -> list[str]:
        return [name for name in self.service.queries if self.service.answers(name) == answers]

    def default_pipeline(self, configured: str, answers: bool) -> str:
        """The setting's pipeline when it fits, else the file's first that does."""
        fitting = self.pipelines(answers)
        return configured if configured in fitting else (fitting[0] if fitting else configured)

    async def run(self, ctx: Context, body: QueryRequest, progress: "Progress | None" = None) -> Outcome:
        request = self.caller(ctx)
        rid = getattr(request.state, "request_id", "-")
        pipeline = self.service.pipeline(body.pipeline, stream=progress is not None)
        query = {"text": body.question, "history": [t.model_dump() for t in body.history], "filters": body.filters}
        principal = scope_query(request, pipeline, query, body.collections)
        hooks = {} if progress is None else {"on_step": progress.on_step, "on_token": progress.on_token}
        job = asyncio.ensure_future(self.service.run(pipeline, query, surface="mcp", request_id=rid,
                                                     principal=principal.id, **hooks))
        job.add_done_callback(lambda done: done.cancelled() or done.exception())  # a cancelled call's run
        try:
            if progress is not None:
                await progress.pump(job)
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if progress is not None:
                progress.stopped.set()  # the client cancelled: the run stops at its next generated token
            raise
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified as /v1/query classifies it, never a traceback
            raise self.service.failure(exc, rid) from None

    def hit(self, passage: dict[str, Any], collection: str) -> Hit:
        meta = passage.get("metadata") or {}
        collection = str(meta.get("collection") or collection)
        return Hit(chunk_id=passage["chunk_id"], title=passage.get("title", ""),
                   source=str(meta.get("source") or passage["source_id"]),
                   page=page_label(_int(meta.get("page_start")), _int(meta.get("page_end"))),
                   score=float(passage.get("score") or 0.0), collection=collection,
                   uri=resource_uri(collection, passage["source_id"]), text=passage.get("text", ""))

    def home(self, pipeline: str) -> str:
        """The collection of a pipeline's passages that do not say theirs (a file without collections)."""
        if pipeline not in self.homes:
            names = sorted(set(self.shelves) & _read_by(self.project, pipeline))
            self.homes[pipeline] = names[0] if names else ""
        return self.homes[pipeline]

    # -- reading the index state
    def passage(self, principal: Principal, chunk_id: str) -> Hit:
        access = access_for(reading_groups(principal))
        for shelf in self.readable_shelves(principal):
            state = self.project.resource(shelf.state)
            row = state.chunks_by_id([chunk_id]).get(chunk_id) if state.exists() else None
            if row is not None and readable(row["metadata"], access):
                return self.hit({"chunk_id": chunk_id, **row}, shelf.name)
        raise ApiError(404, f"field 'chunk_id': no passage '{chunk_id[:200]}' in the collections this credential "
                            f"may read", param="chunk_id", code="passage_not_found")

    def document_text(self, principal: Principal, collection: str, source: str) -> str:
        """A document's readable chunks in order, or a 404 that does not say whether it exists."""
        shelf = self.readable_shelves(principal, collection)[0]
        state = self.project.resource(shelf.state)
        rows = state.chunks_by_id(sorted(state.chunk_ids([source]))) if state.exists() else {}
        access = access_for(reading_groups(principal))
        chunks = sorted((r for r in rows.values() if readable(r["metadata"], access)),
                        key=lambda r: (_int(r["metadata"].get("chunk")) or 0))
        if not chunks:
            raise ApiError(404, f"no document '{source[:200]}' in collection '{collection}'", code="document_not_found")
        return "\n\n".join(r["text"] for r in chunks)

    def listed(self, principal: Principal, collection: str | None) -> list[DocumentEntry]:
        reader = reading_groups(principal)
        found = []
        for shelf in self.readable_shelves(principal, collection):
            for doc in self.documents.documents(shelf.pipeline, None if reader is None else frozenset(reader)):
                found.append(DocumentEntry(source=doc.source, collection=shelf.name, status=doc.status,
                                           uri=resource_uri(shelf.name, doc.source), chunks=doc.chunks,
                                           updated=doc.updated, reason=doc.reason))
        return found


def resource_uri(collection: str, source: str) -> str:
    return f"{SCHEME}://{quote(collection, safe='')}/{quote(source, safe='/')}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_by(project: Any, pipeline: str) -> set[str]:
    return set(collections_of(project.pipeline(pipeline)))


def checked(**arguments: Any) -> None:
    """The checks the HTTP guard makes on a body, for every transport (stdio has no guard): lone
    surrogates, non-finite or 64-bit-overflowing numbers, nesting beyond the limit; names the field."""
    try:
        check_json(json.dumps(arguments).encode())
    except BodyProblem as problem:
        raise ApiError(422, problem.message, param=problem.field, code=problem.code) from None


# ----------------------------------------------------------------------------- progress
class Progress:
    """A run's step outputs and first token, handed from its threads to the loop as progress
    notifications (retrieved, evidence ready, generating); ``stopped`` makes the next token raise."""

    def __init__(self, ctx: Context, tools: Tools):
        self.ctx, self.redact = ctx, tools.service.redact
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = threading.Event()
        self.said: set[str] = set()

    def say(self, phase: str, message: str) -> None:  # from the run's threads
        if phase not in self.said:
            self.said.add(phase)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, message)

    def on_step(self, step: str, value: Any) -> None:
        if isinstance(value, EvidenceAnswer):
            shown = self.redact.evidence(value.model_dump(mode="json"))
            self.say("evidence", f"evidence ready: {shown['text']}" if not value.refused else
                     f"evidence ready: refused ({shown['reason']})")
        elif isinstance(value, list) and value:
            count = sum(len(getattr(v, "passages", None) or [v]) for v in value)
            self.say("retrieved", f"retrieved {count} passages")

    def on_token(self, piece: str) -> None:
        if self.stopped.is_set():
            raise InputError("the client cancelled the call", field="ask")
        self.say("generating", "generating the answer")

    async def pump(self, job: asyncio.Future) -> None:
        """Sends each message as it comes until the run ends (then the last ones)."""
        sent = 0
        while True:
            getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            sent += 1
            await self.ctx.report_progress(sent, None, getter.result())
        await asyncio.sleep(0)  # the run's last hand-overs are on the loop now
        while not self.queue.empty():
            sent += 1
            await self.ctx.report_progress(sent, None, self.queue.get_nowait())


# ----------------------------------------------------------------------------- tools and resources
def mcp_server(service: QueryService, caller: Callable[[Context], Any]) -> MCPServer:
    """The project's tools and resources; ``caller`` turns a call's context into the request-like
    object whose ``state.principal`` is its caller (``http_request``, ``operator_request``)."""
    tools = Tools(service, caller)
    local = caller is operator_request
    server = MCPServer(
        "ragline", title=f"ragline: {service.project.path.name}", version="1",
        instructions=_instructions(tools, local))
    read_only = mcp_types.ToolAnnotations(read_only_hint=True, open_world_hint=False)
    Collections = Annotated[list[str] | None, Field(
        min_length=1, description=f"collections to search (list_collections): "
                                        f"{', '.join(tools.shelves) or 'none'}; default all the caller may read")]

    @server.tool(annotations=read_only, description=(
        "Search the project's documents: the passages that best match `query` (hybrid BM25 + dense "
        "retrieval), best first, each with its title, source document, page, score, chunk id and text. "
        "Use it to find where something is written; use `ask` for an answer with citations."))
    async def search(
            query: Annotated[str, Field(description="what to look for: words or a question")],
            ctx: Context,
            collections: Collections = None,
            filters: Annotated[dict[str, Any] | None, Field(description='metadata filter (Chroma `where`), e.g. '
                                                            '{"format": "markdown"}')] = None,
            k: Annotated[int, Field(ge=1, le=50, description="passages to return")] = 5,
            pipeline: Annotated[str | None, Field(description=f"a search pipeline: "
                                                  f"{', '.join(tools.pipelines(False)) or 'none'}")] = None,
    ) -> SearchResult:
        async def go() -> SearchResult:
            service.check_question(query, "query", 422)
            checked(query=query, filters=filters, collections=collections)
            body = tools.body(pipeline, settings.mcp().mcp_search_pipeline, False, question=query,
                              filters=filters, collections=collections, top_k=k)
            outcome = await tools.run(ctx, body)
            home = tools.home(body.pipeline)
            return SearchResult(pipeline=body.pipeline, passages=[
                tools.hit(p, home) for p in _flat(outcome.to_json(k)["passages"])[:k]])
        return await _tool(service, go)

    @server.tool(annotations=read_only, description=(
        "Answer a question from the project's documents, with [n] citations of the passages it rests on "
        "and the evidence (the sentences that answer, exactly as written); or a refusal that says why "
        "(nothing in the documents supports an answer). Sends progress: retrieved, evidence ready (with "
        "the evidence answer), generating."))
    async def ask(
            question: Annotated[str, Field(description="the question, as the user asked it")],
            ctx: Context,
            collections: Collections = None,
            history: Annotated[list[dict[str, str]] | None, Field(description="earlier turns, oldest first: "
                               '[{"role": "user"|"assistant", "content": "..."}]')] = None,
            pipeline: Annotated[str | None, Field(description=f"an answering pipeline: "
                                                  f"{', '.join(tools.pipelines(True)) or 'none'}")] = None,
    ) -> AskResult:
        async def go() -> AskResult:
            service.check_question(question, "question", 422)
            checked(question=question, history=history, collections=collections)
            body = tools.body(pipeline, settings.mcp().mcp_ask_pipeline, True, question=question,
                              history=history, collections=collections)
            outcome = await tools.run(ctx, body, Progress(ctx, tools))
            return _answer(outcome, tools.home(body.pipeline))
        return await _tool(service, go)

    @server.tool(annotations=read_only, description=(
        "The collections (knowledge bases) the caller may search, with their description and how many "
        "documents and chunks each holds; and who the server takes the caller to be."))
    async def list_collections(ctx: Context) -> CollectionsResult:
        async def go() -> CollectionsResult:
            principal = tools.principal(ctx)
            found = await asyncio.to_thread(_collection_entries, tools, tools.readable_shelves(principal))
            return CollectionsResult(caller=describe(principal), collections=found)
        return await _tool(service, go)

    @server.tool(annotations=read_only, description=(
        "One passage by its chunk id (from search or an answer's citations): its full text, title, "
        "source, page and collection."))
    async def get_passage(chunk_id: Annotated[str, Field(min_length=1, max_length=1000)], ctx: Context) -> Hit:
        async def go() -> Hit:
            checked(chunk_id=chunk_id)
            return await asyncio.to_thread(tools.passage, tools.principal(ctx), chunk_id)
        return await _tool(service, go)

    @server.tool(annotations=read_only, description=(
        "The documents of one collection (or of all the caller may read): source, status (indexed, "
        "queued, failed), chunk count, last indexed, and the resource URI that reads the whole text."))
    async def list_documents(
            ctx: Context,
            collection: Annotated[str | None, Field(max_length=200, description="one collection (default: "
                                                    "all the caller may read)")] = None,
    ) -> DocumentsResult:
        async def go() -> DocumentsResult:
            checked(collection=collection)
            found = await asyncio.to_thread(tools.listed, tools.principal(ctx), collection)
            return DocumentsResult(documents=found[:MAX_LISTED], truncated=len(found) > MAX_LISTED)
        return await _tool(service, go)

    @server.resource(f"{SCHEME}://{{collection}}/{{+source}}", mime_type="text/plain",
                     description="A document's indexed text (its chunks in order), within the caller's rights")
    async def document(collection: str, source: str, ctx: Context) -> str:
        try:
            return await asyncio.to_thread(tools.document_text, tools.principal(ctx), unquote(collection),
                                           unquote(source))
        except ApiError as exc:
            raise (ResourceNotFoundError if exc.status == 404 else ResourceError)(exc.message) from None

    _list_resources_per_caller(server, tools)
    return server


async def _tool(service: QueryService, go: Callable) -> Any:
    """A tool's body; a failure becomes the tool's error with the message ``/v1/query`` would give
    (naming the field; a server fault logged and answered with its request id, never a traceback)."""
    try:
        return await go()
    except ToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified by the service
        raise ToolError(service.failure(exc, uuid.uuid4().hex[:16]).message) from None


def _flat(passages: list[Any]) -> list[dict[str, Any]]:
    """Passages, or a lone retriever's rankings of passages, as one list best first."""
    out: list[dict[str, Any]] = []
    for item in passages:
        out.extend(item["passages"] if isinstance(item.get("passages"), list) else [item])
    return out


def _answer(outcome: Outcome, home: str) -> AskResult:
    answer = outcome.answer_json()
    evidence = answer.get("evidence")

    def cite(source: dict[str, Any]) -> Citation:
        collection = source.get("collection") or home
        return Citation(number=source["number"], chunk_id=source["chunk_id"], title=source.get("title", ""),
                        source=source.get("path") or source["source_id"], page=source.get("page", ""),
                        collection=collection, uri=resource_uri(collection, source["source_id"]),
                        passage=source.get("passage", ""))
    return AskResult(
        pipeline=outcome.pipeline, answer_id=outcome.answer_id, answer=answer["text"], refused=answer["refused"],
        reason=answer.get("reason", ""), answered_by=answer.get("answered_by", ""),
        citations=[cite(s) for s in answer.get("sources") or []],
        evidence=None if not evidence else Evidence(
            text=evidence["text"], refused=evidence["refused"], reason=evidence.get("reason", ""),
            confidence=evidence.get("confidence", 0.0), citations=evidence.get("citations", []),
            spans=[{k: s[k] for k in ("number", "chunk_id", "start", "end", "text") if k in s}
                   for s in evidence.get("spans") or []]))


def _collection_entries(tools: Tools, found: Iterable[Shelf]) -> list[CollectionEntry]:
    project, entries = tools.project, []
    for shelf in found:
        if shelf.name in project.collections:
            info = collection_info(project, project.collections[shelf.name])
            entries.append(CollectionEntry(**info.model_dump()))
            continue
        state = project.resource(shelf.state)
        documents, chunks = state.counts() if state.exists() else (0, 0)
        description = project.pipelines[shelf.pipeline].spec.description or ""
        entries.append(CollectionEntry(name=shelf.name, description=description, documents=documents, chunks=chunks))
    return entries


def _list_resources_per_caller(server: MCPServer, tools: Tools) -> None:
    """``resources/list`` answers each caller with the documents it may read, a page at a time: the
    SDK's own list is one static list for everyone. (``add_request_handler`` is the low-level server's
    public way to answer a method; MCPServer keeps that server private.)"""
    async def listing(ctx: Any, params: mcp_types.PaginatedRequestParams) -> mcp_types.ListResourcesResult:
        request = tools.caller(types.SimpleNamespace(request_context=ctx))
        start = int(params.cursor) if params.cursor and params.cursor.isdigit() else 0
        found = await asyncio.to_thread(tools.listed, principal_of(request), None)
        page = [d for d in found if d.status == "indexed"][start:start + MAX_LISTED]
        more = start + MAX_LISTED < len([d for d in found if d.status == "indexed"])
        return mcp_types.ListResourcesResult(
            resources=[mcp_types.Resource(uri=d.uri, name=d.source, mime_type="text/plain",
                                          description=f"{d.collection}: {d.chunks} chunks") for d in page],
            next_cursor=str(start + MAX_LISTED) if more else None)

    server._lowlevel_server.add_request_handler("resources/list", mcp_types.PaginatedRequestParams, listing)


def _instructions(tools: Tools, local: bool) -> str:
    who = ("This server runs as the local operator: every collection and document is readable."
           if local else "Each call answers within the rights of the credential that sent it.")
    return (f"ragline: search and ask the documents of {tools.project.path.name}. `search` finds passages, "
            f"`ask` answers with citations and its evidence (or says why it cannot), `list_collections`, "
            f"`list_documents` and `get_passage` show what there is; resources ragline://<collection>/<source> "
            f"read whole documents. {who}")


# ----------------------------------------------------------------------------- HTTP and stdio
class McpEndpoint:
    """``/mcp`` behind the guard: the session a request opens belongs to its principal (the SDK
    answers 404 to the session id sent with another credential), then the SDK's transport."""

    def __init__(self, server: MCPServer):
        server.streamable_http_app(  # creates the server's session manager (run by the app's lifespan)
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))  # the guard's
        self.manager = server.session_manager
        self.app = StreamableHTTPASGIApp(self.manager)
        self.tools = _listed_tools(server)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        principal = scope.get("state", {}).get("principal")
        if principal is None:  # only the guard lets a request reach here, with a principal
            raise RuntimeError("an /mcp request without the guard's principal")
        scope["user"] = AuthenticatedUser(AccessToken(token="-", client_id=principal.id,
                                                      scopes=sorted(principal.scopes)))
        await self.app(scope, receive, send)


def _listed_tools(server: MCPServer) -> list[mcp_types.Tool]:
    """The tools as ``tools/list`` gives them; the SDK lists them only from a coroutine and an app may
    be built inside a running loop, so on a thread of its own (a few milliseconds, once per app)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, server.list_tools).result()


def openapi_path(tools: list[mcp_types.Tool]) -> dict[str, Any]:
    """``/mcp`` in the API's OpenAPI document: the three methods of streamable HTTP, the JSON-RPC
    body, the errors the guard answers, and every tool with its input and output schema
    (``x-mcp-tools``), so a reader of ``/docs`` sees the MCP surface beside ``/v1/query``."""
    listed = "; ".join(f"`{tool.name}`" for tool in tools)
    refusals = {"401": {"description": "no or a wrong credential (a JSON-RPC error naming it)"},
                "404": {"description": "an unknown session, or one opened with another credential"},
                "413": {"description": "a body over the API's limit (a JSON-RPC error)"},
                "422": {"description": "a body that is not JSON, a lone surrogate, nesting too deep "
                                       "(a JSON-RPC error naming the field)"}}
    security = [{"HTTPBearer": []}]
    return {
        "post": {
            "tags": ["mcp"], "operationId": "mcp_post", "security": security,
            "summary": "MCP over streamable HTTP: one JSON-RPC message",
            "description": (f"The Model Context Protocol (docs/mcp.md): `initialize`, then `tools/list`, "
                            f"`tools/call`, `resources/list`, `resources/read` with the `Mcp-Session-Id` the "
                            f"server answered. Tools: {listed}. Each answers within the caller's rights. A "
                            f"dropped connection does not cancel a call (the MCP transport's rule); "
                            f"`notifications/cancelled` does."),
            "parameters": [{"name": "Mcp-Session-Id", "in": "header", "required": False,
                            "schema": {"type": "string"}, "description": "the session `initialize` opened"}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["jsonrpc", "method"],
                "properties": {"jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer"]},
                               "method": {"type": "string", "examples": ["tools/call"]},
                               "params": {"type": "object"}}}}}},
            "responses": {"200": {"description": "the JSON-RPC response, or a stream of messages (progress, "
                                                 "then the result) as server-sent events",
                                  "content": {"application/json": {}, "text/event-stream": {}}},
                          "202": {"description": "a notification or response accepted"}, **refusals},
            "x-mcp-tools": [{"name": tool.name, "description": tool.description,
                             "inputSchema": tool.input_schema, "outputSchema": tool.output_schema}
                            for tool in tools]},
        "get": {"tags": ["mcp"], "operationId": "mcp_stream", "security": security,
                "summary": "MCP: the session's stream of server messages (server-sent events)",
                "responses": {"200": {"description": "server-sent events",
                                      "content": {"text/event-stream": {}}}, **refusals}},
        "delete": {"tags": ["mcp"], "operationId": "mcp_end", "security": security,
                   "summary": "MCP: end the session", "responses": {"200": {"description": "ended"}, **refusals}},
    }


def http_endpoint(service: QueryService) -> McpEndpoint:
    return McpEndpoint(mcp_server(service, http_request))


RPC_CODES = {400: -32602, 413: -32602, 422: -32602, 401: -32600, 403: -32600, 404: -32600}


def rpc_error(error: ApiError) -> dict[str, Any]:
    """The guard's refusal of an ``/mcp`` request as a JSON-RPC error (the MCP client shows its message)."""
    return {"jsonrpc": "2.0", "id": None, "error": {
        "code": RPC_CODES.get(error.status, -32603), "message": error.message,
        "data": {"status": error.status, "code": error.code, "param": error.param}}}


def serve_stdio(project_path: str, *, data_dir: str | None = None, warm_up: bool = True) -> None:
    """``ragline mcp``: the server over stdin/stdout until the client closes it, as the local operator.
    The models load on a thread meanwhile, so the client's handshake is answered at once."""
    project = load_project(project_path)
    if data_dir:
        project = project.relocated(data_dir)
    service = QueryService(project)
    if warm_up:
        threading.Thread(target=service.warm_up, name="ragline-mcp-warm-up", daemon=True).start()
    try:
        anyio.run(_stdio, mcp_server(service, operator_request))
    finally:
        service.close()
        close_resources()


async def _stdio(server: MCPServer) -> None:
    """The SDK's stdio transport on the process's own stdin and stdout, with the wire claimed first
    (fd 0 reads nothing, fd 1 is stderr: a stray print never corrupts the protocol) and every line
    the SDK would drop answered (``Lines``)."""
    wire_in = io.TextIOWrapper(os.fdopen(os.dup(0), "rb"), encoding="utf-8", errors="replace")
    wire_out = Out(anyio.wrap_file(io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), encoding="utf-8")))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    lowlevel = server._lowlevel_server  # what MCPServer.run_stdio_async runs, on our streams
    async with stdio_server(Lines(anyio.wrap_file(wire_in), wire_out), wire_out) as (read, write):
        await lowlevel.run(read, write, lowlevel.create_initialization_options())


class Out:
    """stdout shared by the SDK's writer and ``Lines``: one whole line at a time."""

    def __init__(self, file: Any):
        self.file, self.lock = file, anyio.Lock()

    async def write(self, text: str) -> None:
        async with self.lock:
            await self.file.write(text)
            await self.file.flush()

    async def flush(self) -> None:
        pass  # each write flushed its line


class Lines:
    """stdin for the SDK's reader. A line it cannot parse (not JSON, a lone surrogate its parser
    refuses) it drops without an answer, and its client waits for ever: such a line is answered
    here with a JSON-RPC error (the request's id when it has one, the field at fault) and not passed on."""

    def __init__(self, lines: Any, out: Out):
        self.lines, self.out = lines, out

    async def __aiter__(self):
        async for line in self.lines:
            error = refusal(line)
            if error is None:
                yield line
            else:
                await self.out.write(json.dumps(error) + "\n")


def refusal(line: str) -> dict[str, Any] | None:
    """The JSON-RPC error for a line the SDK cannot read (None: it can)."""
    try:
        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return None
    except ValidationError:
        pass
    try:
        message = json.loads(line)
    except ValueError as exc:
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"not JSON: {exc}"}}
    number = message.get("id") if isinstance(message, dict) else None
    try:
        check_json(line.encode("utf-8", "surrogatepass"))
        problem = ApiError(400, "not a JSON-RPC 2.0 message (jsonrpc, id, method, params)")
    except BodyProblem as exc:
        problem = ApiError(422, exc.message, param=exc.field, code=exc.code)
    return {**rpc_error(problem), "id": number if isinstance(number, int | str) else None}

