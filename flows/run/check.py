"""`ragline check [--repair]`: the full comparison of every store with the index state.

For each index an ingestion pipeline writes (its sink's Chroma, BM25 and state resources): SQLite's
quick_check of the state, every Chroma id against the state's, the Chroma count, the embedder key
the vectors were made with, the published BM25 version's generation, settings and ids. One line
per finding; exit 0 when all agree, 1 when something does not (or could not be repaired), 2 for a
bad configuration. ``--repair`` takes the writer lease, repairs what the state allows (deletes
vectors it does not name, rebuilds BM25, forgets sources whose vectors are missing) and then runs
the ingestion pipeline that owns them to re-embed them, and checks again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ragline.flows.contracts import PipelineKind
from ragline.flows.resources.stores import integrity
from ragline.flows.resources.stores.integrity import Finding


@dataclass(frozen=True)
class Index:
    """One index: the resources an ingestion sink writes, and the pipelines that write it."""

    store: str
    sparse: str | None
    state: str
    embedder: str | None
    pipelines: tuple[str, ...]


def indexes(project: Any) -> list[Index]:
    """Every index some ingestion pipeline of the project writes."""
    found: dict[tuple[str, str | None, str], list[str]] = {}
    embedders: dict[tuple[str, str | None, str], str | None] = {}
    for pipeline in project.pipelines.values():
        if pipeline.kind != PipelineKind.INGESTION:
            continue
        sink = pipeline.sink
        if sink is None or "store" not in sink.resources or "state" not in sink.resources:
            continue
        key = (sink.resources["store"], sink.resources.get("sparse"), sink.resources["state"])
        found.setdefault(key, []).append(pipeline.name)
        embedders.setdefault(key, next((s.resources["embedder"] for s in pipeline.steps
                                        if s.stage.name == "embed" and "embedder" in s.resources), None))
    return [Index(*key, embedders[key], tuple(names)) for key, names in found.items()]


def check(project: Any, repair: bool, say: Callable[[str], Any], reindex: Callable[[str], Any]) -> list[Finding]:
    """Compare (and with ``repair``, repair) every index; returns what is still wrong."""
    if not indexes(project):
        raise ValueError(f"{project.path}: no ingestion pipeline writes an index (nothing to check)")
    remaining: list[Finding] = []
    for index in indexes(project):
        store, state = project.resource(index.store), project.resource(index.state)
        sparse = project.resource(index.sparse) if index.sparse else None
        key = project.resource(index.embedder).spec.vectors_key() if index.embedder else None
        if repair and not state.exists():  # a lost state: a new one, which the stores are brought to
            with state.lease("ragline check --repair"):
                say(f"{state.location}: missing, a new one started (the next ingestion run re-indexes every source)")
        findings = integrity.compare(store, sparse, state, full=True, embedder_key=key)
        for finding in findings:
            say(finding.line)
        if not findings or not repair:
            remaining += findings
            continue
        if any(f.repair is None for f in findings):
            remaining += findings
            continue
        with state.lease("ragline check --repair"):
            if integrity.resume(store):  # an interrupted rebuild finished: what is still wrong, if anything
                say(f"finished an interrupted rebuild of {store.location}")
                findings = integrity.compare(store, sparse, state, full=True, embedder_key=key)
            integrity.repair(findings, store, sparse, state, say)
        if any(f.repair in ("reconcile", "reembed_all", "reindex") for f in findings):
            for pipeline in index.pipelines:
                say(f"re-indexing with pipeline '{pipeline}'")
                reindex(pipeline)
        after = integrity.compare(store, sparse, state, full=True, embedder_key=key)
        for finding in after:
            say(f"still: {finding.line}")
        remaining += after
        if not after:
            say(f"repaired: {project.resource(index.store).location} and its BM25 index agree with the state again")
    return remaining
