"""``GET /v1/collections``: the named collections (pipelines.yaml ``collections``) a credential may
query, with their description and how many documents and chunks each holds (its index state), so a
client (the chat page's picker) offers only what a query may name. A collection the credential may
not query is not listed at all; one that may query none is refused (403), like a query would be."""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from ragline.flows.serve.auth.principals import principal_of
from ragline.flows.serve.query_service import ERRORS, ApiError, QueryService


class CollectionInfo(BaseModel):
    name: str
    description: str = ""
    documents: int = Field(description="documents in its index (0 before its first ingestion)")
    chunks: int = Field(description="chunks in its index")


class CollectionList(BaseModel):
    collections: list[CollectionInfo] = Field(description="in pipelines.yaml's order; empty: it declares none")


def catalog_router(service: QueryService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["query"])
    project = service.project

    @router.get("/collections", response_model=CollectionList, responses=ERRORS,
                summary="The named collections this credential may query, with their document and chunk counts")
    def collections(request: Request) -> CollectionList:  # a plain def: the state reads run off the event loop
        principal = principal_of(request)
        readable = [c for c in project.collections.values() if principal.may("query", [c.name])]
        if not readable and (project.collections or not principal.may("query")):
            raise ApiError(403, f"forbidden: this credential lacks "
                                f"{principal.missing('query', list(project.collections))}",
                           "permission_error", code="forbidden")
        return CollectionList(collections=[collection_info(project, c) for c in readable])

    return router


def collection_info(project, collection) -> CollectionInfo:
    """A named collection with its description and its index state's document and chunk counts."""
    description = project.pipelines[collection.pipeline].spec.description or ""
    states = [own for own in collection.resources.values() if project.spec.resources[own].type == "index_state"]
    documents = chunks = 0
    if states:
        state = project.resource(states[0])
        if state.exists():
            documents, chunks = state.counts()
    return CollectionInfo(name=collection.name, description=description, documents=documents, chunks=chunks)
