"""The ingestion sink: writes chunks to Chroma and the state record, keeps BM25 in step.

Crash safety comes from the order of writes. For each batch: read the old chunk ids, forget
the sources in the state (commit), delete stale vectors, upsert the new ones, record the
sources with their new chunks (commit). A crash anywhere leaves the state naming only
complete sources; the next run re-indexes the rest and, because the run was marked dirty,
``reconcile`` deletes vectors the state does not name. BM25 is brought to the state (the
chunks its change log names since the published generation) whenever the generations differ.

Every run also checks, under its lease, that the stores still agree with the state (counts and
a sample of ids: ``integrity.compare``) and repairs what a lost or damaged store needs, one
warning line each: a deleted Chroma folder is re-embedded, a deleted or garbled BM25 version
rebuilt. What it cannot repair (a damaged state file) fails the run naming the file and the remedy.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows import access, failpoints
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Coverage, Document, Failure, IndexReport
from ragline.flows.contracts import UNREAD_KEY, IngestPlan, WorkPage
from ragline.flows.spec.registry import stage
from ragline.flows.resources.stores import integrity
from ragline.flows.resources.stores.milvus import check_roles
from ragline.flows.resources.stores.integrity import reconcile
from ragline.flows.resources.stores.state import IndexState, LeaseHolder
from ragline.flows.resources.stores.source_ids import Moves, find_moves, may_move, move_chunks, move_tails
from ragline.flows.resources.stores.protocols import DenseStore, SparseIndex
from ragline.tasks.generate.answerable import record_floor

DIRTY = "dirty"
FAILURES = "failures"  # meta "failures:<pipeline>": the last run's per-document failures,
# {source_id: {"stage": step id, "reason": why}}: load's at plan, every stage's at finalize


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delete_missing: bool = Field(True, description="remove sources this pipeline no longer loads from every index "
                                                   "(only under roots the source step listed completely)")
    wait: bool = Field(True, description="wait while another run writes this index (else fail at once)")
    wait_timeout_seconds: float | None = Field(None, gt=0, description="give up waiting after this long")
    reconcile: Literal["auto", "always"] = Field(
        "auto", description="auto: check the stores against the state after an interrupted run; always: every run")
    gate_floor_pairs: int = Field(48, ge=0, le=1000, description="inverse-cloze pseudo-queries that set the "
                                                                 "answerability gates' similarity floor once the "
                                                                 "index changed (min_similarity: auto); 0: none")


USES = {"store": ("chroma", "milvus"), "sparse": ("bm25", "milvus"), "state": ("index_state",)}


@stage("index", params=Params, produces="report", uses=USES, kind="ingestion")
def index(chunks: list[Chunk], documents: list[Document], ctx: StepContext, store: DenseStore,
          state: IndexState) -> IndexReport:
    """Replace the chunks of this batch's documents in Chroma and the state record."""
    source_ids = [d.source_id for d in documents]
    known = state.known(source_ids)
    old_ids = state.chunk_ids(source_ids)
    new_ids = {c.chunk_id for c in chunks}
    _ensure_dimension(store, state, chunks, ctx)
    granted(chunks, documents)
    state.forget(source_ids)
    failpoints.hit("index.after_forget")
    store.delete(sorted(old_ids - new_ids))
    failpoints.hit("index.after_delete")
    embedded = [c for c in chunks if c.embedding is not None]
    store.upsert(embedded)
    if embedded and embedded[0].embedder_key:
        store.record_embedder(embedded[0].embedder_key, embedded[0].embedder_model)
    failpoints.hit("index.after_upsert")
    state.record(ctx.pipeline, ctx.fingerprint, documents, chunks)
    failpoints.hit("index.after_record")
    fresh = [s for s in source_ids if s not in known]
    repaired = len(set(fresh) & integrity.repairing(state)) if fresh else 0
    return IndexReport(added=len(fresh) - repaired, repaired=repaired, updated=len(source_ids) - len(fresh),
                       chunks_written=len(chunks), chunks_deleted=len(old_ids - new_ids))


def granted(chunks: list[Chunk], documents: list[Document]) -> None:
    """Every chunk carries exactly its document's groups (flows/access.py), whatever the loader and
    chunker in between did: the sink, not each stage, makes the stores agree with the state."""
    groups = {d.source_id: d.groups for d in documents}
    for chunk in chunks:
        chunk.metadata = {**access.without_acl(chunk.metadata), **access.acl_metadata(groups.get(chunk.source_id, ()))}


@index.on_session
@contextmanager
def session(params: Params, ctx: StepContext, store: DenseStore, sparse: SparseIndex,
            state: IndexState) -> Iterator[None]:
    """One writer per index: hold the state's lease for the whole run (plan, batches, finalize), and
    repair the stores first, before the sources are listed."""
    def waiting(holder: LeaseHolder) -> None:
        ctx.logger.warning("waiting: the index is being written by %s", holder.describe())

    with state.lease(f"{ctx.pipeline} run", wait=params.wait, timeout=params.wait_timeout_seconds, on_wait=waiting):
        state.clear_listed()  # this run's listing starts empty (a killed run's is never read as this one's)
        repair_stores(params, ctx, store, sparse, state)
        yield


def repair_stores(params: Params, ctx: StepContext, store: DenseStore, sparse: SparseIndex,
                  state: IndexState) -> None:
    """Finish an interrupted run and repair any store that no longer agrees with the state, before
    the listing compares the sources with the state: the sources a repair forgets are then listed as
    changed and re-embedded by this same run (repaired in the plan, they were listed as unchanged
    first and stayed missing until the next run). They are remembered (``integrity.REPAIRING``) until
    a run finishes, so the summary counts them as repaired, a killed run's included."""
    check_roles(store, sparse)
    integrity.resume(store)  # first: an interrupted restore would read as missing chunks and be re-embedded
    if params.reconcile == "always" or state.get_meta(DIRTY) == "1":
        integrity.mark_repairing(state, reconcile(store, state, ctx.logger.warning))
    integrity.repair(integrity.compare(store, sparse, state, writer=True), store, sparse, state, ctx.logger.warning)


@index.on_plan
def plan(documents: list[Document], failures: list[Failure], covered: list[Coverage], params: Params,
         ctx: StepContext, store: DenseStore, sparse: SparseIndex, state: IndexState) -> IngestPlan:
    """Decide what changed since the last run (the stores were repaired by ``session``, before the
    sources were listed)."""
    state.set_meta(DIRTY, "1")
    record_failures(state, ctx.pipeline, failures)
    # planned in SQL over the state: the sources the listing marked unchanged (``IndexState.mark_listed``)
    # are never Documents here, and those it listed to read are on the state's work list
    # (``IndexState.queue``), read a page at a time; only the sources in neither (gone, renamed, or
    # given here as Documents) are read, a page at a time, and only the orphans a current root does
    # not cover are kept (renames)
    given = {d.source_id for d in documents}
    unlisted: list[str] = []
    orphans: dict[str, tuple[str, str]] = {}
    for page in state.unlisted_pages(ctx.pipeline):
        for source_id, digest, fingerprint in page:
            if source_id in given:
                continue
            if any(c.covers(source_id) for c in covered):
                unlisted.append(source_id)
            else:
                orphans[source_id] = (digest, fingerprint)
    candidates = list(documents)
    if orphans:  # only documents that could pair with an orphan are kept from the work list
        tails = move_tails(orphans, covered)
        candidates += [d for page in state.queued_pages(ctx.pipeline) for _, d in page if may_move(d, tails)]
    moves = find_moves(candidates, {**orphans, **state.sources_of({d.source_id for d in candidates},
                                                                  origin=ctx.pipeline)}, covered, failures)
    migrated = migrate_ids(moves, store, state, ctx)
    if not migrated:  # nothing renamed in place (a vector was missing): the old ids go, the documents re-index
        moves.gone += list(moves.renamed)
    plan = IngestPlan(to_index=[], migrated=migrated)
    everything = state.sources_of(given)
    unchanged: list[Document] = []
    for doc in documents:
        previous = everything.get(doc.source_id)
        if previous == (doc.content_hash, ctx.fingerprint):
            unchanged.append(doc)
            continue
        plan.to_index.append(doc)
        (plan.updated if previous else plan.new).add(doc.source_id)
    plan.regranted = regrant(unchanged, store, state, ctx)
    kept = len(unchanged) - plan.regranted
    read = [d for d in unchanged if d.text or UNREAD_KEY in d.metadata]
    state.queue(ctx.pipeline, "", read)  # their new signals wait for finalize, as the work list's do
    state.hold_signals(d.source_id for d in read)
    # the work list, a page at a time: the unchanged leave it (a touched file, a re-grant), the rest
    # stay on it for the engine's batches (``pending``)
    for page in state.queued_pages(ctx.pipeline):
        listed = [d for _, d in page]
        previous_of = state.sources_of(d.source_id for d in listed)
        same = [d for d in listed if previous_of.get(d.source_id) == (d.content_hash, ctx.fingerprint)]
        plan.queued += len(listed) - len(same)
        regranted = regrant(same, store, state, ctx)
        plan.regranted += regranted
        kept += len(same) - regranted
        read = {d.source_id for d in same if d.text or UNREAD_KEY in d.metadata}
        state.hold_signals(read)  # recorded at finalize, once every batch is (``IndexState.hold_signals``)
        state.dequeue(d.source_id for d in same if d.source_id not in read)
    plan.unchanged = kept + state.listed_count(ctx.pipeline)
    if params.delete_missing:
        plan.removed = sorted(set(gone_sources(unlisted + list(orphans), given, failures, covered))
                              | set(moves.gone))
    return plan


@index.on_pending
def pending(after: str, size: int, ctx: StepContext, state: IndexState) -> WorkPage:
    """The next batch of the work list the plan left (documents to index, after source id ``after``)."""
    page = next(state.queued_pages(ctx.pipeline, size=size, after=after), [])
    return WorkPage(documents=[d for _, d in page], steps=[step for step, _ in page])


def migrate_ids(moves: Moves, store: DenseStore, state: IndexState, ctx: StepContext) -> int:
    """Rename moved sources in place (vectors kept: Chroma first, then the state in one transaction,
    so a crash between them is redone by the next run); say so in one line."""
    rows = state.source_chunks(moves.renamed)
    chunks = move_chunks(rows, store.vectors([r[0] for r in rows]), moves.renamed) if rows else []
    if not moves.renamed or chunks is None:  # a vector is missing: the documents are re-indexed as new
        return 0
    store.upsert(chunks)
    state.rename_sources(moves.renamed, chunks)
    ctx.logger.warning("migrated %d sources to root-relative ids (an index from before them, a moved project or a "
                       "renamed root), keeping their vectors", len(moves.renamed))
    return len(moves.renamed)


def regrant(documents: list[Document], store: DenseStore, state: IndexState, ctx: StepContext) -> int:
    """Apply changed access to unchanged documents in place: their chunks' metadata, never their
    vectors. Crash-safe like a replace: the state forgets their access (commit), Chroma's metadata
    is changed, then the state records the new groups on the sources and their chunks (one
    transaction, which moves the generation so BM25 is republished at finalize). A crash between
    leaves the access unknown, and the next run grants them again whatever their rules are then."""
    stored = state.acls(d.source_id for d in documents)
    grants = {d.source_id: tuple(sorted(set(d.groups))) for d in documents
              if stored.get(d.source_id) != tuple(sorted(set(d.groups)))}
    if not grants:
        return 0
    state.forget_access(grants)
    failpoints.hit("regrant.after_forget")
    owners = {cid: sid for cid, sid, *_ in state.source_chunks(grants)}
    stored_meta = store.metadatas(sorted(owners))  # what Chroma holds (a killed re-grant may have changed it)
    store.update_metadata({cid: access_change(meta, grants[owners[cid]]) for cid, meta in stored_meta.items()})
    failpoints.hit("regrant.after_store")
    state.regrant(grants)
    ctx.logger.info("re-granted %d sources whose access changed (metadata only, nothing re-embedded)", len(grants))
    return len(grants)


def access_change(metadata: dict, groups: tuple[str, ...]) -> dict:
    """The Chroma metadata update that takes a chunk from the grants it holds in Chroma to ``groups``:
    every access key it has removed (None), the new ones set."""
    return {**{k: None for k in metadata if access.reserved(k)}, **access.acl_metadata(groups)}


def gone_sources(indexed: Iterable[str], seen: set[str], failures: list[Failure], covered: list[Coverage]) -> list[str]:
    """Indexed sources the user really removed: under a root listed completely, not loaded this time,
    and not protected by a failure (an unreadable file, folder or JSONL line keeps what it had).
    A root that could not be reached (unmounted, moved, a typo) means nothing is deleted at all."""
    if any(f.root for f in failures):
        return []
    return sorted(s for s in indexed if s not in seen and any(c.covers(s) for c in covered)
                  and not any(f.protects(s) for f in failures))


def record_failures(state: IndexState, pipeline: str, failures: Iterable[Failure]) -> None:
    """The run's per-document failures, for ``GET /v1/documents`` (a root's failure is the run's)."""
    state.set_meta(f"{FAILURES}:{pipeline}", json.dumps({f.source_id: {"stage": f.stage, "reason": f.reason}
                                                         for f in failures if not f.root}))


@index.on_finalize
def finalize(plan: IngestPlan, failures: list[Failure], params: Params, ctx: StepContext, store: DenseStore,
             sparse: SparseIndex, state: IndexState) -> IndexReport:
    """Delete removed sources everywhere, republish BM25 if the state moved, mark the run clean,
    set the answerability floor of the published index; record every stage's failures (the engine
    collects them: load's, and those of the batches' steps, which plan could not know)."""
    record_failures(state, ctx.pipeline, failures)
    state.record_held_signals(ctx.pipeline)
    removed_ids = state.chunk_ids(plan.removed)
    state.forget(plan.removed)
    failpoints.hit("finalize.after_forget")
    store.delete(sorted(removed_ids))
    failpoints.hit("finalize.after_delete")
    sparse.sync(state)
    failpoints.hit("finalize.after_publish")
    state.promote_deferred()  # e.g. the full listing that vouches for a change journal (tasks/ingest/load/journal.py)
    state.set_meta(DIRTY, "0")
    state.set_meta(integrity.REPAIRING, "[]")  # every source a repair forgot was re-indexed by now (or failed, and said so)
    gate_floor(params, ctx, state)
    return IndexReport(deleted=len(plan.removed), chunks_deleted=len(removed_ids))


def gate_floor(params: Params, ctx: StepContext, state: IndexState) -> None:
    """The answerability gates' similarity floor for this generation (``answerable.record_floor``),
    with the embedder that embedded it; a failure costs the floor, never the run."""

    steps = ctx.project.pipeline(ctx.pipeline).steps if ctx.project is not None else []
    embedder = next((s.resources["embedder"] for s in steps if "embedder" in s.resources), None)
    if not params.gate_floor_pairs or embedder is None:
        return
    try:
        floor = record_floor(state, ctx.project.resource(embedder), params.gate_floor_pairs)
    except Exception as exc:  # noqa: BLE001 - the index is published; only the gate's floor is missing
        ctx.logger.warning("answerability floor not set (%s: %s); gates with min_similarity auto stay open",
                           type(exc).__name__, exc)
        return
    ctx.logger.info("answerability floor %s on generation %d (%d pseudo-queries)", floor.min_similarity,
                    floor.generation, floor.pairs)


def _ensure_dimension(store: DenseStore, state: IndexState, chunks: list[Chunk], ctx: StepContext) -> None:
    """A new embedding model (new dimension) makes every stored vector stale: start the collection over."""
    new = next((len(c.embedding) for c in chunks if c.embedding is not None), None)
    if new is None:
        return
    current = state.get_meta("dimension")
    if current is not None and int(current) != new:
        ctx.logger.warning("embedding dimension changed %s -> %d: rebuilding the collection", current, new)
        state.forget(list(state.sources()))  # the wiped collection held every source
        store.reset()
    state.set_meta("dimension", str(new))
