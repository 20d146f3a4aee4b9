"""A root's change journal: the files below the paths that changed, when a full listing vouches for it."""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragline.flows.context import StepContext
from ragline.flows.resources.stores.integrity import repairing
from ragline.flows.sources.journal import Journal, journal_file
from ragline.tasks.ingest.load.known import KnownItems
from ragline.tasks.ingest.load.params import Params
from ragline.tasks.ingest.load.roots import SourceRoot, _nested, _path_of, _roots, _under_root
from ragline.tasks.ingest.load.walk import _folder_files, _matches, _unreachable, _walked

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
           known: KnownItems) -> "JournalListing | None":
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
