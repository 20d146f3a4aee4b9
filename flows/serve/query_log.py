"""The opt-in query log (``RAGLINE_QUERY_LOG=1``): one JSON line per served query, so an answer a
user rated (``POST /v1/feedback``) can be traced to what was asked, retrieved and cited, and
feedback becomes labelled evaluation data (``ragline feedback export``).

Why a file of its own: the query path must never write a store (Chroma, BM25, the index state);
the log is append-only JSON lines under ``<data dir>/.ragline/query-log/``. Lines are written by
one background thread (a query only hands its entry over: it never waits for the disk; past
``MAX_PENDING`` waiting entries new ones are dropped and counted). Files are rotated by size by
the standard library's ``RotatingFileHandler`` (``query_log_max_mb`` for all of them together) and
by age: the active file is rolled when its oldest line is older than 1/``BACKUPS`` of
``query_log_retention_days``, and a rolled file whose newest line is older than the retention is
deleted. With ``query_log_text`` off the question, rewritten queries, answer text and refusal
reason are left out: ids, scores and outcomes only.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

from ragline.flows import settings
from ragline.flows.contracts import Answer, Passage, Query
from ragline.flows.evaluation.retrieval import document_id as doc_id

log = logging.getLogger("ragline.api.query_log")

LOG_FOLDER = Path(".ragline") / "query-log"
LOG_NAME = "queries.jsonl"
BACKUPS = 30  # rolled files kept at most (besides the size and age bounds)
MAX_PENDING = 10_000  # entries waiting for the writer thread; beyond it new ones are dropped
KNOWN_IDS = 200_000  # answer ids remembered for feedback (the newest ones)
MAX_PASSAGES = 100  # retrieved passages recorded per query


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class BoundedJsonl(RotatingFileHandler):
    """Append-only JSON lines in files rotated by size (the handler's own) and by age: the active
    file rolls over once its first line is ``roll_seconds`` old; a rolled file whose last write is
    older than ``retention_seconds`` is deleted."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int, retention_seconds: float | None = None,
                 roll_seconds: float | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.path, self.retention_seconds, self.roll_seconds = path, retention_seconds, roll_seconds
        self._first_at = _first_time(path)
        self.prune()

    def write(self, line: str) -> None:
        """One line, flushed (the handler's lock keeps lines whole across threads)."""
        self.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def emit(self, record: logging.LogRecord) -> None:
        now = time.time()
        if self._first_at is not None and self.roll_seconds and now - self._first_at > self.roll_seconds:
            self.doRollover()
        if self._first_at is None:
            self._first_at = now
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 - a line not written is the caller's to know (logging would print and go on)

    def doRollover(self) -> None:
        super().doRollover()
        self._first_at = None
        self.prune()

    def prune(self) -> None:
        """Delete rolled files older than the retention (the active one rolls first, by age)."""
        if not self.retention_seconds:
            return
        cutoff = time.time() - self.retention_seconds
        for rolled in (f for f in self.files() if f != self.path):
            try:
                if rolled.stat().st_mtime < cutoff:
                    rolled.unlink()
            except FileNotFoundError:
                pass

    def files(self) -> list[Path]:
        """The active file, then the rolled ones newest first (those that exist)."""
        return files_of(self.path, self.backupCount)


def files_of(path: Path, backups: int = BACKUPS) -> list[Path]:
    """A rotated file's files that exist: the active one, then ``.1``, ``.2``, ... (newest first)."""
    candidates = [path, *(path.with_name(f"{path.name}.{n}") for n in range(1, backups + 1))]
    return [p for p in candidates if p.is_file()]


def read_lines(path: Path, backups: int = BACKUPS) -> Iterator[dict[str, Any]]:
    """Every JSON object of a rotated file, oldest file first; a torn or foreign line is skipped."""
    for file in reversed(files_of(path, backups)):
        with open(file, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict):
                    yield entry


def _first_time(path: Path) -> float | None:
    """When the active file's first line was written (None: no file, or no readable first line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            first = handle.readline()
        return _epoch(json.loads(first)["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class QueryLog:
    """The served queries' log of one data dir (see the module's docstring)."""

    def __init__(self, folder: Path, *, max_bytes: int, retention_days: float, text: bool):
        self.text = text
        self.path = folder / LOG_NAME
        retention = retention_days * 86400
        self.file = BoundedJsonl(self.path, max_bytes=max(1, max_bytes // (BACKUPS + 1)), backups=BACKUPS,
                                 retention_seconds=retention, roll_seconds=retention / BACKUPS)
        self.dropped = self.failed = 0
        self._pending = 0
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._loaded = threading.Event()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragline-query-log")
        self._writer.submit(self._load_known)

    @classmethod
    def from_settings(cls, data_dir: Path) -> "QueryLog | None":
        """The log the settings ask for, None when ``query_log`` is off (then nothing is written)."""
        if not settings.query_log().query_log:
            return None
        return cls(data_dir / LOG_FOLDER, max_bytes=int(settings.query_log().query_log_max_mb * 1024 * 1024),
                   retention_days=settings.query_log().query_log_retention_days, text=settings.query_log().query_log_text)

    # -- the query path's side: hand over, never wait
    def record(self, entry: dict[str, Any], build: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Queue one entry; ``build(entry)``, if given, completes it on the writer thread (the
        expensive part: walking the step outputs, reading the index generation)."""
        with self._lock:
            if self._pending >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending += 1
        try:
            self._writer.submit(self._write, entry, build)
        except RuntimeError:  # shut down: the server is stopping
            with self._lock:
                self._pending -= 1

    def _write(self, entry: dict[str, Any], build: Callable[[dict[str, Any]], None] | None) -> None:
        try:
            if build is not None:
                build(entry)
            self.file.write(json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str))
            self._remember(entry["answer_id"])
        except Exception as exc:  # noqa: BLE001 - the log must never fail a query
            self.failed += 1
            level = logging.WARNING if self.failed == 1 else logging.DEBUG
            log.log(level, "query log %s: could not write an entry (%s: %s); further failures are counted",
                    self.path, type(exc).__name__, exc)
        finally:
            with self._lock:
                self._pending -= 1

    # -- feedback's side
    def knows(self, answer_id: str, wait_seconds: float = 30.0) -> bool:
        """Whether this answer id was logged (and is still retained, among the newest ``KNOWN_IDS``);
        waits for the entries queued before the call to be written. Blocking: call it on a thread."""
        self._writer.submit(lambda: None).result(wait_seconds)
        self._loaded.wait(wait_seconds)
        with self._lock:
            return answer_id in self._known

    def _remember(self, answer_id: str) -> None:
        with self._lock:
            self._known[answer_id] = None
            while len(self._known) > KNOWN_IDS:
                self._known.popitem(last=False)

    def _load_known(self) -> None:
        try:
            for entry in read_lines(self.path):
                if isinstance(entry.get("answer_id"), str):
                    self._remember(entry["answer_id"])
        except OSError as exc:
            log.warning("query log %s: could not read earlier answer ids (%s)", self.path, exc)
        finally:
            self._loaded.set()

    def flush(self, timeout_seconds: float = 10.0) -> None:
        """Wait until every entry queued so far is written (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout_seconds)

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=False)
        self.file.close()


# ----------------------------------------------------------------------------- what one entry says
def describe_run(entry: dict[str, Any], value: Any, outputs: dict[str, Any], question: str, text: bool) -> None:
    """Adds to ``entry`` what a finished run says: rewritten queries, passages retrieved (ids and
    scores), the answer (citations, sources, verification). Text only when ``text``."""
    rewritten = _rewritten(outputs, question)
    if rewritten and text:
        entry["rewritten"] = rewritten
    retrieved = _retrieved(value, outputs)
    entry["retrieved"] = [_passage_ids(p) for p in retrieved[:MAX_PASSAGES]]
    if isinstance(value, Answer):
        answer: dict[str, Any] = {"citations": value.citations, "refused": value.refused, "verdict": value.verdict,
                                  "confidence": value.confidence,
                                  "sources": [{"number": s.number, "chunk_id": s.chunk_id, "source_id": s.source_id,
                                               "doc_id": _doc_of(s.chunk_id, s.source_id, retrieved)}
                                              for s in value.sources]}
        if text:
            answer["text"] = value.text
            answer["reason"] = value.reason
        entry["answer"] = answer


def _rewritten(outputs: dict[str, Any], original: str | None) -> list[str]:
    """The search texts a rewrite step made (variants, hypothetical documents), when one ran."""
    found: list[str] = []
    for value in outputs.values():
        if isinstance(value, Query):
            for text in [*value.variants, *value.hypothetical]:
                if text != original and text not in found:
                    found.append(text)
    return found


def _retrieved(value: Any, outputs: dict[str, Any]) -> list[Passage]:
    """The passages a search pipeline returned, else the last step's list of passages (what the
    answer was written from: after fusion, reranking, refinement)."""
    if isinstance(value, list) and all(isinstance(p, Passage) for p in value):
        return value
    last: list[Passage] = []
    for output in outputs.values():  # in pipeline order
        if isinstance(output, list) and output and all(isinstance(p, Passage) for p in output):
            last = output
    return last


def _passage_ids(passage: Passage) -> dict[str, Any]:
    return {"chunk_id": passage.chunk_id, "source_id": passage.source_id, "doc_id": doc_id(passage),
            "score": round(float(passage.score), 6)}


def _doc_of(chunk_id: str, source_id: str, retrieved: list[Passage]) -> str:
    return next((doc_id(p) for p in retrieved if p.chunk_id == chunk_id), source_id)


def index_generations(project: Any, states: list[str]) -> dict[str, int]:
    """The generation of each index state a pipeline reads (what was searched); read-only."""
    found = {}
    for name in states:
        try:
            state = project.resource(name)
            if state.exists():
                found[name] = state.generation
        except Exception as exc:  # noqa: BLE001 - a missing generation never fails a log line
            log.debug("query log: no generation for %s (%s)", name, exc)
    return found
