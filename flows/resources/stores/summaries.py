"""The community summary index (GraphRAG-style): published beside, or in, the index state it was built from.

``summarize_communities`` (a job stage) builds a ``SummaryReport``; the job runner publishes it
to the state's summary store (``IndexState.summaries()``, the ``SummaryStore`` role) and
``retrieve_summaries`` (a query stage) only ever reads it. Where it lives follows the state, so
each named collection has its own:

- a state file (SQLite, ``FileSummaries``): the file ``<state>.summaries.json`` beside it, replaced in one atomic
  rename (a killed build or a failed write leaves the previous summaries whole and readable);
  moving the data folder moves it too;
- a database state (PostgreSQL, ``DatabaseSummaries``): two rows of the state's own ``meta`` table (the report
  and a version), written in one transaction, so every machine that reads the index reads the
  same summaries and a collection's schema holds its own (a file path would be one machine's, and
  the collections of one database share the template's ``path``).

Readers parse a published version once (the file's size and mtime, the row's version).
"""
from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ragline.flows.contracts import SummaryReport
from ragline.flows.files import write_atomic

log = logging.getLogger("ragline.summaries")
SUFFIX = ".summaries.json"
META_KEY = "summaries"  # a database state's meta row holding the report (JSON)
VERSION_KEY = "summaries_version"  # ... and the row naming its version (read first: cheap)
_cache: dict[Any, tuple[Any, SummaryReport]] = {}
_lock = threading.Lock()


def summaries_path(state_path: Path) -> Path:
    """Where the summaries of the index whose state is at ``state_path`` live."""
    return state_path.with_name(state_path.stem + SUFFIX)


class FileSummaries:
    """Summaries in a file beside a SQLite state, replaced in one atomic rename."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def location(self) -> str:
        return str(self.path)

    def load(self) -> SummaryReport | None:
        return load(self.path)

    def publish(self, report: SummaryReport) -> SummaryReport:
        return publish(self.path, report)


class DatabaseSummaries:
    """Summaries in two rows of a database state's ``meta`` table (the report and its version),
    written in one transaction; a reader parses a version once."""

    def __init__(self, state: Any):
        self.state = state

    @property
    def location(self) -> str:
        return f"{self.state.index_location} (meta row '{META_KEY}')"

    def load(self) -> SummaryReport | None:
        where = self.location
        version = self.state.get_meta(VERSION_KEY)
        if version is None:
            return None
        with _lock:
            cached = _cache.get(where)
            if cached and cached[0] == version:
                return cached[1]
        text = self.state.get_meta(META_KEY)
        if text is None:
            return None
        report = _parse(where, text)
        with _lock:  # a publish between the two reads caches a newer report under the older version: re-read next time
            _cache[where] = (version, report)
        return report

    def publish(self, report: SummaryReport) -> SummaryReport:
        report.path = self.location
        report.written = True
        with self.state.transaction() as tx:
            self.state.set_meta(META_KEY, report.model_dump_json(), tx)
            self.state.set_meta(VERSION_KEY, uuid.uuid4().hex, tx)
        log.info("summaries: %d communities published to %s (%d re-summarised, %d kept)", len(report.communities),
                 report.path, len(report.summarised), len(report.reused))
        return report


def load(path: Path) -> SummaryReport | None:
    """The published summaries (None: never built). Read once per file version (size and mtime);
    a file that is not a summary index says so with its path."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    key = (stat.st_mtime_ns, stat.st_size)
    with _lock:
        cached = _cache.get(path)
        if cached and cached[0] == key:
            return cached[1]
    report = _parse(str(path), path.read_bytes())
    with _lock:
        _cache[path] = (key, report)
    return report


def _parse(where: str, data: str | bytes) -> SummaryReport:
    try:
        return SummaryReport.model_validate_json(data)
    except (ValidationError, ValueError) as exc:
        raise ValueError(f"{where}: not a summary index ({str(exc).splitlines()[0]}); run the summarize job "
                         f"again to rebuild it") from None


def publish(path: Path, report: SummaryReport) -> SummaryReport:
    """Replace the summaries at ``path`` in one rename: readers see the old set or the new one."""
    report.path = str(path)
    report.written = True
    write_atomic(path, report.model_dump_json())
    log.info("summaries: %d communities published to %s (%d re-summarised, %d kept)", len(report.communities),
             path, len(report.summarised), len(report.reused))
    return report
