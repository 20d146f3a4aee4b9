"""What every source type is: a pydantic spec (its ``type:`` literal names it in pipelines.yaml)
and a ``DocumentSource`` that lists items and fetches their bytes.

The incremental protocol needs three things from a source, and nothing else:

- a listing that says whether it is **complete**: only a complete listing lets the run delete
  indexed sources it no longer names; an unreachable source, or a listing that fails halfway, is
  incomplete and deletes nothing (``Listing.complete``);
- a cheap **change signal** per item before any download (an ETag, an object version, size and
  mtime): an item whose signal matches the one its bytes were fetched with is not downloaded
  again (``ItemCache``);
- the item's **bytes**, which ``load`` turns into Documents and hashes: the index state compares
  content hashes, so a wrong signal costs a download, never a stale index.

``load`` asks for the items it must download through ``fetch_all``: one after the other, unless the
source says it can fetch several at once (``fetch_concurrency``; an fsspec root's ``concurrency``).
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, get_args

from pydantic import BaseModel
from ragline.flows.errors import RaglineError
from ragline.flows.files import write_atomic


class SourceError(RaglineError, OSError):
    """One item could not be fetched (gone, refused, too large): reported for that item only.
    ``permanent``: a property of the item, not an outage (a redirect loop, a link off the origin):
    it protects nothing and does not make a listing incomplete."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class Item:
    """One listed item. ``key``: its path below the root ('guide/intro.md'), what its source id is
    made of. ``signal``: what changes when its bytes change, known before downloading (None: no
    cheap signal, always fetched)."""

    key: str
    signal: str | None = None
    size: int | None = None
    modified: float | None = None
    media_type: str | None = None  # a Content-Type, where the key has no telling suffix (web pages)
    data: bytes | None = None  # fetched while listing (a crawl reads pages to find links)
    groups: tuple[str, ...] | None = None  # who may read it, when the source knows (an upload's uploader's groups)


@dataclass
class Listing:
    """The items of a root. ``complete`` False (with ``reason``): nothing may be deleted as gone."""

    items: list[Item] = field(default_factory=list)
    complete: bool = True
    reason: str = ""
    failed: list[tuple[str, str, bool]] = field(default_factory=list)  # (key, reason, permanent) of unread items


@dataclass(frozen=True)
class Fetched:
    data: bytes
    modified: float | None = None
    signal: str | None = None
    media_type: str | None = None


class DocumentSource(ABC):
    """A configured root of a non-local type. Built once per run from its spec."""

    Spec: ClassVar[type[BaseModel]]
    by_name: ClassVar[bool] = True  # its keys are file names: `load`'s include patterns apply (not to web pages)

    def __init__(self, spec: Any, max_bytes: int):
        self.spec = spec
        self.max_bytes = max_bytes

    @classmethod
    def type_name(cls) -> str:
        names = get_args(cls.Spec.model_fields["type"].annotation)
        if len(names) != 1:
            raise TypeError(f"{cls.__qualname__}.Spec.type must be a Literal of one name")
        return names[0]

    @property
    @abstractmethod
    def location(self) -> str:
        """Where it is, for messages and the cache's name (never with credentials in it)."""

    @abstractmethod
    def list(self, cache: ItemCache, wanted: Callable[[str], bool]) -> Listing:
        """Every item, with its change signal; never raises for an unreachable source (an
        incomplete listing with the reason instead)."""

    @abstractmethod
    def fetch(self, item: Item) -> Fetched:
        """The item's bytes (at most ``max_bytes``); raises SourceError naming why not."""

    @property
    def fetch_concurrency(self) -> int:
        """How many items ``fetch_all`` downloads at once (1: one after the other)."""
        return 1

    def fetch_all(self, items: Iterable[Item]) -> Iterator[tuple[Item, Fetched | SourceError]]:
        """Each item with its bytes, or the SourceError saying why not, in the order given. Up to
        ``fetch_concurrency`` fetches run at once in threads, started ahead of the consumer, and
        together they may hold at most ``fetch_window_bytes`` (each item counted at its listed size,
        or at ``max_bytes`` when the listing gave none; one item always runs): a window, never the
        whole listing's bytes, and 16 large objects never 16 times ``max_bytes``. Any other exception
        is raised to the consumer, and the fetches under way are finished first."""
        if self.fetch_concurrency <= 1:
            for item in items:
                yield item, _outcome(self.fetch, item)
            return
        pending: deque[tuple[Item, Future, int]] = deque()
        held = 0
        with ThreadPoolExecutor(self.fetch_concurrency, thread_name_prefix="ragline-fetch") as pool:
            try:
                for item in items:
                    weight = self._window_weight(item)
                    while pending and (len(pending) >= self.fetch_concurrency
                                       or held + weight > self.fetch_window_bytes):
                        done, future, done_weight = pending.popleft()
                        held -= done_weight
                        yield done, future.result()
                    pending.append((item, pool.submit(_outcome, self.fetch, item), weight))
                    held += weight
                while pending:
                    done, future, _ = pending.popleft()
                    yield done, future.result()
            finally:
                for _, future, _ in pending:
                    future.cancel()

    fetch_window_bytes: ClassVar[int] = 64 * 2**20
    """What the fetches started ahead of the consumer may hold at once (with ``fetch_concurrency``)."""

    def _window_weight(self, item: Item) -> int:
        """The bytes an item's fetch may hold: its listed size (an oversize one is refused unread)."""
        if item.size is None:
            return self.max_bytes
        return item.size if item.size <= self.max_bytes else 0

    def url(self, key: str) -> str | None:
        """The public URL an item links to, if it has one."""
        return None

    def bind(self, base_dir: str) -> None:
        """Where relative locations resolve: the pipelines file's folder (``load`` calls it once)."""


def _outcome(fetch: Callable[[Item], Fetched], item: Item) -> Fetched | SourceError:
    try:
        return fetch(item)
    except SourceError as exc:
        return exc


class ItemCache:
    """The bytes each item had when last fetched, with the change signal seen before fetching them:
    a later listing with the same signal reads them from here instead of downloading again.

    The signal stored is the one listed *before* the download, so it is never newer than the bytes:
    an item changed between listing and download is fetched again next time, never missed. The
    cache is only a download saver: losing it (or a crash mid-write) costs downloads, and the index
    state still decides what changed by content hash. Blobs are content-addressed; the index is
    replaced atomically."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._index: dict[str, dict[str, Any]] = {}
        self._kept: dict[str, dict[str, Any]] = {}
        try:
            self._index = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            self._index = {}

    def entry(self, key: str) -> dict[str, Any] | None:
        return self._index.get(key)

    def hit(self, item: Item) -> Fetched | None:
        """The cached bytes when the item's signal matches the one they were fetched with."""
        entry = self._index.get(item.key)
        if item.signal is None or entry is None or entry.get("signal") != item.signal:
            return None
        try:
            data = (self.folder / "blobs" / entry["blob"]).read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != entry["blob"]:  # a damaged blob is a miss, not bad content
            return None
        self._kept[item.key] = entry
        return Fetched(data, entry.get("modified"), item.signal, entry.get("media_type"))

    def cached(self, key: str) -> Fetched | None:
        """The bytes last fetched for ``key`` with the signal they came with, whatever the item's now
        (a crawler asks a server whether they are still current)."""
        entry = self._index.get(key)
        if entry is None:
            return None
        try:
            data = (self.folder / "blobs" / entry["blob"]).read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != entry["blob"]:
            return None
        return Fetched(data, entry.get("modified"), entry.get("signal"), entry.get("media_type"))

    def keep(self, item: Item, fetched: Fetched, signal: str | None, **extra: Any) -> None:
        """Remember bytes fetched for ``item`` under ``signal`` (the one listed before the fetch)."""
        if signal is None:
            return
        blob = hashlib.sha256(fetched.data).hexdigest()
        path = self.folder / "blobs" / blob
        try:
            if not path.exists():
                write_atomic(path, fetched.data)
        except OSError:  # a read-only or full disk: the item is simply downloaded again next time
            return
        self._kept[item.key] = {"signal": signal, "blob": blob, "modified": fetched.modified,
                                "media_type": fetched.media_type, **extra}

    def carry(self, key: str) -> None:
        """Keep an entry that was not read this time (an item that failed: its next fetch decides)."""
        if key in self._index:
            self._kept.setdefault(key, self._index[key])

    def save(self, complete: bool) -> None:
        """Write the index: after a complete listing only what was listed (unreferenced blobs go),
        after an incomplete one everything old is kept too."""
        index = dict(self._kept) if complete else {**self._index, **self._kept}
        try:
            write_atomic(self.folder / "index.json", json.dumps(index, sort_keys=True))
            if complete:
                used = {e["blob"] for e in index.values()}
                for blob in (self.folder / "blobs").glob("*"):
                    if blob.name not in used:
                        blob.unlink(missing_ok=True)
        except OSError:
            pass  # only downloads are lost: the next run fetches again
        self._index = index


def cache_folder(base_dir: str, location: str) -> Path:
    """Where one root's cache lives: under the project's .ragline folder, named by the root."""
    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    return Path(base_dir, ".ragline", "sources", digest)


