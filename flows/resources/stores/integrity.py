"""Do the stores hold what the index state says? Findings, and repairs from the state and the sources.

The state record is the truth: Chroma must hold a vector for every chunk it names and nothing
else, and the published BM25 version must be the state's chunks. A store deleted, truncated or
overwritten behind ragline's back used to be noticed by nobody (dense retrieval silently gone,
every ingestion run "unchanged"). Three depths:

- ``compare(..., full=False)``: counts and a random sample of ids (each ingestion run, under its
  writer lease; milliseconds on 50k chunks, never a full scan). An embedded store whose files are
  exactly as they were after the last such check that found nothing (every file's size, mtime and
  inode), while the state is at the same generation and chunk count, is not opened at all: opening
  it imports Chroma (~1 s of CPU, most of an unchanged run's), and files that did not change hold
  what they held. A store deleted, replaced, truncated or written by anyone since changes them;
- ``compare(..., full=True)``: every id, SQLite's quick_check, the embedder key (``ragline check``);
- ``repair``: what can be rebuilt is: vectors the state names but Chroma lacks are re-embedded
  (their sources are forgotten, so the ingestion plan re-indexes them), vectors it does not name are
  deleted, BM25 is rebuilt. A damaged state file or an unreadable Chroma store cannot be repaired in
  place: the finding says which file to move aside.

Only writers repair (ingestion, ``ragline check --repair``); queries only read (``state.reader``,
``ChromaStore._open(create=False)``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from ragline.flows.resources.stores.chroma import ChromaUnavailable, space_scores
from ragline.flows.resources.stores.state import REMEDY, IndexState, StorageError, StoreDamaged, StoreMissing
from ragline.flows.resources.stores.protocols import DenseStore, SparseIndex

SAMPLE = 32  # chunk ids checked in Chroma per ingestion run
REPAIRING = "repairing"  # state meta: JSON list of the sources a repair forgot that no finished run re-indexed yet
VERIFIED = "verified_store"  # state meta: the embedded store's files, generation and chunks when last found sound
Repair = Literal["reconcile", "reembed_all", "rebuild_bm25", "reindex"]
SELF_QUERIES = 32  # stored vectors ``ragline check`` searches for: each must find itself (or its exact twin)


@dataclass(frozen=True)
class Finding:
    """One disagreement between a store and the state, and how it is repaired (None: by hand)."""

    store: Literal["state", "chroma", "milvus", "bm25"]
    message: str  # one line naming the store and its path
    repair: Repair | None
    sources: tuple[str, ...] = ()  # "reindex": the sources to re-embed

    @property
    def line(self) -> str:
        how = {"reconcile": "re-embed the missing sources and delete the vectors the state does not name",
               "reembed_all": "re-embed every source", "rebuild_bm25": "rebuild BM25 from the index state",
               "reindex": f"re-embed their {len(self.sources)} sources",
               None: "cannot be repaired in place"}[self.repair]
        return f"{self.store}: {self.message} ({how})"


def resume(store: DenseStore) -> bool:
    """Let the store finish an operation of its own that a kill interrupted (milvus: a rebuild whose
    rows were being restored from their whole copy), before it is compared with the state: compared
    first, the rows not yet restored would read as lost and be re-embedded. True if it finished one.
    The caller holds the writer lease."""
    finish = getattr(store, "resume", None)
    return bool(finish()) if finish is not None else False


def compare(store: DenseStore, sparse: SparseIndex | None, state: IndexState, *, full: bool = False,
            embedder_key: str | None = None, writer: bool = False) -> list[Finding]:
    """Every disagreement found; cheap unless ``full``. A damaged state stops the comparison.
    ``writer`` (the ingestion run, under its lease): an embedded store whose files did not change
    since the last sound check is not opened, and a sound check records its files in the state."""
    try:
        chunks = state.counts()[1]
        if full and (problem := state.quick_check()):
            return [Finding("state", str(state.damaged(problem)), None)]
    except StoreMissing:
        chunks = 0
    except StoreDamaged as exc:
        return [Finding("state", str(exc), None)]
    verified = _verified(store, state, chunks) if writer and not full else None
    if verified is not None and verified == state.get_meta(VERIFIED):
        findings: list[Finding] = []  # its files are as they were when last found sound: not opened
    else:
        findings = _chroma(store, state, chunks, full, embedder_key)
        if writer and not findings and not full and (after := _verified(store, state, chunks)) is not None:
            state.set_meta(VERIFIED, after)  # read after the checks: opening the store may write its files
    if sparse is not None:
        findings += _bm25(sparse, state, chunks, full)
    return findings


def _chroma(store: DenseStore, state: IndexState, chunks: int, full: bool,
            embedder_key: str | None) -> list[Finding]:
    kind = store.type_name()  # chroma or milvus: the store the finding names
    try:
        count = store.count()
    except StoreMissing as exc:
        return [Finding(kind, f"{exc} while the index state holds {chunks} chunks".replace(f"; {REMEDY}", ""),
                        "reconcile")] if chunks else []
    except (ChromaUnavailable, StorageError):
        raise  # a server that is down or a full disk is not damage: the run fails saying so
    except Exception as exc:  # noqa: BLE001 - e.g. "database disk image is malformed" from Chroma's own SQLite
        if store.spec.host:
            raise
        return [Finding(kind, f"{store.location} is unreadable ({type(exc).__name__}: {exc}): move it aside "
                                  f"(mv {store.path} {store.path}.damaged) and run `ragline index` to re-embed "
                                  f"every source", None)]
    if count != chunks:
        return [Finding(kind, f"{store.location} holds {count} vectors, the index state names {chunks} chunks",
                        "reconcile")]
    findings = []
    if full:
        stored, expected = store.all_ids(), _state_ids(state)
        if stored != expected:
            findings.append(Finding(kind, f"{store.location} lacks {len(expected - stored)} of the state's "
                                              f"chunks and holds {len(stored - expected)} it does not name",
                                    "reconcile"))
    elif chunks:
        sample = state.sample_chunk_ids(SAMPLE)
        absent = set(sample) - store.present(sample)
        if absent:
            findings.append(Finding(kind, f"{store.location} lacks {len(absent)} of {len(sample)} sampled chunks "
                                              f"the index state names", "reconcile"))
    if full and count:
        findings += _unreachable(store, state)
    if full and embedder_key and count:
        stored_key = store.stored_embedder()
        if stored_key not in (None, embedder_key):
            findings.append(Finding(kind, f"{store.location} holds vectors of embedder settings {stored_key}, the "
                                              f"ingestion pipeline embeds with {embedder_key}", "reembed_all"))
    return findings


def _unreachable(store: DenseStore, state: IndexState) -> list[Finding]:
    """A sample of stored vectors, each searched for: a vector that is stored but that no search
    finds (a damaged HNSW graph) is invisible to dense retrieval while every count agrees. A search
    that finds an exact twin (a duplicate passage) first counts as finding it."""
    sample = state.sample_chunk_ids(SELF_QUERIES)
    vectors = store.vectors(sample)
    ids = [cid for cid in sample if cid in vectors]
    if not ids:
        return []
    import numpy as np

    queries = np.asarray([vectors[cid] for cid in ids], dtype=np.float32)
    hits = store.query(queries, 10)
    own = [float(space_scores(store.spec.space, q, q[None])[0]) for q in queries]  # a vector's score for itself
    lost = [cid for cid, found, best in zip(ids, hits, own)
            if cid not in {p.chunk_id for p in found} and not (found and found[0].score >= best - 1e-4)]
    if not lost:
        return []
    sources = sorted({meta["source_id"] for meta in state.chunks_by_id(lost).values()})
    return [Finding(store.type_name(), f"{store.location}: {len(lost)} of {len(ids)} sampled vectors are stored but "
                                       f"no search finds them (a damaged vector index)", "reindex", tuple(sources))]


def _verified(store: DenseStore, state: IndexState, chunks: int) -> str | None:
    """What a sound check of an embedded Chroma store vouches for: its files (path, size, mtime,
    inode each), the state's generation and chunk count. None where that says nothing: a served
    store (``host``) or another engine, or a folder with no files."""
    if store.type_name() != "chroma" or store.spec.host:
        return None
    files = _files(store.path)
    if not files:
        return None
    digest = hashlib.sha256("\n".join(files).encode("utf-8", "surrogateescape")).hexdigest()
    return json.dumps({"files": digest, "generation": state.generation, "chunks": chunks})


def _files(folder: Path) -> list[str]:
    lines = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                stat = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            lines.append(f"{os.path.relpath(path, folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}")
    return lines


def _state_ids(state: IndexState) -> set[str]:
    try:
        return state.chunk_ids()
    except StoreMissing:
        return set()


def _bm25(sparse: SparseIndex, state: IndexState, chunks: int, full: bool) -> list[Finding]:
    problem = sparse.problem(state)
    if problem is not None:
        # a milvus collection's schema holds its analyzer: other settings rebuild it (every source re-indexed)
        repair = sparse.repair_for(problem) if hasattr(sparse, "repair_for") else "rebuild_bm25"
        return [Finding(sparse.type_name(), problem.replace(f"; {REMEDY} to rebuild BM25 from the index state", ""),
                        repair)]
    if not full:
        return []
    published = sparse.published_version()
    generation = _generation(state)
    if published is None:
        return [Finding("bm25", f"{sparse.location}: nothing is published, the index state is at generation "
                                f"{generation}", "rebuild_bm25")] if generation else []
    findings = []
    if published["generation"] != generation:
        findings.append(Finding("bm25", f"{sparse.location}: the published version is generation "
                                        f"{published['generation']}, the index state's is {generation}",
                                "rebuild_bm25"))
    elif set(sparse.published_ids()) != _state_ids(state):
        findings.append(Finding("bm25", f"{sparse.location}: the published version's chunk ids differ from the "
                                        f"index state's", "rebuild_bm25"))
    if published["settings"] != sparse.settings:
        findings.append(Finding("bm25", f"{sparse.location}: the published version was built with other settings "
                                        f"than pipelines.yaml (and its tuned overlay) set", "rebuild_bm25"))
    return findings


def _generation(state: IndexState) -> int:
    try:
        return state.generation
    except StoreMissing:
        return 0


def repair(findings: list[Finding], store: DenseStore, sparse: SparseIndex | None, state: IndexState,
           say: Callable[[str], Any]) -> set[str]:
    """Repair what the findings allow, saying one line each; raise StoreDamaged naming the first
    finding that needs a hand (a damaged state file, an unreadable Chroma store). Returns the
    sources forgotten, which the ingestion run re-embeds. The caller holds the writer lease."""
    by_hand = [f for f in findings if f.repair is None]
    if by_hand:
        raise StoreDamaged(by_hand[0].message)
    for finding in findings:
        say(f"repairing {finding.line}")
    actions = {f.repair for f in findings}
    forgotten: set[str] = set()
    if "reembed_all" in actions:
        forgotten = set(state.sources())
        state.forget(sorted(forgotten))
        store.reset()
    elif "reconcile" in actions:
        forgotten = reconcile(store, state, say)
    lost = {source for f in findings if f.repair == "reindex" for source in f.sources} - forgotten
    if lost:  # (none after reembed_all: every source is forgotten already)
        store.delete(sorted(state.chunk_ids(sorted(lost))))
        state.forget(sorted(lost))
        forgotten |= lost
    mark_repairing(state, forgotten)
    if sparse is not None and ("rebuild_bm25" in actions or forgotten):
        sparse.sync(state, force=True)  # (BM25 without the forgotten ones until this run re-indexes them)
    return forgotten


def mark_repairing(state: IndexState, sources: set[str]) -> None:
    """Remember sources a repair forgot, so the run that re-indexes them counts them as repaired
    (a killed run's too); a finished ingestion run clears the list."""
    if sources:
        state.set_meta(REPAIRING, json.dumps(sorted(sources | repairing(state))))


def repairing(state: IndexState) -> set[str]:
    """The sources a repair forgot that no finished run has re-indexed yet."""
    return set(json.loads(state.get_meta(REPAIRING) or "[]"))


def reconcile(store: DenseStore, state: IndexState, say: Callable[[str], Any] | None = None) -> set[str]:
    """Make Chroma hold exactly the chunks the state names: delete the vectors it does not name, and
    forget the sources whose vectors are missing, so the ingestion plan re-embeds them. Returns
    the sources forgotten. Full scan: run after a crash, on a finding, or on request."""
    say = say or logging.getLogger("ragline.integrity").warning
    stored = store.all_ids()
    expected = _state_ids(state)
    extra = stored - expected
    sources: set[str] = set()
    if extra:
        say(f"removing {len(extra)} vectors the index state does not name (an interrupted run, or a lost state)")
        sources = _chunkless(store, state, extra)
        store.delete(sorted(extra))
    missing = expected - stored
    if missing:
        sources |= {meta["source_id"] for meta in state.chunks_by_id(sorted(missing)).values()}
    if sources:
        say(f"re-indexing {len(sources)} sources whose vectors are missing")
        state.forget(sources)
    return sources


def _chunkless(store: DenseStore, state: IndexState, extra: set[str]) -> set[str]:
    """The sources the state still lists although it lost the chunk rows of ``extra`` (vectors it
    does not name, whose metadata names those sources): listed as unchanged, they would stay out of
    every retriever for good once their vectors are removed."""
    owners = {meta.get("source_id") for meta in store.metadatas(sorted(extra)).values()} - {None}
    try:
        return set(state.known(sorted(owners))) if owners else set()
    except StoreMissing:
        return set()
