"""Retrieve community summaries (the ``summarize`` job's index) for a corpus-level question.

Each summary comes back as a passage (its chunk and source id ``community:<id>``, or
``community:<collection>:<id>`` from a named collection) whose metadata names its member documents
(``members``, one per line): a citation of it in the answer lists them (``Source.documents``). The
summaries of one level are ranked by the similarity of their embedding to the question's;
``top_k: null`` keeps them all (GraphRAG's global search reads every community of a level and lets
the map step's scores decide).

Named collections (``collections:``): the step reads the summaries of every collection the request
selects (``Query.collections``; all it may query when it names none), each collection's own (built
by its ``summarize@<collection>`` job), and ranks them together by score: ``top_k`` is over all of
them. Each passage says which collection it came from (``metadata.collection``).

Who may read what: a request restricted to some groups (``Query.access``) sees only the communities
every member document of which it may read (in that community's own collection): a summary mixes
its members' text.

Request filters (``Query.filters``, the retrievers' filter language, validated the same way; the
step's own ``where`` is ANDed with them) are evaluated on the metadata of each community's member
chunks, as a retriever evaluates them on chunks. ``filter_rule: all`` (the default) keeps a
community only when every member chunk matches: its summary was written from its members' text,
so one that read documents the filter excludes would carry them into the answer, which a filter
must not do (the same reason as the access rule). ``filter_rule: any`` keeps a community when at
least one member chunk matches (exploratory use: communities mix the filter's documents with
others); either way its citation lists only the member documents with a matching chunk. Without
filters nothing is read but the summaries; with them, the member chunks' metadata of the
candidates, best first, until ``top_k`` are kept.

Read-only: the published summaries are read, never written; without them the step says how to
build them.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import COLLECTION_KEY, MEMBERS_KEY, Community, Passage, Query
from ragline.flows.errors import IndexUnavailable
from ragline.flows.resources.stores import filters
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.state import IndexState
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.collection_index import by_collection

LEVELS = {"top": (0,), "fine": (1,), "all": (0, 1)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal["top", "fine", "all"] = Field("fine", description="which communities: the few top ones, the "
                                                                     "fine ones, or both")
    top_k: int | None = Field(8, ge=1, le=1000, description="summaries kept, most similar to the question first "
                                                            "(over every collection read); None: every summary "
                                                            "of the level")
    where: dict[str, Any] | None = Field(None, description="fixed metadata filter on the member chunks, ANDed "
                                                           "with the request's filters")
    filter_rule: Literal["all", "any"] = Field("all", description="with filters: keep a community when all its "
                                                                  "member chunks match (its summary read nothing "
                                                                  "the filter excludes), or when any does")

    @field_validator("where")
    @classmethod
    def _valid_filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        filters.validate(value)
        return value


class SummariesMissing(IndexUnavailable):
    """No summary index has been built for this index yet."""


class SummariesStale(IndexUnavailable):
    """The summaries were embedded by another model than the one queries are embedded with."""


@stage("retrieve_summaries", params=Params, produces="passages", kind="query",
       uses={"state": ("index_state",), "embedder": ("sentence_transformer",)}, merges_collections=True)
def retrieve_summaries(query: Query, params: Params, ctx: StepContext, state: IndexState,
                       embedder: Embedder) -> list[Passage]:
    """The community summaries of a level, of each collection the request reads, ranked by similarity to it."""
    filters.validate(query.filters)
    where = filters.normalize({"$and": [f for f in (params.where, query.filters) if f]})
    candidates: list[tuple[str | None, IndexState, Community]] = []
    for name, own in by_collection(ctx, "state", state, query.collections).items():
        for community in _readable(name, own, params, query, ctx, embedder):
            candidates.append((name, own, community))
    if not candidates:
        return []
    question = embedder.encode_queries([query.text])[0]
    scores = np.asarray([c.embedding for _, _, c in candidates], dtype=np.float32) @ question
    order = sorted(range(len(candidates)), key=lambda i: (-float(scores[i]), candidates[i][0] or "",
                                                          candidates[i][2].id))
    kept: list[Passage] = []
    refused = 0
    for i in order:
        if params.top_k is not None and len(kept) >= params.top_k:
            break
        name, own, community = candidates[i]
        documents = community.documents if where is None else _matching(community, own, where, params.filter_rule)
        if documents is None:
            refused += 1
            continue
        kept.append(_passage(community, documents, float(scores[i]), ctx.step_id, name))
    if where is not None and not kept and refused:
        hint = "; `filter_rule: any` keeps those with some matching documents" if params.filter_rule == "all" else ""
        ctx.logger.info("no community's member documents match the filters (%d read)%s", refused, hint)
    return kept


def _readable(name: str | None, state: IndexState, params: Params, query: Query, ctx: StepContext,
              embedder: Embedder) -> list[Community]:
    """The communities of the level in one collection's published summaries that the request may read."""
    published = state.summaries()
    built = published.load()
    run = f"ragline run summarize --collection {name}" if name else "ragline run summarize"
    if built is None:
        raise SummariesMissing(f"{published.location}: no community summaries yet; build them with the "
                               f"summarize job (`{run}`)")
    if built.embedder and built.embedder != embedder.spec.model:  # their scores would mean nothing (or not fit)
        raise SummariesStale(f"{published.location}: the community summaries were embedded with "
                             f"'{built.embedder}', queries with '{embedder.spec.model}'; build them again (`{run}`)")
    if built.generation < state.generation:
        ctx.logger.info("the summaries%s were built at index generation %d, the index is at %d: run the summarize "
                        "job to refresh them", f" of collection '{name}'" if name else "", built.generation,
                        state.generation)
    chosen = [c for c in built.communities if c.level in LEVELS[params.level] and c.summary and c.embedding]
    if query.access is not None:
        readers = state.readers()
        chosen = [c for c in chosen if all(_may_read(readers.get(d), query.access) for d in c.documents)]
    return chosen


def _may_read(groups: tuple[str, ...] | None, access: frozenset[str]) -> bool:
    """() is public; None (unknown, or a document deleted since the build) is not readable."""
    return groups is not None and (not groups or bool(access.intersection(groups)))


def _matching(community: Community, state: IndexState, where: dict[str, Any], rule: str) -> list[str] | None:
    """The member documents with a chunk matching ``where``, in order; None when the community is not
    eligible under ``rule`` (all: every member chunk matches; any: one does). A chunk deleted since
    the build does not match."""
    rows = state.chunk_metadata(community.chunk_ids)
    matched: set[str] = set()
    for chunk_id in community.chunk_ids:
        meta = rows.get(chunk_id)
        if meta is not None and filters.matches(meta, where):
            matched.add(meta["source_id"])
        elif rule == "all":
            return None
    return [d for d in community.documents if d in matched] or None


def _passage(community: Community, documents: list[str], score: float, step: str, collection: str | None) -> Passage:
    key = f"community:{collection}:{community.id}" if collection else f"community:{community.id}"
    metadata: dict[str, Any] = {MEMBERS_KEY: "\n".join(documents), "level": community.level,
                                "source": f"community {community.id}"}
    if collection:
        metadata[COLLECTION_KEY] = collection
    return Passage(chunk_id=key, source_id=key, title=f"Topic community {community.id} ({len(documents)} documents)",
                   text=community.summary, score=score, retriever=step, metadata=metadata)
