"""What the index state says of listed items: which need not be read, which are re-granted."""
from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.load.params import FORMATS, Params
from ragline.tasks.ingest.load.records import RecordVersions
from ragline.tasks.ingest.load.roots import SourceRoot


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
             root: SourceRoot, params: Params) -> "Kept | None":
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

    def versions(self, item: str, root: SourceRoot, path: str, params: Params) -> RecordVersions | None:
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


def _sink(ctx: StepContext) -> Any:
    """This pipeline's ingestion sink with an index state, when it has one."""
    if ctx.project is None:
        return None
    try:
        sink = ctx.project.pipeline(ctx.pipeline).sink
    except (KeyError, ValueError):
        return None
    return sink if sink is not None and "state" in sink.resources else None
