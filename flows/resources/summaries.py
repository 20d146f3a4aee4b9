"""The community summary index (GraphRAG-style): one JSON file beside the index state.

``summarize_communities`` (a job stage) builds a ``SummaryReport``; the job runner publishes it
here with ``publish`` (one atomic rename: a killed build or a failed write leaves the previous
summaries whole and readable); ``retrieve_summaries`` (a query stage) only ever ``load``s it.
The file lives beside the state it was built from (``<state>.summaries.json``), so each named
collection has its own, and moving the data folder moves it too.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from pydantic import ValidationError

from ragline.flows.contracts import SummaryReport
from ragline.flows.files import write_atomic

log = logging.getLogger("ragline.summaries")
SUFFIX = ".summaries.json"
_cache: dict[Path, tuple[tuple[int, int], SummaryReport]] = {}
_lock = threading.Lock()


def summaries_path(state_path: Path) -> Path:
    """Where the summaries of the index whose state is at ``state_path`` live."""
    return state_path.with_name(state_path.stem + SUFFIX)


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
    try:
        report = SummaryReport.model_validate_json(path.read_bytes())
    except (ValidationError, ValueError) as exc:
        raise ValueError(f"{path}: not a summary index ({str(exc).splitlines()[0]}); run the summarize job "
                         f"again to rebuild it") from None
    with _lock:
        _cache[path] = (key, report)
    return report


def publish(path: Path, report: SummaryReport) -> SummaryReport:
    """Replace the summaries at ``path`` in one rename: readers see the old set or the new one."""
    report.path = str(path)
    report.written = True
    write_atomic(path, report.model_dump_json())
    log.info("summaries: %d communities published to %s (%d re-summarised, %d kept)", len(report.communities),
             path, len(report.summarised), len(report.reused))
    return report
