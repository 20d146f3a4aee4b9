"""The ``load`` stage: read text, markdown, HTML and BEIR-style JSONL files, and every format with a
converter in ``flows/formats`` (PDF page by page, Office, OpenDocument, EPUB, e-mail, RTF), into Documents.

One bad file never stops a run: it is reported with ``ctx.fail`` and skipped, so a corpus of
thousands of files still indexes when a few are broken.

The stage streams a listing (this module) over its parts: ``params`` (what it reads), ``roots`` and
``walk`` (finding files), ``journal`` (a root's change journal), ``known`` (what the index state
says of them), ``files``, ``records`` and ``provenance`` (bytes into Documents) and ``remote``
(other sources' items).
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator

from ragline.flows import failpoints
from ragline.flows.context import StepContext
from ragline.flows.contracts import UNREAD_KEY, Document
from ragline.flows.sources.local import Root, stat_signal
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.load.files import _load_file, _read
from ragline.tasks.ingest.load.journal import JournalListing, watched_folders
from ragline.tasks.ingest.load.known import KnownItems
from ragline.tasks.ingest.load.params import FORMATS, Params
from ragline.tasks.ingest.load.remote import _remote_documents
from ragline.tasks.ingest.load.roots import SourceRoot, _roots
from ragline.tasks.ingest.load.walk import _discover

__all__ = ["FORMATS", "Params", "Root", "SourceRoot", "load", "read", "watched_folders"]

@stage("load", params=Params, produces="documents", kind="ingestion")
def load(params: Params, ctx: StepContext) -> list[Document]:
    """List source files into Documents, reporting and skipping the ones that cannot be read.

    A file whose change signal (size, times, inode) is the one the index state recorded its
    documents with is not opened: its documents are marked listed in the state (the sink plans over
    them in SQL: no Document per unchanged source), or, when their access changed, listed from the
    state to be re-granted. Any other is read,
    hashed and parsed, and (in an engine run) listed without its text (``unread``): the engine reads
    it again batch by batch through ``read`` (only if it changed), so no run holds the corpus's text."""
    known = KnownItems.of(ctx)
    streamed = ctx.project is not None  # run by the engine, which reads listed documents again (``read``)
    roots = _roots(params, ctx.base_dir)
    # what to read goes on the state's work list, QUEUE_BATCH at a time (an engine run with a sink's
    # state): the sink plans over it and the engine takes it a batch at a time; else it is returned
    out = _Listing(known, ctx.step_id, queued=streamed and known.queues)
    unchanged: list[str] = []  # sources marked listed in the state, MARK_BATCH at a time (one commit each)
    journals = {root.location: j for root in roots if (j := JournalListing.of(root, roots, params, ctx, known))}
    verified: dict[str, int] = {}  # journal-listed files found as the index has them: their source ids
    journaled: dict[str, list[tuple[str, str]]] = {location: [] for location in journals}  # what each listed
    discovered = _discover(params, ctx, roots, journals)
    for part, last in _batches(discovered, SIGNAL_BATCH):
        signals = {item: stat_signal(path) for item, path, _ in part}
        same = known.unchanged_acls(signals)
        for item, path, root in part:
            if root.location in journaled:
                journaled[root.location].append((item, path))
            if (kept := known.kept(same.get(item), signals[item], item, path, root, params)) is not None:
                if kept.regrant:
                    out.extend(kept.regrant)  # its access changed: the sink re-grants it
                else:
                    unchanged += kept.ids  # marked listed in the state, not listed here
                    if root.location in journals:
                        verified[item] = len(kept.ids)
                ctx.progress("unchanged", len(kept.ids))
                continue
            fetched = _read(path, item, params.max_bytes, ctx)
            versions = known.versions(item, root, path, params) if fetched else None
            for document in _load_file(path, root, *fetched[:2], params, ctx, versions=versions) if fetched else []:
                document.signal = fetched[2]
                # a JSONL file's records keep their text: reading the file again in each of its batches
                # would cost its size times its batches (a one-file corpus: quadratic)
                out.append(unread(document, roots.index(root), path)
                           if streamed and document.format != "jsonl" else document)
                ctx.progress("documents", 1)
                failpoints.hit("load.after_read")
            if versions is not None and versions.skipped:
                unchanged += versions.skipped  # records whose version is the recorded one: never parsed further
                ctx.progress("unchanged", len(versions.skipped))
        if len(unchanged) >= MARK_BATCH or last:
            known.mark(unchanged)
            unchanged = []
            failpoints.hit("load.after_mark")  # a kill here: the next run's listing starts afresh (``clear_listed``)
    for root in roots:
        if (journal := journals.get(root.location)) is not None:
            journal.settle(root, journaled[root.location], verified)
    for spec in params.paths:
        if getattr(spec, "type", "local") != "local":
            out.extend(_remote_documents(spec, params, ctx, known))
    return out.done()


QUEUE_BATCH = 1_000  # listed documents written to the state's work list per transaction


class _Listing:
    """Where ``load`` puts the documents it lists: the state's work list (``IndexState.queue``),
    a transaction per QUEUE_BATCH, so a full ingest holds one such batch, never the corpus's list;
    without a sink's state (``load`` alone), a list returned sorted by source id."""

    def __init__(self, known: KnownItems, step: str, queued: bool):
        self.known, self.step, self.queued = known, step, queued
        self.documents: list[Document] = []

    def append(self, document: Document) -> None:
        self.documents.append(document)
        if self.queued and len(self.documents) >= QUEUE_BATCH:
            self._flush()

    def extend(self, documents: list[Document]) -> None:
        for document in documents:
            self.append(document)

    def _flush(self) -> None:
        self.known.state.queue(self.known.origin, self.step, self.documents)
        self.documents = []

    def done(self) -> list[Document]:
        if self.queued:
            self._flush()
            return []
        return sorted(self.documents, key=lambda d: d.source_id)


@load.on_read
def read(documents: list[Document], params: Params, ctx: StepContext) -> list[Document]:
    """The full documents of a batch of listed ones: each unread file read again (once per batch),
    its documents kept that the batch names, with the signal listed before this read. A document
    gone from its file since it was listed is reported: the next run indexes what the file holds."""
    roots = _roots(params, ctx.base_dir)
    wanted = {d.source_id for d in documents if not d.text}
    files: dict[str, int] = {}
    out = [d for d in documents if d.text]
    for doc in documents:
        if not doc.text and (where := doc.metadata.get(UNREAD_KEY)):
            index, _, path = str(where).partition(":")
            files.setdefault(path, int(index))
    for path, index in files.items():
        root = roots[index]
        fetched = _read(path, root.source_id(path), params.max_bytes, ctx)
        for document in _load_file(path, root, *fetched[:2], params, ctx) if fetched else []:
            if document.source_id in wanted:
                document.signal = fetched[2]
                out.append(document)
                wanted.discard(document.source_id)
    for source_id in sorted(wanted):
        if not any(f.protects(source_id) for f in ctx.failures):
            ctx.fail(source_id, "changed while this run read it: the next run indexes what it holds then")
    return sorted(out, key=lambda d: d.source_id)


SIGNAL_BATCH = 500  # items whose signals are looked up in the state at once


def _batches(items: Iterator[Any], size: int) -> Iterator[tuple[list[Any], bool]]:
    """``items`` in lists of ``size``, each with whether it is the last (one list looked ahead)."""
    part = list(itertools.islice(items, size))
    while part:
        following = list(itertools.islice(items, size))
        yield part, not following
        part = following


MARK_BATCH = 5_000  # unchanged sources marked listed in the state per transaction


def unread(document: Document, root_index: int, path: str) -> Document:
    """A document as listed: without its text, pages and own metadata (read again in its batch);
    its hash, access and provenance are what planning needs (renames keep the provenance)."""
    provenance = {k: v for k, v in document.metadata.items() if k in ("source", "root", "url", "file_name")}
    return document.model_copy(update={"text": "", "pages": [],
                                       "metadata": {**provenance, UNREAD_KEY: f"{root_index}:{path}"}})
