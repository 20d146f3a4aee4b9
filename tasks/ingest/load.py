"""The ``load`` stage: read text, markdown, HTML and BEIR-style JSONL files, and every format with a
converter in ``flows/formats`` (PDF page by page, Office, OpenDocument, EPUB, e-mail, RTF), into Documents.

One bad file never stops a run: it is reported with ``ctx.fail`` and skipped, so a corpus of
thousands of files still indexes when a few are broken.
"""
from __future__ import annotations

import bisect
import codecs
import fnmatch
import functools
import glob
import hashlib
import html
import itertools
import json
import os
import posixpath
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import quote

from pydantic import BaseModel, Field, field_validator, model_validator
from ragline.flows import access, failpoints, formats, settings
from ragline.flows.context import StepContext
from ragline.flows.contracts import UNREAD_KEY, Document, Metadata, content_hash
from ragline.flows.sources import (
    DocumentSource,
    Fetched,
    ItemCache,
    SourceError,
    SourceSpec,
    cache_folder,
    source_types,
)
from ragline.flows.resources.stores.integrity import repairing
from ragline.flows.sources.journal import Journal, journal_file
from ragline.flows.sources.local import NonEmpty, Root, read_file, stat_signal
from ragline.flows.spec.registry import stage

__all__ = ["Params", "Root", "load", "watched_folders"]

# text formats read here; every other format is converted by its `ragline.formats` entry point
FORMATS = {".html": "html", ".htm": "html", ".md": "markdown", ".markdown": "markdown",
           ".txt": "text", ".jsonl": "jsonl"}
MEDIA_FORMATS = {"text/html": "html", "application/xhtml+xml": "html", "text/markdown": "markdown",
                 "text/plain": "text"}
# a converted format a web page can arrive as without its suffix in the URL (its Content-Type says it)
MEDIA_CONVERTED = {"application/pdf": ".pdf"}
# the built-in converters taken from folders by default; images (.png, .jpg, .tif: OCR) only when included
CONVERTED = (".pdf", ".docx", ".pptx", ".xlsx", ".odt", ".epub", ".eml", ".rtf")
IMAGES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff"})
SNIFF_BYTES = 8192
GLOB_CHARS = frozenset("*?[")
JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}

MD_HEADING = re.compile(r"^#[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")
HTML_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.I | re.S)
HTML_H1 = re.compile(r"<h1\b[^>]*>(.*?)</h1>", re.I | re.S)
HTML_TAG = re.compile(r"<[^>]+>")
# metadata keys the loader (or the chunker, or the store) sets: a record's own metadata cannot spoof
# where a document comes from or links to (its "path" or "url" would become the chat page's link)
LOADER_KEYS = frozenset({"source", "root", "url", "path", "format", "modified", "file_name", "doc_id", "chunk",
                         "source_id", "title", "ordinal", "pages", "page_start", "page_end", "section",
                         "attachment"})


class Params(BaseModel):
    """Where the source files are and how to read them."""

    model_config = {"extra": "forbid"}

    paths: list[SourceSpec] = Field(..., min_length=1,
                                               description="folders (walked recursively), files or glob patterns; "
                                                           "each may be {path, name, url_prefix, follow_links, "
                                                           "hard_links}, or "
                                                           "a root of another type: {type: fsspec, url: ...}, "
                                                           "{type: web, start: [...]}")
    follow_links: bool = Field(False, description="index symbolic links whose target is outside every root of this "
                                                  "step (off: they are skipped with a reason)")
    hard_links: bool = Field(False, description="index files with more than one hard link (off: they are skipped "
                                                "with a reason, since the same bytes may be a file outside every "
                                                "root, as a symbolic link's may)")
    include: list[NonEmpty] = Field(
        ["*.html", "*.htm", "*.md", "*.markdown", "*.txt", "*.jsonl", *(f"*{ext}" for ext in CONVERTED)],
        min_length=1,
        description="file-name patterns taken from folders and globs (files named directly are always read)")
    exclude: list[NonEmpty] = Field(
        [], description="patterns of paths to skip, matched against the file name and the end of the path, "
                        "e.g. '**/.git/**', 'drafts/*'")
    max_bytes: int = Field(50_000_000, ge=1, le=2_000_000_000,
                           description="larger files are reported as failures and skipped")
    encoding: NonEmpty = Field("utf-8", description="text encoding of non-PDF files")
    jsonl_id_field: NonEmpty = Field("_id", description="JSONL record field holding the document id")
    jsonl_text_fields: list[NonEmpty] = Field(["text"], min_length=1,
                                              description="JSONL record fields joined into the document text")
    jsonl_title_field: NonEmpty = Field("title", description="JSONL record field holding the title")
    jsonl_version_field: NonEmpty | None = Field(
        None, description="JSONL record field holding the record's own version (e.g. 'updated_at': a string or "
                          "number): in a changed file, a record whose version is the one it was indexed with is "
                          "skipped without hashing or indexing it, even if its text changed; a record without the "
                          "field is hashed as usual")
    ocr: bool = Field(True, description="read PDF pages without a text layer (scans) and images (.png, .jpg, "
                                        ".tif; add them to `include`) by OCR, with Debian's tesseract-ocr; "
                                        "without it they are reported with the reason")
    ocr_max_pages: int = Field(50, ge=0, le=100_000, description="pages OCR reads per file at most (a few "
                                                                  "seconds each); the rest are reported")
    ocr_languages: NonEmpty = Field("eng", pattern=r"^[A-Za-z_]+(\+[A-Za-z_]+)*$",
                                    description="tesseract language codes, e.g. 'eng+deu'")
    full_listing_hours: float = Field(
        24.0, ge=0, le=8760,
        description="a folder root that `ragline serve` watches is listed from its change journal (the paths "
                    "that changed) instead of in full, for at most this long after its last full listing; "
                    "0: always list in full")
    acl_field: NonEmpty | None = Field(None, description="a document's own field naming the groups allowed to "
                                                          "read it (a list or 'a,b'): a JSONL record's field (or "
                                                          "one of its 'metadata'), a converted file's metadata; it "
                                                          "overrides the root's `access` rules. Not part of the "
                                                          "content hash: a change re-grants without re-embedding")

    @model_validator(mode="after")
    def _version_field_apart(self) -> "Params":
        field = self.jsonl_version_field
        if field is not None and field in (self.jsonl_id_field, *self.jsonl_text_fields):
            role = "id field" if field == self.jsonl_id_field else "a text field"
            raise ValueError(f"jsonl_version_field {field!r} is the {role}: a record's version must be a field of "
                             f"its own (e.g. 'updated_at')")
        return self

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        try:  # an unknown or non-text codec fails at compile time, not mid-run
            "".encode(value)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        return value


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

    def __init__(self, known: "KnownItems", step: str, queued: bool):
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


@dataclass
class KnownItems:
    """What the index state says of listed items: those whose signal is the one their documents were
    recorded with (under this pipeline and fingerprint), and which failed last run (read again, so
    their failures are reported again). Empty without a state (a first run, or ``load`` alone)."""

    state: Any = None
    origin: str = ""
    fingerprint: str = ""
    failed: tuple[str, ...] = ()
    queues: bool = False  # the sink takes a work list from its state (``IndexState.queue``, ``on_pending``)

    @classmethod
    def of(cls, ctx: StepContext) -> "KnownItems":
        sink = _sink(ctx)
        state = ctx.project.resource(sink.resources["state"]) if sink is not None else None
        if state is None or not state.exists():
            return cls()
        failed = json.loads(state.get_meta(f"failures:{ctx.pipeline}") or "{}")
        return cls(state, ctx.pipeline, ctx.fingerprint, tuple(sorted(failed)), sink.stage.pending is not None)

    def unchanged(self, signals: dict[str, str | None]) -> dict[str, list]:
        if self.state is None:
            return {}
        return self.state.unchanged_items(self.origin, self.fingerprint,
                                          {k: v for k, v in signals.items() if v is not None})

    def unchanged_acls(self, signals: dict[str, str | None]) -> dict[str, list[tuple[str, str, str | None]]]:
        if self.state is None:
            return {}
        return self.state.unchanged_acls(self.origin, self.fingerprint,
                                         {k: v for k, v in signals.items() if v is not None})

    def kept(self, rows: list[tuple[str, str, str | None]] | None, signal: str | None, item: str, path: str,
             root: "SourceRoot", params: Params) -> "Kept | None":
        """A local file that need not be read (``listed``'s rules), as its source ids, with its
        documents listed only when their access changed (the sink re-grants them); else None.
        ``rows``: ``IndexState.unchanged_acls``'s. Its groups are compared as the state's text
        first, so an unchanged file costs no Document and no JSON decoding."""
        if not rows or signal is None or self._failed(item):
            return None
        fallback = tuple(root.groups(path)) if root.access else ()
        own_field = params.acl_field is not None
        if own_field and (fallback or any(r[2] is None for r in rows)):
            return None  # whether a document has its own groups or the root's is only in its content
        ids = [r[0] for r in rows]
        want = _acl_text(fallback)
        for _, _, acl in rows:
            if acl == want:  # the recorded text of these very groups
                continue
            stored = None if acl is None else tuple(json.loads(acl))
            if stored is None or stored != tuple(sorted(set(stored if own_field else fallback))):
                return Kept(ids, self.listed([(r[0], r[1], "", "", None if r[2] is None else tuple(json.loads(r[2])))
                                              for r in rows], signal, path, root, fallback, params) or [])
        return Kept(ids, [])

    def versions(self, item: str, root: "SourceRoot", path: str, params: Params) -> "RecordVersions | None":
        """What a JSONL file's records were indexed with, when records carry their own version
        (``jsonl_version_field``) and the file did not fail last run: see ``RecordVersions``."""
        if (params.jsonl_version_field is None or self.state is None or FORMATS.get(Path(path).suffix.lower())
                != "jsonl" or self._failed(item)):
            return None
        return RecordVersions(self.state.item_sources(self.origin, self.fingerprint, item), root.groups(path))

    def mark(self, source_ids: list[str]) -> None:
        """Tell the state these sources are listed unchanged (the sink plans over them in SQL)."""
        if self.state is not None and source_ids:
            self.state.mark_listed(self.origin, source_ids)

    def listed(self, rows: list | None, signal: str | None, path: str, root: SourceRoot,
               groups: tuple[str, ...] | None, params: Params) -> list[Document] | None:
        """The item's documents from the state when it need not be read, else None: its signal is
        unchanged, it did not fail last run, and its access is known without reading it (its root's
        rules, or its own ``acl_field`` when the root has no rules)."""
        if not rows or signal is None or self._failed(root.source_id(path)):
            return None
        fallback = root.groups(path) if groups is None else groups
        own_field = params.acl_field is not None
        if own_field and (fallback or any(r[4] is None for r in rows)):
            return None  # whether a document has its own groups or the root's is only in its content
        # as little as planning needs (an unchanged source is neither indexed nor renamed): a run lists
        # every unchanged document this way, so its size is what an unchanged run's memory grows by
        return [Document(source_id=sid, text="", content_hash=digest, signal=signal,
                         groups=list(stored if own_field else fallback))
                for sid, digest, _, _, stored in rows]

    def _failed(self, item: str) -> bool:
        at = bisect.bisect_left(self.failed, item)
        return at < len(self.failed) and (self.failed[at] == item or self.failed[at].startswith((item + "#", item + ":")))


@dataclass
class Kept:
    """An unchanged local file: its sources' ids, and its documents when their access changed."""

    ids: list[str]
    regrant: list[Document]


@functools.lru_cache(maxsize=256)
def _acl_text(groups: tuple[str, ...]) -> str:
    """Groups as the index state records them (``flows/resources/stores/state.py``'s ``_acl_text``)."""
    return json.dumps(sorted(set(groups)))


@dataclass
class RecordVersions:
    """A changed JSONL file's records as indexed (source id -> content hash, groups; under this
    pipeline and fingerprint): a record whose version hash and groups are the recorded ones is
    skipped (``skipped``: marked listed, no Document); the rest are read as usual."""

    stored: dict[str, tuple[str, tuple[str, ...] | None]]
    fallback: tuple[str, ...]
    skipped: list[str] = field(default_factory=list)

    def unchanged(self, source_id: str, digest: str, record: dict[str, Any], params: Params) -> bool:
        known = self.stored.get(source_id)
        if known is None or known[0] != digest or known[1] is None:
            return False
        own, _ = _record_groups(record, params)
        try:
            groups = self.fallback if own is None else access.parse_groups(own, "")
        except ValueError:
            return False  # read as usual, which reports it
        if tuple(sorted(set(groups))) != known[1]:
            return False  # its access changed: read, so the sink re-grants it
        self.skipped.append(source_id)
        return True


def _sink(ctx: StepContext) -> Any:
    """This pipeline's ingestion sink with an index state, when it has one."""
    if ctx.project is None:
        return None
    try:
        sink = ctx.project.pipeline(ctx.pipeline).sink
    except (KeyError, ValueError):
        return None
    return sink if sink is not None and "state" in sink.resources else None


# --- finding files -------------------------------------------------------------------------

@dataclass(frozen=True)
class SourceRoot:
    """A listed root as ``load`` resolved it. Its sources are identified as '<name>/<path below
    the root>' and shown that way (or linked below ``url_prefix``): never by the server's absolute
    paths, so a moved project keeps its ids and no response shows the server's folders."""

    given: str
    location: str  # absolute posix path: the folder, the file, or a glob's fixed folder
    name: str  # "." for the pipelines file's own folder
    pattern: str = ""  # a glob's pattern below ``location``
    url_prefix: str | None = None
    follow_links: bool = False
    hard_links: bool = False  # files with more than one hard link are indexed (else skipped with the reason)
    is_file: bool = False
    remote: bool = False  # ``location`` is a URL and paths are '<location>/<key>'
    access: tuple[access.AccessRule, ...] = ()  # the root's access rules (flows/access.py)

    def groups(self, path: str) -> tuple[str, ...]:
        """Who may read the source at ``path``: the first access rule matching its path below the root."""
        return access.rule_groups(list(self.access), self.below(path)) or ()

    def below(self, path: str) -> str:
        if self.remote:
            return path[len(self.location) + 1:] if path.startswith(self.location + "/") else path
        if self.is_file:
            return posixpath.basename(path)
        prefix = self.location.rstrip("/") + "/"
        rest = path[len(prefix):]
        wrapped = f"/{rest}/"
        if path.startswith(prefix) and rest and "//" not in wrapped and "/./" not in wrapped and "/../" not in wrapped:
            return rest  # a walked path below the root, already normal: relpath's result without its cost
        return posixpath.relpath(path, self.location)

    def source_id(self, path: str) -> str:
        if self.is_file:
            return self.name
        below = self.below(path)
        return below if self.name == "." else self.name if below == "." else f"{self.name}/{below}"

    def url(self, path: str) -> str | None:
        return self.url_prefix + quote(self.below(path)) if self.url_prefix else None

    @property
    def covered(self) -> str:
        """The root in source-id terms: its name, or its glob pattern below its name."""
        if not self.pattern:
            return self.name
        return self.pattern if self.name == "." else f"{self.name}/{self.pattern}"


def _roots(params: Params, base_dir: str) -> list[SourceRoot]:
    base = Path(os.path.abspath(base_dir)).as_posix()
    roots = []
    for entry in params.paths:
        if not isinstance(entry, Root):
            continue  # another type's root: ``_remote_documents``
        spec = entry
        # relative to pipelines.yaml's folder (the CLI passes absolute paths for its arguments)
        expanded = Path(os.path.abspath(os.path.join(base_dir, os.path.expanduser(spec.path)))).as_posix()
        location, pattern = expanded, ""
        if GLOB_CHARS & set(spec.path):
            location = _glob_base(expanded)
            pattern = expanded[len(location):].lstrip("/")
        follow = params.follow_links if spec.follow_links is None else spec.follow_links
        hard = params.hard_links if spec.hard_links is None else spec.hard_links
        url = spec.url_prefix if spec.url_prefix is None or spec.url_prefix.endswith("/") else spec.url_prefix + "/"
        roots.append(SourceRoot(spec.path, location, spec.name or _default_name(location, base), pattern, url,
                                follow, hard, is_file=not pattern and os.path.isfile(expanded),
                                access=tuple(spec.access)))
    return roots


def _default_name(location: str, base: str) -> str:
    """The root's path relative to the pipelines file's folder; outside it, the folder's own name."""
    if location == base:
        return "."
    if location.startswith(base.rstrip("/") + "/"):
        return posixpath.relpath(location, base)
    return posixpath.basename(location.rstrip("/")) or "root"


def _discover(params: Params, ctx: StepContext, roots: list[SourceRoot],
              journals: dict[str, "JournalListing"] | None = None) -> Iterator[tuple[str, str, SourceRoot]]:
    """The files of every root, each once, as (source id, path, root): streamed root by root in walk
    order, so a listing holds no list of the corpus's files; roots that overlap (one inside another)
    are collected first, each file under the outermost root that lists it, in source id order. A
    root with a trusted change journal (``journals``, by its location) gives only the files below the
    paths that changed (``JournalListing``).

    Every root listed completely is declared with ``ctx.cover``; one that cannot be reached is a
    root failure (the run deletes nothing), and an unreadable subfolder protects what is under it.
    A file whose real path is outside every root (a symbolic link to /etc/passwd) is skipped with
    its reason unless its root follows links.
    """
    inside = [os.path.realpath(r.location) for r in roots]
    named: dict[str, SourceRoot] = {}
    for root in roots:
        other = named.setdefault(root.name, root)
        if other.location != root.location:
            ctx.fail(root.covered, f"root {root.given!r} has the same name {root.name!r} as {other.given!r}: "
                                   f"give one of them a `name`", root=True)
    listed = [root for root in roots if named[root.name].location == root.location]
    found = (_root_paths(root, params, ctx, inside, (journals or {}).get(root.location)) for root in listed)
    if not _overlapping(listed):
        for root, paths in zip(listed, found):
            yield from ((root.source_id(path), path, root) for path in paths)
        return
    outermost: dict[str, SourceRoot] = {}
    for root, paths in zip(listed, found):
        for path in paths:
            if path not in outermost or len(root.location) < len(outermost[path].location):
                outermost[path] = root
    yield from sorted((root.source_id(path), path, root) for path, root in outermost.items())


def _root_paths(root: SourceRoot, params: Params, ctx: StepContext, inside: list[str],
                journal: "JournalListing | None") -> Iterator[str]:
    """The paths a root lists (from its journal when trusted), less links that lead out of every root."""
    files = journal.files(root, params, ctx) if journal is not None else _root_files(root, params, ctx)
    for path, link in files:
        if not root.follow_links and _may_escape(path, root, link) and not _within(os.path.realpath(path), inside):
            ctx.fail(root.source_id(path), "symbolic link to a file outside every source root: skipped (set "
                                           "follow_links: true on the root to index it)", skipped=True)
            continue
        if not root.hard_links and not root.is_file and (links := _hard_links(path)) > 1:
            ctx.fail(root.source_id(path), f"file has {links} hard links (its content may be a file outside every "
                                           f"source root): skipped (set hard_links: true on the root to index "
                                           f"it)", skipped=True)
            continue
        yield path


def _hard_links(path: str) -> int:
    """How many directory entries name the file's content (st_nlink; 1 for what cannot be read: its
    read reports that). A hard link is no symbolic link: nothing but the count shows that the same
    bytes are also a file elsewhere, perhaps outside every root."""
    try:
        info = os.stat(path)
    except OSError:
        return 1
    return info.st_nlink if stat.S_ISREG(info.st_mode) else 1


def _overlapping(roots: list[SourceRoot]) -> bool:
    """Whether a root lies inside another (or is the same place): then a file may be listed twice."""
    real = [os.path.realpath(root.location) for root in roots]
    return any(_nested(a, b) or _nested(b, a) for a, b in itertools.combinations(real, 2))


JOURNAL_KEY = "journal"  # state meta "journal:<pipeline>:<root>": the full listing that vouches for a journal


@dataclass
class JournalListing:
    """A folder root listed from its change journal (flows/sources/journal.py) instead of walked:
    the files below the paths that changed, and those that failed last run (read again, so their
    failures are reported again). The index state is told which items were examined
    (``IndexState.mark_journaled``): the root's other sources count as listed unchanged."""

    journal: Journal
    changes: dict[str, int]  # changed path (as the watcher saw it: below the root's real path) -> its number
    watched: str  # the root's real path, which the watcher's paths start with
    again: list[str]  # paths of last run's failures under the root
    state: Any = None
    origin: str = ""

    def local(self, path: str, root: SourceRoot) -> str:
        """A watcher's path as the root's walk names it (below the root's path as given)."""
        return root.location.rstrip("/") + path[len(self.watched.rstrip("/")):]

    @classmethod
    def of(cls, root: SourceRoot, roots: list[SourceRoot], params: Params, ctx: StepContext,
           known: "KnownItems") -> "JournalListing | None":
        """The root's journal when it can be trusted (the module's docstring says when), else None:
        the root is then listed in full, and a full listing that starts once the journal's watcher
        is ready vouches for the journal from the end of its run (``IndexState.defer_meta``)."""
        if (ctx.project is None or known.state is None or not _journaled(root, roots, params)
                or _unreachable(root.location) is not None):
            return None
        if repairing(known.state):  # a repair forgot sources whose files did not change: only a full listing finds them
            return None
        data_dir = Path(ctx.project.data_dir or ctx.project.base_dir).resolve()
        journal = Journal(journal_file(data_dir, ctx.pipeline, root.location))
        watch = journal.watch()
        now = time.time()
        if watch is None or not watch.live(now) or watch.root != os.path.realpath(root.location):
            return None
        key = f"{JOURNAL_KEY}:{ctx.pipeline}:{root.covered}"
        digest = _listing_digest(root, params, ctx.fingerprint)
        base = json.loads(known.state.get_meta(key) or "{}")
        if (base.get("epoch") == watch.epoch and base.get("digest") == digest
                and now - base.get("at", 0) < params.full_listing_hours * 3600):
            again = [_path_of(sid, root) for sid in known.failed if _under_root(sid, root)]
            changes = {p: n for p, n in journal.changes().items() if _nested(p, watch.root) and p != watch.root}
            return cls(journal, changes, watch.root, again, known.state, known.origin)
        known.state.defer_meta(key, json.dumps({"epoch": watch.epoch, "digest": digest, "at": now}))
        return None

    def files(self, root: SourceRoot, params: Params, ctx: StepContext) -> list[tuple[str, bool | None]]:
        """The files below the changed paths, as the root's walk would list them (its include and
        exclude patterns, its folder links); the examined items are marked in the state."""
        found: dict[str, bool | None] = {}
        examined = []
        for path in [*(self.local(p, root) for p in self.changes), *self.again]:
            examined.append(root.source_id(path))
            if not _walked(path, root, params):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                found.update(_folder_files(path, root, params, ctx))
            elif os.path.lexists(path) and _matches(path, params.include) and not _matches(path, params.exclude):
                found[path] = os.path.islink(path)
        self.state.mark_journaled(self.origin, root.covered, examined)
        ctx.cover("folder", root.covered)
        return sorted(found.items())

    def settle(self, root: SourceRoot, listed: list[tuple[str, str]], verified: dict[str, int]) -> None:
        """Drop from the journal the changed paths the index agrees with: every file below them was
        found as recorded, and nothing else is indexed below them (a gone file's sources deleted)."""
        done: dict[str, int] = {}
        items = sorted(i for i, _ in listed)
        for path, seq in self.changes.items():
            item = root.source_id(self.local(path, root))
            below = items[bisect.bisect_left(items, item):bisect.bisect_left(items, item + "0")]
            below = [i for i in below if i == item or i.startswith(item + "/")]
            if all(i in verified for i in below) and \
                    self.state.count_sources(self.origin, item) == sum(verified[i] for i in below):
                done[path] = seq
        self.journal.settle(done)


def watched_folders(params: Params, base_dir: str) -> list[str]:
    """The folder roots of a ``load`` step that a change journal may list (``JournalListing``):
    what ``ragline serve`` watches."""
    roots = _roots(params, base_dir)
    return [root.location for root in roots if _journaled(root, roots, params)]


def _journaled(root: SourceRoot, roots: list[SourceRoot], params: Params) -> bool:
    """A folder root named apart from the project's folder, nested in no other root and holding
    none (its sources' ids are then exactly the ids below its name), that does not follow links (a
    watch does not see into a linked folder), with journals allowed."""
    return (params.full_listing_hours > 0 and not root.pattern and not root.is_file and root.name != "."
            and not root.follow_links and not any(r is not root and (_nested(r.location, root.location) or _nested(root.location, r.location))
                        for r in roots))


def _listing_digest(root: SourceRoot, params: Params, fingerprint: str) -> str:
    """What a full listing's outcome depends on besides the files: the step's settings, the root,
    the pipeline's fingerprint. A journal is trusted only under the digest of its full listing."""
    text = json.dumps([params.model_dump(mode="json"), root.location, fingerprint], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _nested(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _under_root(source_id: str, root: SourceRoot) -> bool:
    return source_id.startswith(root.name + "/")


def _path_of(source_id: str, root: SourceRoot) -> str:
    """The path of a failure's source id under a folder root: a record's '#...' and a JSONL line's
    ':<n>' dropped (``Failure.protects`` reads them the same way)."""
    path = f"{root.location.rstrip('/')}/{source_id[len(root.name) + 1:].split('#', 1)[0]}"
    file, _, line = path.rpartition(":")
    return file if file and line.isdigit() and not os.path.lexists(path) else path


def _walked(path: str, root: SourceRoot, params: Params) -> bool:
    """Whether the root's walk reaches ``path``: no folder on the way is excluded, and none is a
    link unless the root follows links."""
    parts = path[len(root.location.rstrip("/")) + 1:].split("/")
    folder = root.location.rstrip("/")
    for part in parts[:-1]:
        folder = f"{folder}/{part}"
        if _matches(folder + "/", params.exclude) or (not root.follow_links and os.path.islink(folder)):
            return False
    return not (os.path.isdir(path) and _matches(path + "/", params.exclude))


def _may_escape(path: str, root: SourceRoot, link: bool | None = None) -> bool:
    """Whether a listed file's real path may lie outside its root. A folder root's walk does not enter
    linked folders (unless it follows links), so only a file that is itself a link can: the walk's
    word for it (``link``: its directory entry's type, no system call), else one lstat, instead of
    resolving every file's path (the listing's largest cost at 10,000 files)."""
    return bool(root.pattern) or root.is_file or (os.path.islink(path) if link is None else link)


def _within(real: str, roots: list[str]) -> bool:
    return any(_nested(real, root) for root in roots)


def _root_files(root: SourceRoot, params: Params, ctx: StepContext) -> Iterable[tuple[str, bool | None]]:
    """A root's files, each with whether it is a symbolic link (None: not known from the walk)."""
    expanded = posixpath.join(root.location, root.pattern) if root.pattern else root.location
    if root.pattern:
        return _glob_root(expanded, root, params, ctx)
    if (missing := _unreachable(expanded)) is not None:
        ctx.fail(root.covered, f"{missing} (listed as {root.given!r})", root=True)
        return []
    if os.path.isdir(expanded):
        return _folder_root(root, params, ctx)
    ctx.cover("file", root.covered)
    return [] if _matches(expanded, params.exclude) else [(expanded, None)]  # a file named directly skips `include`


def _unreachable(path: str) -> str | None:
    """Why a listed path cannot be reached, in the system's words ('no such file or directory',
    'file name too long', 'not a directory' under a file), or None when it exists."""
    try:
        os.lstat(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return reason[:1].lower() + reason[1:]
    return None


def _glob_root(pattern: str, root: SourceRoot, params: Params, ctx: StepContext) -> list[tuple[str, bool | None]]:
    """Files matching a glob; its fixed folder must exist, else nothing under it counts as deleted."""
    if not os.path.isdir(root.location):
        ctx.fail(root.covered, f"the folder of pattern {root.given!r} does not exist", root=True)
        return []
    found: set[str] = set()
    for match in glob.glob(pattern, recursive=True):
        match = Path(os.path.abspath(match)).as_posix()
        if os.path.isdir(match):
            found.update(path for path, _ in _folder_files(match, root, params, ctx))
        elif _matches(match, params.include) and not _matches(match, params.exclude):
            found.add(match)
    ctx.cover("glob", root.covered)
    return [(path, None) for path in sorted(found)]  # a glob's files are all resolved: they may lead anywhere


def _glob_base(pattern: str) -> str:
    """The folder part of a glob before its first wildcard component."""
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if GLOB_CHARS & set(part))
    return "/".join(parts[:fixed]) or "/"


def _folder_root(root: SourceRoot, params: Params, ctx: StepContext) -> Iterator[tuple[str, bool | None]]:
    """Files under a folder root, streamed, the root declared covered once its walk ended; a root
    that cannot be listed is a root failure."""
    try:
        os.scandir(root.location).close()
    except OSError as exc:
        ctx.fail(root.covered, f"cannot list folder (listed as {root.given!r}): {exc.strerror or exc}", root=True)
        return
    yield from _folder_files(root.location, root, params, ctx)
    ctx.cover("folder", root.covered)


def _folder_files(folder: str, root: SourceRoot, params: Params, ctx: StepContext) -> Iterator[tuple[str, bool]]:
    """Files below ``folder`` that pass include/exclude, each with whether it is a symbolic link (from
    its directory entry: no lstat per file); an unreadable subfolder is reported (which protects what
    was indexed from it) instead of being skipped silently. Folder links are walked only when the
    root follows links, each real folder once (a link loop ends). ``os.walk``'s order and rules
    (top-down, a folder whose type cannot be read is a file), keeping scandir's entries it drops."""
    def unreadable(exc: OSError) -> None:
        ctx.fail(root.source_id(Path(exc.filename or folder).as_posix()), f"cannot list folder: {exc.strerror or exc}")

    seen = {os.path.realpath(folder)}
    include, exclude = params.include, params.exclude
    stack = [folder if os.sep == "/" else Path(folder).as_posix()]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as listing:
                entries = list(listing)
        except OSError as exc:
            unreadable(exc)
            continue
        folders: list[str] = []
        files: list[tuple[str, bool]] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                # a linked folder is entered only when the root follows links (os.walk's followlinks)
                if root.follow_links or not _is_link(entry):
                    folders.append(entry.name)
            else:
                files.append((entry.name, _is_link(entry)))
        # prune excluded folders (.git, node_modules) instead of walking and filtering them
        folders = sorted(d for d in folders if not _matches(f"{top}/{d}/", exclude))
        if root.follow_links:
            folders = [d for d in folders if _first_visit(os.path.join(top, d), seen)]
        for name, link in sorted(files):
            full = f"{top}/{name}"
            if _matches(full, include) and not _matches(full, exclude):
                yield full, link
        stack.extend(f"{top}/{d}" for d in reversed(folders))


def _is_link(entry: os.DirEntry) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return True  # unknown: judged as a link (its real path is checked)


def _first_visit(folder: str, seen: set[str]) -> bool:
    real = os.path.realpath(folder)
    if real in seen:
        return False
    seen.add(real)
    return True


def _matches(path: str, patterns: list[str]) -> bool:
    """A pattern matches the name, the whole path, or its end after a '/' (so 'drafts/*' skips every
    drafts folder). Case-insensitive: '*.pdf' takes REPORT.PDF. Folders come with a trailing '/',
    so '**/.git/**' prunes the folder itself."""
    if not patterns:
        return False
    return _pattern_matcher(tuple(patterns))(path.lower())


@functools.lru_cache(maxsize=64)
def _pattern_matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a lowered path matches any of the patterns: one compiled regular expression for the
    names and one for the paths (fnmatch's own translation of each pattern, joined), or, when every
    pattern is '*' and a literal (the default `include`: '*.md', ...), the same answer by suffix: a
    listing matches every file against them."""
    lowered = [p.lower() for p in patterns]
    if all(p.startswith("*") and p[1:] and not GLOB_CHARS & set(p[1:]) for p in lowered):
        # '*<lit>' matches a name, a path, or '*/*<lit>' a path, exactly when it ends with <lit>
        suffixes = tuple(p[1:] for p in lowered)
        return lambda path: path.endswith(suffixes) or _name(path).endswith(suffixes)
    by_name = re.compile("|".join(fnmatch.translate(p) for p in lowered)).match
    by_path = re.compile("|".join(fnmatch.translate(q) for p in lowered for q in (p, "*/" + p))).match
    return lambda path: bool(by_name(_name(path)) or by_path(path))


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


# --- reading one file ----------------------------------------------------------------------

def _load_file(path: str, root: SourceRoot, data: bytes, mtime: float, params: Params, ctx: StepContext,
               media_type: str | None = None, groups: tuple[str, ...] | None = None,
               versions: RecordVersions | None = None) -> list[Document]:
    """All Documents of one item's bytes (one, or one per JSONL record); [] when it was reported as
    failed. ``media_type``: the Content-Type a web page came with (its URL often has no suffix);
    ``groups``: who may read it when its source says (an upload), else the root's access rules."""
    documents = _read_documents(path, root, data, mtime, params, ctx, media_type, versions)
    fallback = root.groups(path) if groups is None else groups
    out = []
    limit = settings.documents().document_max_chars
    for document in documents:
        if len(document.text) > limit:  # a text file, a record, an attachment (converters stop sooner)
            ctx.fail(document.source_id, f"text of {len(document.text)} characters, over the document_max_chars "
                                         f"limit of {limit}")
            continue
        try:
            out.append(_granted(document, fallback, params))
        except ValueError as exc:
            ctx.fail(document.source_id, str(exc))
    return out


def _granted(document: Document, fallback: tuple[str, ...], params: Params) -> Document:
    """The document with its groups: its own ``acl_field`` when it has one, else ``fallback``; its
    metadata carries them (flows/access.py) and never a reserved key of its own."""
    own = document.metadata.get(params.acl_field) if params.acl_field else None
    groups = fallback if own is None else access.parse_groups(
        own, f"document {document.source_id!r} field {params.acl_field!r}")
    document.groups = list(groups)
    kept = {k: v for k, v in access.without_acl(document.metadata).items() if k != params.acl_field}
    document.metadata = {**kept, **access.acl_metadata(groups)}
    return document


def _read_documents(path: str, root: SourceRoot, data: bytes, mtime: float, params: Params, ctx: StepContext,
                    media_type: str | None, versions: RecordVersions | None = None) -> list[Document]:
    fmt = FORMATS.get(Path(path).suffix.lower()) or MEDIA_FORMATS.get((media_type or "").split(";")[0].strip(),
                                                                       "text")
    where = root.source_id(path)
    if not data:
        ctx.fail(where, "empty document")
        return []
    media = (media_type or "").split(";")[0].strip()
    convert = formats.converter(Path(path).suffix) or formats.converter(MEDIA_CONVERTED.get(media, ""))
    if convert is not None:
        return _converted_documents(path, root, where, convert, data, mtime, params, ctx)
    text = _decode(where, data, params.encoding, ctx)
    if text is None:
        return []
    if not text.strip():
        ctx.fail(where, "empty document")
        return []
    if fmt == "jsonl":
        return _jsonl_documents(path, root, text, mtime, params, ctx, versions)
    title = _markdown_title(text) if fmt == "markdown" else _html_title(text) if fmt == "html" else ""
    return [_document(path, root, fmt, text, title or Path(path).stem, mtime)]


def _read(path: str, where: str, max_bytes: int, ctx: StepContext) -> tuple[bytes, float, str | None] | None:
    """A local file's bytes, mtime and change signal (taken before reading), or None when it was
    reported as failed."""
    try:
        fetched = read_file(path, max_bytes)
    except SourceError as exc:
        ctx.fail(where, str(exc))
        return None
    return fetched.data, fetched.modified or 0.0, fetched.signal


# --- roots of other types (fsspec, web) ----------------------------------------------------

def _remote_documents(spec: Any, params: Params, ctx: StepContext, known: "KnownItems") -> list[Document]:
    """The Documents of a root of another type: its listing, each item's bytes from the cache when its
    change signal is the one they were fetched with, else downloaded. A complete listing covers the
    root (what it no longer names is gone); an incomplete one is a root failure (nothing deleted)."""
    source: DocumentSource = source_types()[spec.type](spec, params.max_bytes)
    source.bind(ctx.base_dir)
    root = _LinkedRoot(source.location, source.location, spec.name or source.location, remote=True,
                       access=tuple(getattr(spec, "access", ())), source=source)
    cache = ItemCache(cache_folder(ctx.base_dir, f"{spec.type} {source.location} {root.name}"))
    listing = source.list(cache, lambda key: (not source.by_name or _matches(key, params.include))
                          and not _matches(key, params.exclude))
    for key, reason, permanent in listing.failed:
        ctx.fail(root.source_id(f"{root.location}/{key}"), reason, skipped=permanent)
        if not permanent:
            cache.carry(key)
    documents: list[Document] = []
    same = known.unchanged({root.source_id(f"{root.location}/{i.key}"): i.signal for i in listing.items})
    to_read: list[Any] = []
    for item in listing.items:
        path = f"{root.location}/{item.key}"
        listed = known.listed(same.get(root.source_id(path)), item.signal, path, root, item.groups, params)
        if listed is not None:  # its signal is the one its documents were indexed with: not even the cache is read
            cache.carry(item.key)
            documents += listed
            ctx.progress("unchanged", len(listed))
        else:
            to_read.append(item)
    for item, fetched in _remote_bytes(source, to_read, cache, root, ctx):
        path = f"{root.location}/{item.key}"
        for document in _load_file(path, root, fetched.data, fetched.modified or 0.0, params, ctx,
                                   fetched.media_type, item.groups):
            document.signal = item.signal
            documents.append(document)
            ctx.progress("documents", 1)
    if listing.complete:
        ctx.cover("folder", root.name)
    else:
        ctx.fail(root.name, listing.reason, root=True)
    cache.save(listing.complete)
    return documents


def _remote_bytes(source: DocumentSource, items: list[Any], cache: ItemCache, root: SourceRoot,
                  ctx: StepContext) -> Iterator[tuple[Any, Fetched]]:
    """Each item's bytes: cached when its signal is unchanged (no download), else fetched (or read
    while listing) and kept under the signal listed before the download. Downloads go through the
    source's ``fetch_all`` (several at once where it can, a bounded window of bytes held); one that
    fails is reported for its item."""
    downloads = []
    for item in items:
        if (hit := cache.hit(item)) is not None:
            ctx.progress("unchanged", 1)
            yield item, hit
        elif item.data is not None:
            yield item, _downloaded(item, Fetched(item.data, item.modified, item.signal, item.media_type), cache, ctx)
        else:
            downloads.append(item)
    for item, outcome in source.fetch_all(downloads):
        if isinstance(outcome, SourceError):
            ctx.fail(root.source_id(f"{root.location}/{item.key}"), str(outcome))
            cache.carry(item.key)
        else:
            yield item, _downloaded(item, outcome, cache, ctx)


def _downloaded(item: Any, fetched: Fetched, cache: ItemCache, ctx: StepContext) -> Fetched:
    ctx.progress("downloaded", 1)
    cache.keep(item, fetched, item.signal)
    return fetched


@dataclass(frozen=True)
class _LinkedRoot(SourceRoot):
    """A remote root: its sources link where their source says (an object's public URL, a page's own URL)."""

    source: DocumentSource | None = None

    def url(self, path: str) -> str | None:
        return self.source.url(self.below(path)) if self.source else None


def _decode(where: str, data: bytes, encoding: str, ctx: StepContext) -> str | None:
    """Bytes to text; None (reported) for binary or undecodable content."""
    wide = codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))  # NULs are normal there
    if not wide and b"\x00" in data[:SNIFF_BYTES]:
        ctx.fail(where, "binary content, not text")
        return None
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        ctx.fail(where, f"not valid {encoding}: cannot decode byte 0x{data[exc.start]:02x} at offset {exc.start}")
        return None
    return text.removeprefix("\ufeff")


def _document(path: str, root: SourceRoot, fmt: str, text: str, title: str, mtime: float, *,
              source_id: str | None = None, pages: list[int] | None = None, extra: Metadata | None = None) -> Document:
    return Document(source_id=source_id or root.source_id(path), path=_shown(path, root), format=fmt, title=title,
                    modified=mtime, content_hash=content_hash(text), text=text, pages=pages or [],
                    metadata={**(extra or {}), **_provenance(path, root), "format": fmt, "modified": mtime})


def _shown(path: str, root: SourceRoot) -> str:
    """Where a source is shown to be: its public URL, else its id (never the server's path)."""
    return root.url(path) or root.source_id(path)


def _provenance(path: str, root: SourceRoot) -> Metadata:
    """The metadata only the loader sets: a document's own metadata can never replace it."""
    url = root.url(path)
    return {"source": _shown(path, root), "root": root.name, "file_name": posixpath.basename(path),
            **({"url": url} if url else {})}


def _markdown_title(text: str) -> str:
    """The first '# ' heading outside fenced code (a '# comment' in a shell block is no title)."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := MD_HEADING.match(line)):
            return match.group(1).strip()
    return ""


def _html_title(raw: str) -> str:
    """<title>, else the first <h1>: cheap regexes, since ``convert`` does the real HTML parsing."""
    for pattern in (HTML_TITLE, HTML_H1):
        if match := pattern.search(raw):
            title = " ".join(html.unescape(HTML_TAG.sub(" ", match.group(1))).split())
            if title:
                return title
    return ""


# --- converted formats (flows/formats) ---------------------------------------------------

def _converted_documents(path: str, root: SourceRoot, where: str, convert: formats.Converter, data: bytes,
                         mtime: float, params: Params, ctx: StepContext, name: str | None = None) -> list[Document]:
    """The document a converter makes of a file (or of an attachment, ``where`` then being
    '<file>#<name>'), then one per attachment of a readable type; a file it cannot read is reported
    with the converter's reason, and an attachment's failure fails that attachment only."""
    name = name or posixpath.basename(path)
    kind = Path(name).suffix.lstrip(".").upper() or "file"
    options = _budget(params)
    try:
        formats.check_archive(data, options)  # a zip bomb is refused from its directory, before any parser
        converted = convert(data, name, options)
        options.check(len(converted.text))
    except formats.FormatError as exc:
        ctx.fail(where, str(exc))
        return []
    except Exception as exc:  # a converter library's own errors on a malformed file: this file only
        ctx.fail(where, f"unreadable {kind} file: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return []
    documents = []
    if converted.text.strip():
        documents.append(_document(path, root, Path(name).suffix.lstrip(".").lower(), converted.text,
                                   converted.title or Path(name).stem, mtime, source_id=where,
                                   pages=converted.pages, extra={**converted.metadata, **(
                                       {"attachment": name} if where != root.source_id(path) else {})}))
    elif not converted.attachments:
        ctx.fail(where, f"{kind} file has no text")
    for attachment, data in _named_attachments(converted.attachments):
        documents.extend(_attachment_documents(path, root, f"{where}#{attachment}", attachment, data, mtime,
                                               params, ctx))
    return documents


def _budget(params: Params) -> formats.Options:
    """What a converter may do and what one document may cost (the ``RAGLINE_DOCUMENT_*`` settings):
    its time is counted from now. A cooperative deadline, checked in the converters' loops, rather
    than a child process per document: loading runs in the engine's threads, and a process per file
    would cost more than most files take; the parts a loop cannot interrupt (a C parser reading one
    XML member, pypdf inflating one stream) are bounded before they start by the size limits."""
    limits = settings.documents()
    seconds = limits.document_max_seconds
    return formats.Options(params.ocr, params.ocr_max_pages, params.ocr_languages,
                           max_member_bytes=limits.document_max_member_bytes,
                           max_expanded_bytes=limits.document_max_expanded_bytes,
                           max_ratio=limits.document_max_expansion_ratio, max_chars=limits.document_max_chars,
                           seconds=seconds, deadline=time.monotonic() + seconds)


def _named_attachments(attachments: list[formats.Attachment]) -> Iterator[tuple[str, bytes]]:
    """Attachments by a name unique in their file ('a.pdf', 'a (2).pdf'), without '#' or '/'."""
    seen: dict[str, int] = {}
    for attachment in attachments:
        name = re.sub(r"[#/\\\x00-\x1f]", "_", attachment.name).strip() or "attachment"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            stem, dot, ext = name.rpartition(".")
            name = f"{stem} ({seen[name]}).{ext}" if dot and stem else f"{name} ({seen[name]})"
        yield name, attachment.data


def _attachment_documents(path: str, root: SourceRoot, where: str, name: str, data: bytes, mtime: float,
                          params: Params, ctx: StepContext) -> list[Document]:
    """An attachment of a converted format or a text format becomes its own document; others
    (images, archives) are left out: they are part of the message (a logo, a photo), not documents
    of their own, and OCR of every signature image would cost seconds and fail on photos."""
    suffix = Path(name).suffix.lower()
    if suffix in IMAGES:
        return []
    if (convert := formats.converter(suffix)) is not None:
        return _converted_documents(path, root, where, convert, data, mtime, params, ctx, name=name)
    if suffix not in FORMATS or suffix == ".jsonl":
        return []
    text = _decode(where, data, params.encoding, ctx)
    if text is None:
        return []
    if not text.strip():
        ctx.fail(where, "empty document")
        return []
    fmt = FORMATS[suffix]
    title = _markdown_title(text) if fmt == "markdown" else _html_title(text) if fmt == "html" else ""
    return [_document(path, root, fmt, text, title or Path(name).stem, mtime, source_id=where,
                      extra={"attachment": name})]


# --- JSONL ---------------------------------------------------------------------------------

def _jsonl_documents(path: str, root: SourceRoot, text: str, mtime: float, params: Params,
                     ctx: StepContext, versions: RecordVersions | None = None) -> list[Document]:
    """One Document per BEIR-style record; a bad line is reported as 'path:line' and the rest load.
    With ``versions``, a record whose version is the one it was indexed with makes none."""
    documents: list[Document] = []
    first_seen: dict[str, int] = {}
    # split on "\n" only: str.splitlines would also split on U+2028 inside JSON strings
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{root.source_id(path)}:{line_no}"
        try:
            record_id, record = _parse_record(line, params)
            if record_id in first_seen:
                raise ValueError(f"duplicate record id {record_id!r}, first seen on line {first_seen[record_id]}")
            version = _record_version(record, params)
            source_id = f"{root.source_id(path)}#{record_id}"
            if not (versions is not None and version is not None
                    and versions.unchanged(source_id, version, record, params)):
                documents.append(_record_document(path, root, record_id, record, mtime, params, version))
        except ValueError as exc:
            ctx.fail(where, str(exc))
            continue
        first_seen[record_id] = line_no
    return documents


def _parse_record(line: str, params: Params) -> tuple[str, dict[str, Any]]:
    """The id and object of one line; ValueError says what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {JSON_TYPES.get(type(record), 'value')}, not an object")
    record_id = record.get(params.jsonl_id_field)
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)) or not str(record_id).strip():
        raise ValueError(f"missing id: field {params.jsonl_id_field!r} must be a non-empty string or integer")
    return str(record_id), record


def _record_version(record: dict[str, Any], params: Params) -> str | None:
    """A record's content hash from its own version field (None: no field configured, or the record
    has none: its content is hashed); a version that is not a string or number is an error naming it."""
    name = params.jsonl_version_field
    if name is None or record.get(name) is None:
        return None
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"field {name!r} (jsonl_version_field) must be a non-empty string or number, "
                         f"not {JSON_TYPES.get(type(value), 'value')} {json.dumps(value)[:40]}")
    return content_hash(json.dumps({"version_field": name, "version": value}, ensure_ascii=False))


def _record_document(path: str, root: SourceRoot, record_id: str, record: dict[str, Any], mtime: float,
                     params: Params, version: str | None = None) -> Document:
    parts = [record.get(field) for field in params.jsonl_text_fields]
    text = "\n\n".join(part for part in parts if isinstance(part, str) and part.strip())
    if not text:
        raise ValueError(f"empty document: no text in {', '.join(params.jsonl_text_fields)}")
    title = record.get(params.jsonl_title_field)
    # no "modified": the file's mtime moves when any record changes, so it says nothing of this one,
    # and rewriting it on unchanged records would make incremental runs differ from clean ones
    base: Metadata = {**_provenance(path, root), "format": "jsonl", "doc_id": record_id}
    # canonical JSON: any change to the record (text, title, metadata) re-indexes it, key order does not;
    # its access field is not content: a change of rights re-grants its chunks without re-embedding them
    groups, hashed = _record_groups(record, params)
    own = {} if groups is None else {params.acl_field: ",".join(
        access.parse_groups(groups, f"record {record_id!r} field {params.acl_field!r}"))}
    return Document(source_id=f"{root.source_id(path)}#{record_id}", path=_shown(path, root), format="jsonl",
                    title=title.strip() if isinstance(title, str) else "", modified=mtime,
                    content_hash=version or content_hash(json.dumps(hashed, sort_keys=True, ensure_ascii=False)),
                    text=text,
                    metadata={**_scalar_metadata(record.get("metadata")), **own, **base})


def _record_groups(record: dict[str, Any], params: Params) -> tuple[Any, dict[str, Any]]:
    """A record's access value (its ``acl_field``, top-level or in its 'metadata'; None: it has none)
    and the record without it, which is what its content hash is made of."""
    name = params.acl_field
    if name is None:
        return None, record
    meta = record.get("metadata")
    if name in record:
        return record[name], {k: v for k, v in record.items() if k != name}
    if isinstance(meta, dict) and name in meta:
        return meta[name], {**record, "metadata": {k: v for k, v in meta.items() if k != name}}
    return None, record


def _scalar_metadata(extra: Any) -> Metadata:
    """Flat scalar values of a record's 'metadata' object (vector stores accept nothing nested)."""
    if not isinstance(extra, dict):
        return {}
    return {str(k): v for k, v in extra.items()
            if isinstance(v, (str, int, float, bool)) and str(k) not in LOADER_KEYS and not access.reserved(str(k))}
