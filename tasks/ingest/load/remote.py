"""Documents from a remote source (HTTP, fsspec, ...): listed by the source, fetched through its cache."""
from __future__ import annotations

from typing import Any, Iterator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.sources import (
    DocumentSource,
    Fetched,
    ItemCache,
    SourceError,
    cache_folder,
    source_types,
)
from ragline.tasks.ingest.load.files import _load_file
from ragline.tasks.ingest.load.known import KnownItems
from ragline.tasks.ingest.load.params import Params
from ragline.tasks.ingest.load.roots import SourceRoot, _LinkedRoot
from ragline.tasks.ingest.load.walk import _matches


def _remote_documents(spec: Any, params: Params, ctx: StepContext, known: KnownItems) -> list[Document]:
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
