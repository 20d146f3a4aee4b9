"""The community summary index for corpus-level questions (GraphRAG-style, a ``summarize`` job).

The index's chunk vectors (as stored) are clustered into a two-level hierarchy of topic
communities: k-means over the chunks gives the fine communities (level 1), k-means over their
centroids groups them into top communities (level 0). The LLM summarises each fine community
from its most central chunks (those nearest its centroid) within a token budget: one call when
they fit ``max_input_tokens``, else one call per group that fits, then one call that merges the
partial summaries (map-reduce). A top community is summarised from its children's summaries.
Every prompt fences document text as data (``_documents.j2``).

Incremental: each community carries a hash of its membership (its sorted chunk ids, which are
content hashes; a top community hashes its children's hashes). A re-run whose index changed by
at most ``recluster_fraction`` of its chunks keeps the published centroids and assigns chunks to
the nearest one, so a one-document change alters only the communities its chunks leave or join;
only communities whose hash changed are summarised again, the others keep their summary.
Deleted documents leave their communities' membership, so those are re-summarised without them;
a community left empty is dropped.

The stage returns a ``SummaryReport``; the job runner publishes it (``flows/run/jobs.py``: one
atomic rename beside a state file, one transaction in a database state), so a build killed at any
point leaves the previous summaries whole and usable.
The stage only reads the index (state, vectors) and the published summaries.
"""
from __future__ import annotations

import hashlib
import math
import time

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Community, ContextDocument, Passage, SummaryReport
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, strip_markup
from ragline.flows.resources.stores.state import IndexState
from ragline.flows.resources.stores.protocols import DenseStore
from ragline.flows.spec.registry import stage

COMMUNITY_VARIABLES = ("documents",)
MERGE_VARIABLES = ("documents",)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    communities: int | None = Field(None, ge=1, le=1000, description="fine communities (level 1); None: "
                                                                      "sqrt(chunks / 2), 2 to 64")
    top_communities: int | None = Field(None, ge=1, le=100, description="top communities (level 0); None: "
                                                                        "sqrt(fine communities)")
    member_chunks: int = Field(8, ge=1, le=200, description="central chunks a fine community's summary reads")
    max_input_tokens: int = Field(1200, ge=32, le=100_000, description="chunk text per summarising call; more is "
                                                                       "summarised in groups, then merged")
    max_chunk_chars: int = Field(2000, ge=100, description="text shown per chunk")
    summary_tokens: int = Field(160, ge=16, le=2048, description="token budget of each summary")
    recluster_fraction: float = Field(0.3, ge=0, le=1, description="share of chunks added or removed since the "
                                                                   "centroids were made above which k-means runs "
                                                                   "again (re-summarising most communities)")
    recluster: bool = Field(False, description="run k-means even when the change is small")
    seed: int = Field(0, description="k-means seed: the same index and seed give the same communities")
    prompt_merge: str = Field("summarize_summaries", min_length=1, description="the template that merges partial "
                                                                               "or child summaries")
    write: bool = Field(True, description="publish the summaries (false: a dry run that only reports)")


def _prompts(params: Params) -> dict[str, tuple[str, ...]]:
    return {params.prompt_merge: MERGE_VARIABLES}


@stage("summarize_communities", params=Params, produces="summaries", kind="job",
       uses={"store": ("chroma",), "embedder": ("sentence_transformer",), "state": ("index_state",),
             "llm": ("openai_compatible",)},
       prompt="summarize_community", prompt_variables=COMMUNITY_VARIABLES, other_prompts=_prompts)
def summarize_communities(params: Params, ctx: StepContext, store: DenseStore, embedder: Embedder,
                          state: IndexState, llm: LLMClient) -> SummaryReport:
    """Cluster the chunk vectors into two levels of communities and summarise those whose membership changed."""
    started = time.perf_counter()
    published = state.summaries()  # a file beside the state, or rows of a database state
    where = published.location
    generation, rows = state.snapshot()
    texts = {cid: (text, meta) for cid, text, meta in rows}
    found = store.vectors(sorted(texts))
    ids = sorted(found)
    if len(ids) < len(texts):
        ctx.logger.warning("%d chunks of the state have no stored vector; left out", len(texts) - len(ids))
    own = ctx.project.pipeline(ctx.pipeline).step(ctx.step_id).resources.get("state", "") if ctx.project else ""
    report = SummaryReport(generation=generation, chunks=len(ids), path=where, embedder=embedder.spec.model,
                           write_requested=params.write, state_resource=own)
    if not ids:
        ctx.logger.warning("the index is empty: no communities")
        report.seconds = time.perf_counter() - started
        return report
    vectors = _unit(np.stack([found[i] for i in ids]))
    try:
        previous = published.load()
    except ValueError as exc:
        ctx.logger.warning("%s; building from scratch", exc)
        previous = None
    fine_k = min(len(ids), params.communities or int(np.clip(round(math.sqrt(len(ids) / 2)), 2, 64)))
    kept = _kept_centroids(previous, ids, min(len(ids), params.communities) if params.communities else None,
                           vectors.shape[1], params)  # automatic k: the kept one (a rounding flip re-clusters not)
    if kept is None:
        fine_centroids, top_of = _kmeans_hierarchy(vectors, fine_k, params)
    else:
        fine_centroids, top_of = kept
        ctx.logger.info("assigning chunks to the %d kept centroids (the index changed little)", len(fine_centroids))
    report.reclustered = kept is None
    assignment = np.argmax(vectors @ fine_centroids.T, axis=1)
    old = {c.membership: c for c in (previous.communities if previous else []) if c.summary}
    fine: list[Community] = []
    for n, centroid in enumerate(fine_centroids):
        rows_n = np.flatnonzero(assignment == n)
        if not len(rows_n):
            continue
        members = sorted(ids[i] for i in rows_n)
        central = [ids[i] for i in rows_n[np.argsort(-(vectors[rows_n] @ centroid), kind="stable")]]
        fine.append(Community(id=f"L1-{n}", level=1, parent=f"L0-{top_of[n]}", chunk_ids=members,
                              documents=sorted({texts[c][1]["source_id"] for c in members}),
                              membership=_hash(members), centroid=[float(x) for x in centroid],
                              read_chunks=central[: params.member_chunks]))
    top: list[Community] = []
    for t in sorted(set(top_of.tolist())):
        children = [c for c in fine if c.parent == f"L0-{t}"]
        if not children:
            continue
        members = sorted(m for c in children for m in c.chunk_ids)
        top.append(Community(id=f"L0-{t}", level=0, children=[c.id for c in children], chunk_ids=members,
                             documents=sorted({d for c in children for d in c.documents}),
                             membership=_hash([c.membership for c in children]),
                             centroid=[float(x) for x in _unit(np.mean([c.centroid for c in children], axis=0))]))
    calls = [0]
    to_do = [c for c in fine if not _reuse(c, old)]
    written = llm.map(lambda c: _summarise([_passage(m, texts[m]) for m in c.read_chunks], params, ctx, llm, calls),
                      to_do)
    for community, summary in zip(to_do, written):
        community.summary = summary
    by_id = {c.id: c for c in fine}
    to_do = [c for c in top if not _reuse(c, old)]
    written = llm.map(lambda c: _merge([Passage(chunk_id=f.id, source_id=f.id, title=f"community {f.id}",
                                                text=f.summary) for f in (by_id[i] for i in c.children)],
                                       params, ctx, llm, calls), to_do)
    for community, summary in zip(to_do, written):
        community.summary = summary
    fresh = [c for c in top + fine if not c.reused]
    if fresh:
        embedded = embedder.encode_documents([c.summary for c in fresh])
        for community, vector in zip(fresh, embedded):
            community.embedding = [float(x) for x in vector]
    report.communities = top + fine
    report.documents = len({texts[c][1]["source_id"] for c in ids})
    report.summarised = [c.id for c in fresh]
    report.reused = [c.id for c in report.communities if c.reused]
    report.llm_calls = calls[0]
    report.seconds = time.perf_counter() - started
    ctx.logger.info("%d top and %d fine communities over %d chunks: %d summarised (%d LLM calls), %d kept",
                    len(top), len(fine), len(ids), len(fresh), calls[0], len(report.reused))
    return report


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)


def _hash(items: list[str]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()


def _kept_centroids(previous: SummaryReport | None, ids: list[str], k: int | None, dim: int,
                    params: Params) -> tuple[np.ndarray, np.ndarray] | None:
    """The published fine centroids and their top community, when the index changed little since
    (and the number of communities asked for, if any, is the published one)."""
    if previous is None or params.recluster:
        return None
    fine = [c for c in previous.communities if c.level == 1]
    if not fine or (k is not None and len(fine) != k) or any(len(c.centroid) != dim for c in fine):
        return None
    if params.top_communities is not None and \
            len({c.parent for c in fine}) != min(params.top_communities, k):
        return None
    before = {m for c in fine for m in c.chunk_ids}
    now = set(ids)
    if len(before ^ now) > params.recluster_fraction * max(len(before), 1):
        return None
    tops = sorted({c.parent or "L0-0" for c in fine})
    centroids = _unit(np.asarray([c.centroid for c in fine], dtype=np.float32))
    return centroids, np.asarray([tops.index(c.parent or "L0-0") for c in fine])


def _kmeans_hierarchy(vectors: np.ndarray, k: int, params: Params) -> tuple[np.ndarray, np.ndarray]:
    """Fine centroids (unit length) and, per fine community, its top community."""
    from sklearn.cluster import KMeans  # noqa: PLC0415 - sklearn's import is slow; the job alone needs it

    fine = KMeans(n_clusters=k, n_init=4, random_state=params.seed).fit(vectors)
    centroids = _unit(fine.cluster_centers_.astype(np.float32))
    top_k = min(k, params.top_communities or max(1, round(math.sqrt(k))))
    if top_k == 1:
        return centroids, np.zeros(k, dtype=int)
    top = KMeans(n_clusters=top_k, n_init=4, random_state=params.seed).fit(centroids)
    return centroids, top.labels_


def _reuse(community: Community, old: dict[str, Community]) -> bool:
    """Keep the previous summary of the same membership (same hash at the same level)."""
    before = old.get(community.membership)
    if before is None or before.level != community.level:
        return False
    community.summary, community.embedding, community.reused = before.summary, before.embedding, True
    if community.level == 1:
        community.read_chunks = before.read_chunks
    return True


def _passage(chunk_id: str, row: tuple[str, dict]) -> Passage:
    text, meta = row
    return Passage(chunk_id=chunk_id, source_id=str(meta.get("source_id", "")), title=str(meta.get("title", "")),
                   text=text)


def _documents(passages: list[Passage], params: Params) -> list[ContextDocument]:
    return [ContextDocument(number=n, passage=p.model_copy(update={"text": clip(p.text, params.max_chunk_chars)}))
            for n, p in enumerate(passages, start=1)]


def _groups(passages: list[Passage], params: Params, llm: LLMClient) -> list[list[Passage]]:
    """Consecutive passages in groups of at most ``max_input_tokens`` (a longer one alone)."""
    counts = llm.count_tokens([clip(p.text, params.max_chunk_chars) for p in passages])
    groups: list[list[Passage]] = [[]]
    used = 0
    for passage, tokens in zip(passages, counts):
        if groups[-1] and used + tokens > params.max_input_tokens:
            groups.append([])
            used = 0
        groups[-1].append(passage)
        used += tokens
    return groups


def _ask(prompt: str, params: Params, llm: LLMClient, calls: list[int]) -> str:
    calls[0] += 1
    return strip_markup(llm.chat(prompt, max_tokens=params.summary_tokens).text).strip()


def _summarise(passages: list[Passage], params: Params, ctx: StepContext, llm: LLMClient, calls: list[int]) -> str:
    """One summary of a community's central chunks: one call, or map over groups then merge."""
    groups = _groups(passages, params, llm)
    partial = llm.map(lambda group: _ask(ctx.prompt(documents=_documents(group, params)), params, llm, calls),
                      groups)
    if len(partial) == 1:
        return partial[0]
    return _merge([Passage(chunk_id=f"part{n}", source_id="", text=text) for n, text in enumerate(partial)],
                  params, ctx, llm, calls)


def _merge(parts: list[Passage], params: Params, ctx: StepContext, llm: LLMClient, calls: list[int]) -> str:
    """One summary from several (a big community's partial summaries, or a top community's children)."""
    groups = _groups(parts, params, llm)
    if 1 < len(groups) < len(parts):  # too many to read at once: merge each group, then the merged ones
        merged = llm.map(lambda g: _merge_once(g, params, ctx, llm, calls), groups)
        return _merge([Passage(chunk_id=f"m{n}", source_id="", text=t) for n, t in enumerate(merged)],
                      params, ctx, llm, calls)
    return _merge_once(parts, params, ctx, llm, calls)


def _merge_once(parts: list[Passage], params: Params, ctx: StepContext, llm: LLMClient, calls: list[int]) -> str:
    return _ask(ctx.prompt_for(params.prompt_merge, documents=_documents(parts, params)), params, llm, calls)
