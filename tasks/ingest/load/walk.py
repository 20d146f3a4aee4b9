"""Finding a root's files: folders walked, globs matched, links and hard links judged, each file once."""
from __future__ import annotations

import fnmatch
import functools
import glob
import os
import posixpath
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ragline.flows.context import StepContext
from ragline.tasks.ingest.load.params import GLOB_CHARS, Params
from ragline.tasks.ingest.load.roots import SourceRoot, _nested, _overlapping

if TYPE_CHECKING:  # annotations only: the modules import each other otherwise
    from ragline.tasks.ingest.load.journal import JournalListing


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
