"""A listed root as ``load`` resolved it, and where a path or source id lies relative to it."""
from __future__ import annotations

import itertools
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ragline.flows import access
from ragline.flows.sources import (
    DocumentSource,
)
from ragline.flows.sources.local import Root
from ragline.tasks.ingest.load.params import GLOB_CHARS, Params


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


def _overlapping(roots: list[SourceRoot]) -> bool:
    """Whether a root lies inside another (or is the same place): then a file may be listed twice."""
    real = [os.path.realpath(root.location) for root in roots]
    return any(_nested(a, b) or _nested(b, a) for a, b in itertools.combinations(real, 2))


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


def _glob_base(pattern: str) -> str:
    """The folder part of a glob before its first wildcard component."""
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if GLOB_CHARS & set(part))
    return "/".join(parts[:fixed]) or "/"


@dataclass(frozen=True)
class _LinkedRoot(SourceRoot):
    """A remote root: its sources link where their source says (an object's public URL, a page's own URL)."""

    source: DocumentSource | None = None

    def url(self, path: str) -> str | None:
        return self.source.url(self.below(path)) if self.source else None
