"""``local``: folders, files and glob patterns on this machine (the default type of a root).

Walking local roots stays in ``tasks.load`` (its symbolic-link policy spans every root of the
step); this module holds the root's spec and reads one file's bytes.
"""
from __future__ import annotations

import os
import posixpath
import re
import stat
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StringConstraints,
    model_validator,
)
from ragline.flows.access import AccessRule
from ragline.flows.sources.base import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
)

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


def relative_name(value: str | None) -> str | None:
    """A root's ``name``: relative, without '..', '#' or control characters."""
    if value is None:
        return value
    name = posixpath.normpath(value.strip().strip("/"))
    if not value.strip().strip("/") or name.startswith("..") or "#" in name or any(ord(c) < 32 for c in name):
        raise ValueError(f"root name {value!r} must be a relative name without '..', '#' or control characters")
    return name


def http_url(value: str | None) -> str | None:
    if value is not None and not re.match(r"https?://[^/\s]+", value, re.I):
        raise ValueError(f"url_prefix {value!r} must be an http:// or https:// URL")
    return value


# the ``name`` and ``url_prefix`` every root type may have, checked the same way
RootName = Annotated[NonEmpty, AfterValidator(relative_name)]
PublicUrl = Annotated[NonEmpty, AfterValidator(http_url)]
# who may read a root's sources: rules by path below the root, the first that matches decides (none: everyone)
AccessRules = Annotated[list[AccessRule], Field(description="who may read its sources: [{prefix: 'hr/', groups: "
                                                            "[hr]}, ...], the first rule whose prefix the path below "
                                                            "the root starts with decides; no match: everyone")]


class Root(BaseModel):
    """A source root with options: how its sources are named, linked and whether links may leave it."""

    model_config = {"extra": "forbid"}

    type: Literal["local"] = "local"
    path: NonEmpty = Field(..., description="folder (walked recursively), file or glob pattern")
    name: RootName | None = Field(None, description="what its sources are identified and shown by: '<name>/<path "
                                                    "below the root>' (default: the path relative to the "
                                                    "pipelines file's folder, or the folder's own name outside it)")
    url_prefix: PublicUrl | None = Field(None, description="public URL of the root: a source links to this followed "
                                                          "by its path below the root")
    follow_links: bool | None = Field(None, description="index symbolic links that lead outside every root "
                                                        "(default: the step's follow_links)")
    hard_links: bool | None = Field(None, description="index files with more than one hard link (default: the "
                                                      "step's hard_links; off, they are skipped with a reason)")
    access: AccessRules = []

    @model_validator(mode="before")
    @classmethod
    def _plain_path(cls, value: Any) -> Any:
        """A root given as a plain string is its path."""
        return {"path": value} if isinstance(value, str) else value


    def __str__(self) -> str:  # where a plain list of paths is shown
        return self.path


class LocalSource(DocumentSource):
    """Files on this machine. ``load`` walks local roots itself; ``fetch`` reads one file."""

    Spec = Root

    @property
    def location(self) -> str:
        return self.spec.path

    def list(self, cache: ItemCache, wanted) -> Listing:  # noqa: ARG002 - see the module's docstring
        raise NotImplementedError("local roots are walked by tasks.load (links are judged against every root)")

    def fetch(self, item: Item) -> Fetched:
        return read_file(item.key, self.max_bytes)


def read_file(path: str, max_bytes: int) -> Fetched:
    """A file's bytes and mtime; size is checked first so a huge file is never read into memory."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a named pipe would block the run forever
            raise SourceError(f"not a regular file ({_file_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise SourceError(f"file is {info.st_size} bytes, over the max_bytes limit of {max_bytes}")
        data = Path(path).read_bytes()
    except SourceError:
        raise
    except OSError as exc:
        raise SourceError(f"cannot read file: {exc.strerror or exc}") from None
    return Fetched(data, info.st_mtime, file_signal(info))


RACY_SECONDS = 2.0  # a file changed this recently may change again within its clock's resolution


def file_signal(info: os.stat_result) -> str | None:
    """What changes when a file's bytes change, from its stat: size, mtime, ctime (no tool can set it
    back, as rsync or ``touch -r`` do mtime) and inode (an editor's save-by-rename). None for a file
    changed in the last two seconds: a write in the same clock tick keeps its times, so its signal
    cannot vouch for the bytes read (git's "racy clean"); it is read again next run."""
    if time.time() - info.st_mtime < RACY_SECONDS:
        return None
    return f"{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}:{info.st_ino}"


def stat_signal(path: str) -> str | None:
    """A file's change signal without reading it (None: unknown, or no regular file: read it to find out)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return file_signal(info) if stat.S_ISREG(info.st_mode) else None


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder"))
    return next((name for test, name in kinds if test(mode)), "special file")
