"""``uploads``: the managed folder the document API (``POST /v1/documents``) writes and ``load`` reads.

The folder is content-addressed: each upload is ``<folder>/<id>/<file name>``, where ``<id>`` is
the first 32 hex digits of the SHA-256 of its bytes. So

- the same bytes uploaded again land on the same id: nothing is written, nothing re-indexed;
- a document id names exactly one folder, and a client's file name is only ever the last part
  of a path below it (sanitised, see ``safe_name``): no name reaches outside the folder, and no
  upload can overwrite another;
- an upload appears at once and whole: its bytes are written to a temporary file (fsynced) inside
  a hidden staging folder, which is renamed to ``<id>`` (one atomic rename). Hidden entries
  (``.staging-*``, ``.tmp-*``) are never listed, so an interrupted upload is never indexed;
- a killed upload (or delete) leaves its hidden ``.staging-*`` (``.deleted-*``) folder behind: each
  upload, and the API at start, removes those older than ``STALE_SECONDS`` whose lock no one holds
  (an upload holds an ``flock`` on its staging folder until it is renamed or removed, and the
  kernel drops it when the process dies), so a folder in use is never touched;
- a delete removes ``<id>``: a complete listing no longer names it, so the next ingestion run
  removes it from every index (deletions only from complete listings, as for any root).

The listing reads the folder only: a folder that does not exist yet is an empty, complete
listing (nothing uploaded), and one that cannot be read is incomplete (nothing deleted).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

from pydantic import BaseModel, Field, StringConstraints
from ragline.flows.sources.base import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
)
from ragline.flows.files import write_atomic
from ragline.flows.sources.local import RootName, read_file

ID_LENGTH = 32  # hex digits of the SHA-256: 128 bits
ID = re.compile(rf"^[0-9a-f]{{{ID_LENGTH}}}$")
MAX_NAME_CHARS = 200
CHUNK_BYTES = 1 << 20
GROUPS_FILE = ".groups.json"  # hidden: never listed as the upload's file
STALE_SECONDS = 15 * 60  # a staging folder untouched this long, and unlocked, was left by a killed upload
LEFTOVERS = (".staging-", ".deleted-")
log = logging.getLogger("ragline.sources.uploads")


class UploadsSpec(BaseModel):
    """A root of documents uploaded through the API."""

    model_config = {"extra": "forbid"}

    type: Literal["uploads"]
    name: RootName = Field(
        "uploads", description="what its sources are identified by: '<name>/<id>/<file name>'")
    path: Annotated[str, StringConstraints(min_length=1)] | None = Field(
        None, description="the managed folder, relative to the pipelines file's folder "
                          "(default: .ragline/uploads/<name>)")



def folder_of(spec: UploadsSpec, base_dir: str | Path) -> Path:
    """Where a root's uploads live: its ``path`` (relative to the pipelines file's folder), or
    ``.ragline/uploads/<name>`` there."""
    given = spec.path or f".ragline/uploads/{spec.name}"
    return Path(os.path.abspath(os.path.join(base_dir, os.path.expanduser(given))))


class UploadsSource(DocumentSource):
    """The managed folder as a source: ``<id>/<file name>`` items, no change signal needed (the id
    is the content hash: an item never changes, it is added or removed)."""

    Spec = UploadsSpec
    by_name = False  # the API accepted each file by its type: `load`'s include patterns do not apply

    def __init__(self, spec: UploadsSpec, max_bytes: int):
        super().__init__(spec, max_bytes)
        self.folder = folder_of(spec, ".")

    def bind(self, base_dir: str) -> None:
        self.folder = folder_of(self.spec, base_dir)

    @property
    def location(self) -> str:
        return self.folder.as_posix()

    def list(self, cache: ItemCache, wanted: Callable[[str], bool]) -> Listing:
        folder = UploadFolder(self.folder)
        try:
            return Listing(items=[Item(u.key, None, u.size, u.modified, groups=folder.groups(u.id))
                                  for u in folder.uploads() if wanted(u.key)])
        except OSError as exc:
            return Listing(complete=False, reason=f"cannot list the uploads folder: {exc.strerror or exc}")

    def fetch(self, item: Item) -> Fetched:
        if not ID.match(item.key.partition("/")[0]):
            raise SourceError(f"{item.key!r} is not an upload", permanent=True)
        return read_file(str(self.folder / item.key), self.max_bytes)


# ----------------------------------------------------------------------------- the folder
@dataclass(frozen=True)
class Upload:
    id: str
    name: str
    size: int
    modified: float

    @property
    def key(self) -> str:
        return f"{self.id}/{self.name}"


def safe_name(given: str) -> str:
    """A client's file name as the last part of a path: its base name (after '/' or '\\'), NFC,
    without control or format characters, '#' (it separates a JSONL record's id) or a leading dot;
    at most 200 characters, the extension kept. Raises ValueError when nothing usable is left."""
    base = re.split(r"[/\\]", given)[-1]
    text = unicodedata.normalize("NFC", base)
    text = "".join(c for c in text if unicodedata.category(c)[0] != "C").replace("#", "_").strip().lstrip(".")
    if not text or text in (".", ".."):
        raise ValueError(f"file name {given[:100]!r} has no usable characters")
    if len(text) > MAX_NAME_CHARS:
        _, dot, suffix = text.rpartition(".")
        keep = suffix[:20] if dot else ""
        text = text[:MAX_NAME_CHARS - len(keep) - 1] + ("." + keep if keep else "")
    return text


class UploadFolder:
    """Writes, lists and removes uploads in one managed folder (see the module's docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def uploads(self) -> list[Upload]:
        """Every complete upload, by id. A missing folder has none; an unreadable one raises OSError."""
        if not self.folder.exists():
            return []
        found = []
        for entry in sorted(os.scandir(self.folder), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and ID.match(entry.name) and (upload := self.get(entry.name)):
                found.append(upload)
        return found

    def get(self, upload_id: str) -> Upload | None:
        if not ID.match(upload_id):
            return None
        try:
            files = [e for e in os.scandir(self.folder / upload_id)
                     if e.is_file(follow_symlinks=False) and not e.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return None
        if len(files) != 1:
            return None
        info = files[0].stat(follow_symlinks=False)
        return Upload(upload_id, files[0].name, info.st_size, info.st_mtime)

    def groups(self, upload_id: str) -> tuple[str, ...] | None:
        """Who may read an upload (its uploaders' groups, set by the server); None: everyone."""
        try:
            return tuple(json.loads((self.folder / upload_id / GROUPS_FILE).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # unreadable: nobody but an operator reads it until fixed
            raise SourceError(f"upload {upload_id}: its access file is unreadable ({exc})") from None

    def grant(self, upload_id: str, groups: tuple[str, ...] | None) -> None:
        """Add an uploader's groups to an upload that holds the same bytes: every uploader could read
        it (they sent it); one who sent it for everyone (None) makes it public. The next ingestion
        run re-grants its chunks in place (nothing re-embedded)."""
        current = self.groups(upload_id)
        path = self.folder / upload_id / GROUPS_FILE
        if current is None or groups is None:
            if current is not None:
                path.unlink(missing_ok=True)
            return
        merged = tuple(sorted(set(current) | set(groups)))
        if merged != current:
            write_atomic(path, json.dumps(merged))

    def put(self, stream: BinaryIO, name: str, max_bytes: int,
            groups: tuple[str, ...] | None = None) -> tuple[Upload, bool]:
        """Store the stream's bytes as ``name``: (the upload, True) when new, (the one already
        holding these bytes, False) when not. Raises ``TooLarge`` beyond ``max_bytes``. ``groups``:
        who may read it (the server's, from the uploader; None: everyone), kept in a hidden file
        that appears with the upload in the same rename."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sweep()
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.folder))
        lock = _locked(staging)  # held until the end: the sweep of another request leaves it alone
        try:
            target = staging / name
            digest, size = hashlib.sha256(), 0
            with open(target, "xb") as out:
                while chunk := stream.read(CHUNK_BYTES):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(size, max_bytes)
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            upload_id = digest.hexdigest()[:ID_LENGTH]
            if (existing := self.get(upload_id)) is not None:
                self.grant(upload_id, groups)
                return existing, False
            if groups is not None:
                write_atomic(staging / GROUPS_FILE, json.dumps(sorted(set(groups))))
            _fsync_dir(staging)
            try:
                os.rename(staging, self.folder / upload_id)  # atomic; fails if another request just made it
            except OSError:
                if (existing := self.get(upload_id)) is not None:
                    self.grant(upload_id, groups)
                    return existing, False
                raise
            _fsync_dir(self.folder)
            return self.get(upload_id) or Upload(upload_id, name, size, 0.0), True
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
            os.close(lock)

    def sweep(self, grace_seconds: float = STALE_SECONDS) -> int:
        """Remove the staging (and trash) folders killed requests left: untouched for
        ``grace_seconds`` and not locked by a live upload. Returns how many were removed."""
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.startswith(LEFTOVERS)
                       and e.is_dir(follow_symlinks=False)]
        except OSError:  # no folder yet (or unreadable: the upload itself says so)
            return 0
        removed = 0
        for entry in entries:
            path = Path(entry.path)
            try:
                if time.time() - _last_touched(path) < grace_seconds:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:  # gone meanwhile (its upload finished)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an upload in progress holds it
                os.close(fd)
                continue
            try:
                shutil.rmtree(path, ignore_errors=True)
                removed += not path.exists()
            finally:
                os.close(fd)
        if removed:
            log.warning("removed %d staging folder(s) left by killed uploads in %s", removed, self.folder)
        return removed

    def remove(self, upload_id: str) -> bool:
        """Remove an upload (renamed away first, so no listing sees it half-removed)."""
        if not ID.match(upload_id) or not (self.folder / upload_id).is_dir():
            return False
        trash = Path(tempfile.mkdtemp(prefix=".deleted-", dir=self.folder))
        lock = _locked(trash)
        try:
            os.rename(self.folder / upload_id, trash / upload_id)
            _fsync_dir(self.folder)
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            os.close(lock)
        return True


class TooLarge(SourceError):
    def __init__(self, size: int, limit: int):
        super().__init__(f"the file is over the limit of {limit} bytes (read {size} so far)", permanent=True)
        self.limit = limit


def _locked(folder: Path) -> int:
    """An open descriptor holding an exclusive ``flock`` on ``folder`` (close it to release)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _last_touched(folder: Path) -> float:
    """The newest modification time of a folder and what is in it (a file being written moves it)."""
    newest = folder.stat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                newest = max(newest, os.stat(os.path.join(root, name), follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                pass
    return newest


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
