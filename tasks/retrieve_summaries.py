"""Retrieve community summaries (the ``summarize`` job's index) for a corpus-level question.

Each summary comes back as a passage (its chunk and source id ``community:<id>``) whose metadata
names its member documents (``members``, one per line): a citation of it in the answer lists
them (``Source.documents``). The summaries of one level are ranked by the similarity of their
embedding to the question's; ``top_k: null`` keeps them all (GraphRAG's global search reads every
community of a level and lets the map step's scores decide).

Read-only: the published summaries file is read, never written; without one the step says how
to build it. A request restricted to some groups (``Query.access``) sees only the communities
every member document of which it may read: a summary mixes its members' text.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import MEMBERS_KEY, Community, Passage, Query
from ragline.flows.errors import IndexUnavailable
from ragline.flows.resources import summaries
from ragline.flows.resources.embedder import Embedder
from ragline.flows.resources.state import IndexState
from ragline.flows.spec.registry import stage

LEVELS = {"top": (0,), "fine": (1,), "all": (0, 1)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal["top", "fine", "all"] = Field("fine", description="which communities: the few top ones, the "
                                                                     "fine ones, or both")
    top_k: int | None = Field(8, ge=1, le=1000, description="summaries kept, most similar to the question first; "
                                                            "None: every summary of the level")


class SummariesMissing(IndexUnavailable):
    """No summary index has been built for this index yet."""


@stage("retrieve_summaries", params=Params, produces="passages", kind="query",
       uses={"state": ("index_state",), "embedder": ("sentence_transformer",)})
def retrieve_summaries(query: Query, params: Params, ctx: StepContext, state: IndexState,
                       embedder: Embedder) -> list[Passage]:
    """The community summaries of a level, ranked by similarity to the question."""
    path = summaries.summaries_path(state.path)
    built = summaries.load(path)
    if built is None:
        raise SummariesMissing(f"{path}: no community summaries yet; build them with the summarize job "
                               f"(`ragline run summarize`)")
    if built.generation < state.generation:
        ctx.logger.info("the summaries were built at index generation %d, the index is at %d: run the summarize "
                        "job to refresh them", built.generation, state.generation)
    chosen = [c for c in built.communities if c.level in LEVELS[params.level] and c.summary and c.embedding]
    if query.access is not None:
        readers = state.readers()
        chosen = [c for c in chosen if all(_may_read(readers.get(d), query.access) for d in c.documents)]
    if not chosen:
        return []
    question = embedder.encode_queries([query.text])[0]
    scores = np.asarray([c.embedding for c in chosen], dtype=np.float32) @ question
    order = sorted(range(len(chosen)), key=lambda i: (-float(scores[i]), chosen[i].id))
    if params.top_k is not None:
        order = order[: params.top_k]
    return [_passage(chosen[i], float(scores[i]), ctx.step_id) for i in order]


def _may_read(groups: tuple[str, ...] | None, access: frozenset[str]) -> bool:
    """() is public; None (unknown, or a document deleted since the build) is not readable."""
    return groups is not None and (not groups or bool(access.intersection(groups)))


def _passage(community: Community, score: float, step: str) -> Passage:
    return Passage(chunk_id=f"community:{community.id}", source_id=f"community:{community.id}",
                   title=f"Topic community {community.id} ({len(community.documents)} documents)",
                   text=community.summary, score=score, retriever=step,
                   metadata={MEMBERS_KEY: "\n".join(community.documents), "level": community.level,
                             "source": f"community {community.id}"})
