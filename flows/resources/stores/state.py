"""The index state record: one SQLite file that says what both indexes should contain.

It maps each source to its content hash, the settings fingerprint that produced its chunks,
and the chunks themselves (text and metadata, from which the BM25 index is built; triggers log
every changed chunk, so BM25 updates only what changed). Writes follow "forget, write, record": a
crash at any point leaves the state naming only chunks that are fully written, and ``reconcile``
removes whatever the stores hold beyond it.
"""
from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.access import Access, acl_metadata, readable, without_acl
from ragline.flows.processes import pid_alive
from ragline.flows.contracts import Chunk, Document
from ragline.flows.errors import EX_TEMPFAIL, IndexUnavailable, RaglineError
from ragline.flows.resources.base import Health, Resource
from ragline.flows.resources.stores.summaries import FileSummaries, summaries_path

if TYPE_CHECKING:
    from ragline.flows.resources.stores.protocols import SummaryStore

log = logging.getLogger("ragline.state")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    source_id TEXT PRIMARY KEY, origin TEXT NOT NULL, content_hash TEXT NOT NULL,
    fingerprint TEXT NOT NULL, path TEXT, title TEXT, indexed_at REAL NOT NULL, acl TEXT, signal TEXT);
CREATE TABLE IF NOT EXISTS chunks (
    chunk_id TEXT PRIMARY KEY, source_id TEXT NOT NULL, ordinal INTEGER NOT NULL,
    text TEXT NOT NULL, title TEXT, metadata TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_source ON chunks(source_id);
-- (origin, source_id): a journal run's reads of an id range within its pipeline's sources use it; on
-- the index of origin alone SQLite walked every source of the pipeline for them (0.24 s at 300,000)
CREATE INDEX IF NOT EXISTS sources_by_origin_id ON sources(origin, source_id);
DROP INDEX IF EXISTS sources_by_origin;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lease (
    name TEXT PRIMARY KEY, holder TEXT NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
    token TEXT NOT NULL, acquired_at REAL NOT NULL, heartbeat_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS chunk_changes (chunk_id TEXT PRIMARY KEY, generation INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunk_changes_by_generation ON chunk_changes(generation);
CREATE TABLE IF NOT EXISTS listed (source_id TEXT PRIMARY KEY, origin TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queued (
    source_id TEXT PRIMARY KEY, origin TEXT NOT NULL, step TEXT NOT NULL, document TEXT NOT NULL,
    signal TEXT, unchanged INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS journaled (key TEXT PRIMARY KEY, origin TEXT NOT NULL, root TEXT NOT NULL, item TEXT);
"""
# Every write to ``chunks`` logs the chunk id with the generation it was written at (before the bump),
# whoever writes it: BM25 updates itself from this log instead of every row (IndexState.chunk_changes).
_LOGGED = ("INSERT OR REPLACE INTO chunk_changes VALUES ({id}, (SELECT COALESCE(MAX(CAST(value AS INTEGER)), 0) "
           "FROM meta WHERE key='generation'))")
CHANGE_LOG = f"""
CREATE TRIGGER IF NOT EXISTS chunks_inserted AFTER INSERT ON chunks BEGIN {_LOGGED.format(id="NEW.chunk_id")}; END;
CREATE TRIGGER IF NOT EXISTS chunks_deleted AFTER DELETE ON chunks BEGIN {_LOGGED.format(id="OLD.chunk_id")}; END;
CREATE TRIGGER IF NOT EXISTS chunks_updated AFTER UPDATE ON chunks BEGIN {_LOGGED.format(id="OLD.chunk_id")};
    {_LOGGED.format(id="NEW.chunk_id")}; END;
"""
CHUNK_LOG = "chunk_log"  # meta: {"id": this log's id, "from": the generation from which it is complete}
DEFERRED, DEFERRED_END = "deferred:", "deferred;"  # meta keys set when the run that wrote them finishes


def _under(item: str) -> tuple[str, str]:
    """The id range of the sources below a folder's source id ('<item>/' up to '<item>0')."""
    return item + "/", item + "0"


def _outside(roots: list[str]) -> list[tuple[str, str | None]]:
    """The id ranges outside every root's (``_under``), in order: nested roots' ranges merged."""
    out: list[tuple[str, str | None]] = []
    low = ""
    for start, end in sorted(_under(root) for root in roots):
        if start > low:
            out.append((low, start))
        low = max(low, end)
    return out + [(low, None)]


class IndexBusy(RaglineError, RuntimeError):
    """Another ingestion run holds the index's writer lease: try again later."""

    http_status = 409
    error_code = "index_busy"
    exit_code = EX_TEMPFAIL


class StoreDamaged(IndexUnavailable):
    """A store (Chroma, BM25 or the state itself) is unreadable, or disagrees with the index state;
    the message names the store, its path and the remedy."""

    error_code = "index_damaged"


class StoreMissing(StoreDamaged):
    """A store does not exist (never written, or lost). Only a fault when the state says it should
    hold data: an index never built is empty, not damaged."""


QUEUE_PAGE = 1_000  # work-list documents a plan reads per query (a page, not the corpus, is held)
RANGE_SLACK = 1_000  # rows a listing's range read of recorded sources may span beyond 8 per item
REMEDY = "run `ragline index` (or `ragline check --repair`)"
_DAMAGED_WORDS = ("malformed", "not a database", "file is encrypted", "no such table")


class StorageError(RaglineError, OSError):
    """The disk under the data folder refused a write: full, read-only or not permitted. The
    message names the store, its path and the reason, with the store's own error after it.

    Why: SQLite says ``disk I/O error`` or ``unable to open database file`` and embedded Chroma
    ``Error in compaction: Failed to apply logs to the metadata segment`` for a full or read-only
    disk, naming neither the file nor the cause (ENOSPC and EROFS provoked on a real tmpfs,
    tests/flows/run/test_dependency_faults.py). An OSError, so callers that tolerate a store they
    cannot write (``retrieve_sparse.catch_up``) still do."""

    error_code = "storage_error"  # a 500: the disk is the operator's to fix, not the client's

    def __str__(self) -> str:
        return self.strerror or super().__str__()


DISK_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the size limit for files)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_DISK_WORDS = (  # what stores print instead of an errno (SQLite, Chroma's Rust core, Python)
    ("no space left", errno.ENOSPC), ("disk is full", errno.ENOSPC), ("os error 28", errno.ENOSPC),
    ("quota exceeded", errno.EDQUOT), ("os error 122", errno.EDQUOT),
    ("file too large", errno.EFBIG), ("os error 27", errno.EFBIG),
    ("read-only file system", errno.EROFS), ("os error 30", errno.EROFS),
    ("permission denied", errno.EACCES), ("os error 13", errno.EACCES),
)
_OPAQUE_WORDS = ("disk i/o error", "unable to open database file", "readonly database", "error in compaction",
                 "failed to apply logs", "error returned from database", "io error")
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # a short write: out of space, or over RLIMIT_FSIZE
LOW_SPACE_BYTES = 64 << 20  # an opaque store error with less free than this is put down to a full disk


def disk_fault(exc: BaseException, path: Path, what: str) -> StorageError | None:
    """``exc`` as a StorageError naming ``what`` (the store), ``path`` and the reason, when it is
    the disk refusing a write; None for any other error (re-raise it unchanged).

    The reason is the errno of an OSError in the chain, else words in the messages ("database or
    disk is full", "os error 28"); an opaque store error (SQLite's ``disk I/O error``, Chroma's
    compaction failure) counts when the file system is read-only or has under 64 MiB free, and a
    short write (numpy's ``N requested and M written``) is a full disk or the file size limit."""
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    if any(isinstance(e, StorageError) for e in chain):
        return None  # already said
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno in DISK_REASONS), None)
    text = " ".join(str(e) for e in chain).lower()
    if code is None:
        code = next((c for words, c in _DISK_WORDS if words in text), None)
    folder = _existing_folder(path)
    try:
        fs = os.statvfs(folder)
        read_only, free = bool(fs.f_flag & os.ST_RDONLY), fs.f_bavail * fs.f_frsize
    except OSError:
        read_only, free = False, None
    if read_only and code in (None, errno.EACCES, errno.EPERM):
        code = errno.EROFS  # SQLite's "attempt to write a readonly database" on a read-only mount
    if code is None and any(words in text for words in _OPAQUE_WORDS):
        if free is not None and free < LOW_SPACE_BYTES:
            code = errno.ENOSPC
        elif not os.access(folder, os.W_OK):
            code = errno.EACCES
    if code is None and _SHORT_WRITE.search(text):  # numpy's "N requested and M written": no errno
        code = errno.ENOSPC if free is not None and free < LOW_SPACE_BYTES else errno.EFBIG
    if code is None:
        return None
    space = f"; {_size(free)} free on its file system" if free is not None and code in (
        errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
    fault = StorageError(code, f"{what} {path}: {DISK_REASONS[code]}{space} ({type(exc).__name__}: {exc})")
    fault.filename = str(path)
    return fault


def _existing_folder(path: Path) -> Path:
    path = Path(path)
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass(frozen=True)
class LeaseHolder:
    holder: str
    pid: int
    host: str
    acquired_at: float
    heartbeat_at: float

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.acquired_at))
        return f"{self.holder} (pid {self.pid} on {self.host}, since {since})"

    def stale(self, now: float, stale_after: float) -> bool:
        """A holder whose heartbeat stopped, or a dead process on this host (kill -9), has lost the lease."""
        if now - self.heartbeat_at > stale_after:
            return True
        return self.host == socket.gethostname() and not pid_alive(self.pid)




@dataclass(frozen=True)
class ChunkChanges:
    """What changed since a generation: the state's generation now, the current (chunk_id, text,
    metadata) rows of the changed chunks still present, every changed chunk id, and the chunk count."""

    generation: int
    rows: list[tuple[str, str, dict[str, Any]]]
    changed: set[str]
    chunks: int


class StateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["index_state"]
    path: str = Field(".ragline/state.sqlite", description="SQLite file beside the indexes")
    url: str | None = Field(None, repr=False, description=(
        "a database instead of the file: postgresql://user:password@host:5432/db (the `postgres` extra; "
        "several writers and readers on several machines)"))
    schema_name: str = Field("ragline", pattern=r"^[a-z_][a-z0-9_]{0,62}$",
                             description="the database schema holding this index's tables (one per index)")


BACKENDS = "ragline.state_backends"  # entry-point group: a `url:` scheme -> its IndexState subclass


def state_backend(url: str) -> type[IndexState]:
    """The IndexState subclass for a database ``url``, by its scheme (postgresql://...)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    found = {e.name: e for e in entry_points(group=BACKENDS)}
    if scheme not in found:
        known = ", ".join(f"{name}://" for name in sorted(found)) or "none (reinstall ragline: pip install -e .)"
        raise ValueError(f"index state url: unknown scheme '{scheme}://'; known: {known}")
    return found[scheme].load()


class IndexState(Resource):
    """Thread-safe access to the state file; every public write is one transaction."""

    Spec = StateSpec
    located = True

    def __new__(cls, spec: StateSpec | None = None, base_dir: Path | None = None):
        """A ``url:`` selects a database backend (pathlib's Path -> PosixPath pattern): the same
        resource type and methods, so stages and pipelines.yaml's other lines do not change."""
        if cls is IndexState and spec is not None and spec.url:
            cls = state_backend(spec.url)
        return super().__new__(cls)

    @classmethod
    def fingerprint_fields(cls, spec: StateSpec) -> Any:
        """Where the state lives, never its credentials: a rotated password must not re-index."""
        return spec.model_dump(mode="json", include={"type", "path"})

    @classmethod
    def relocated(cls, spec: StateSpec, name: str) -> StateSpec:
        """A database state becomes a file under the other data folder, as a Chroma server becomes
        an embedded store: evaluation and ``--data-dir`` never write the configured database."""
        if spec.url:
            return spec.model_copy(update={"url": None, "path": name})
        return super().relocated(spec, name)

    def __init__(self, spec: StateSpec, base_dir: Path | None = None):
        super().__init__(spec, base_dir)
        self._conn: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_inode: int | None = None  # the file the read-only connection opened
        self._lock = threading.RLock()

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    def summaries(self) -> SummaryStore:
        """This index's community summaries (the ``SummaryStore`` role): a file beside this one."""
        return FileSummaries(summaries_path(self.path))

    @property
    def conn(self) -> sqlite3.Connection:
        with self._guarded():
            if self._conn is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=60)
                try:
                    _rollback_journal(conn)
                    conn.execute("PRAGMA synchronous=FULL")
                    conn.executescript(SCHEMA)
                    _add_acl_column(conn)
                    _add_signal_column(conn)
                    _add_change_log(conn)
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
            return self._conn

    @property
    def reader(self) -> sqlite3.Connection:
        """The connection reads go through: the writer's once this process has written, else a
        read-only one (``mode=ro``) that never creates, migrates or touches the file, so a query
        never changes the index. A missing file raises StoreMissing."""
        with self._guarded():
            if self._conn is not None:
                return self._conn
            if self._reader is not None and self._replaced():
                self._reader.close()  # the file was deleted or replaced (a rebuilt state): read the new one
                self._reader = None
            if self._reader is None:
                if not self.path.is_file():
                    raise StoreMissing(f"index state {self.path} does not exist: nothing is indexed yet, or it was "
                                       f"lost; {REMEDY}")
                conn = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=60)
                if conn.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone() is None:
                    conn.close()
                    raise StoreMissing(f"index state {self.path} holds no index (empty file): {REMEDY}")
                self._reader, self._reader_inode = conn, _inode(self.path)
            return self._reader

    def _replaced(self) -> bool:
        """Whether the file the read-only connection opened is no longer the one at ``path``: a
        long-lived reader (``ragline serve``'s /readyz) kept reading a deleted file's inode."""
        return _inode(self.path) != self._reader_inode

    def exists(self) -> bool:
        """Whether there is a state to read (query paths: no state means nothing indexed)."""
        try:
            self.reader
        except StoreMissing:
            return False
        return True

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        """Hold the lock; a full, read-only or forbidden disk becomes a StorageError naming the file
        (SQLite says only "disk I/O error" or "unable to open database file"). The connection is
        dropped then, so a later call (once space is freed) starts from a fresh one."""
        with self._lock:
            try:
                yield
            except (sqlite3.Error, OSError) as exc:
                fault = disk_fault(exc, self.path, "index state")
                if fault is None and isinstance(exc, sqlite3.DatabaseError) \
                        and any(w in str(exc).lower() for w in _DAMAGED_WORDS):
                    fault = self.damaged(exc)
                if fault is None:
                    raise
                self._drop_connection()
                raise fault from exc

    def damaged(self, exc: BaseException) -> StoreDamaged:
        """The one line for a state file SQLite cannot read: it names the file and the way out (the
        state is rebuilt from the sources; the other stores are reconciled against it)."""
        return StoreDamaged(f"index state {self.path} is damaged ({exc}): move it aside (mv {self.path} "
                            f"{self.path}.damaged) and run `ragline index` to re-index every source")

    def _drop_connection(self) -> None:
        for conn in (self._conn, self._reader):
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
        self._conn = self._reader = None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._guarded():
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:  # e.g. a full disk: closing the connection rolls back instead
                    self._drop_connection()
                raise
            conn.execute("COMMIT")

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._guarded():
            row = self.reader.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str, conn: sqlite3.Connection | None = None) -> None:
        sql = "INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
        if conn is not None:
            conn.execute(sql, (key, value))
            return
        with self.transaction() as tx:
            tx.execute(sql, (key, value))

    @property
    def generation(self) -> int:
        return int(self.get_meta("generation", "0"))

    def _bump(self, conn: sqlite3.Connection) -> None:
        row = conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
        self.set_meta("generation", str(int(row[0]) + 1 if row else 1), conn)

    # ------------------------------------------------------------------ reads
    def sources(self, origin: str | None = None) -> dict[str, tuple[str, str]]:
        """source_id -> (content_hash, fingerprint)."""
        sql, args = "SELECT source_id, content_hash, fingerprint FROM sources", ()
        if origin is not None:
            sql, args = sql + " WHERE origin=?", (origin,)
        with self._guarded():
            return {r[0]: (r[1], r[2]) for r in self.reader.execute(sql, args)}

    def known(self, source_ids: Iterable[str]) -> set[str]:
        """Which of these sources the state already has."""
        found: set[str] = set()
        with self._guarded():
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                found.update(r[0] for r in self.reader.execute(
                    f"SELECT source_id FROM sources WHERE source_id IN ({marks})", batch))
        return found

    def chunk_ids(self, source_ids: Iterable[str] | None = None) -> set[str]:
        with self._guarded():
            if source_ids is None:
                return {r[0] for r in self.reader.execute("SELECT chunk_id FROM chunks")}
            ids: set[str] = set()
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                ids.update(r[0] for r in self.reader.execute(
                    f"SELECT chunk_id FROM chunks WHERE source_id IN ({marks})", batch))
            return ids

    def chunk_rows(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(chunk_id, text, metadata) of every chunk, in a stable order, for the BM25 rebuild."""
        with self._guarded():
            return self._rows(self.reader)

    def chunk_row_pages(self, size: int = 5_000) -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
        """Every chunk row as ``chunk_rows`` orders them, ``size`` rows at a time (keyset pages, each
        read on its own): a full BM25 build holds one page, never the corpus. A write between pages
        is seen in part; the build's generation, read before the first page, is then older than the
        state's, so the next sync re-reads every chunk the change log names since it."""
        after = ""
        while True:
            with self._guarded():
                rows = self.reader.execute(
                    "SELECT chunk_id, text, metadata, source_id, title FROM chunks WHERE chunk_id > ? "
                    "ORDER BY chunk_id LIMIT ?", (after, size)).fetchall()
            if not rows:
                return
            after = rows[-1][0]
            yield [(cid, text, {**json.loads(meta), "source_id": sid, "title": title or ""})
                   for cid, text, meta, sid, title in rows]
            if len(rows) < size:
                return

    @staticmethod
    def _rows(conn: sqlite3.Connection) -> list[tuple[str, str, dict[str, Any]]]:
        rows = conn.execute("SELECT chunk_id, text, metadata, source_id, title FROM chunks ORDER BY chunk_id").fetchall()
        return [(cid, text, {**json.loads(meta), "source_id": sid, "title": title or ""})
                for cid, text, meta, sid, title in rows]

    def chunk_log_id(self) -> str | None:
        """The id of this state's chunk change log (a new state file has a new one). Read as any meta
        is: a query that compares it (BM25's published version) never creates the state."""
        record = self.get_meta(CHUNK_LOG)
        return json.loads(record)["id"] if record else None

    def chunk_changes(self, since: int, log_id: str | None) -> ChunkChanges | None:
        """The chunks written or deleted since generation ``since`` (by the log ``log_id``), with the
        current rows of those still present, read in one transaction; None when the log cannot say
        (another log, pruned past ``since``, or a generation this state never reached). Writers only."""
        with self._guarded():
            conn = self.conn
            conn.execute("BEGIN")
            try:
                row = conn.execute("SELECT value FROM meta WHERE key=?", (CHUNK_LOG,)).fetchone()
                generation = conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
                generation = int(generation[0]) if generation else 0
                record = json.loads(row[0]) if row else None
                if record is None or record["id"] != log_id or not record["from"] <= since <= generation:
                    return None
                changed = {r[0] for r in conn.execute("SELECT chunk_id FROM chunk_changes WHERE generation >= ?",
                                                      (since,))}
                rows = []
                for batch in _batched(sorted(changed), 500):
                    marks = ",".join("?" * len(batch))
                    rows += [(cid, text, {**json.loads(meta), "source_id": sid, "title": title or ""})
                             for cid, text, meta, sid, title in conn.execute(
                                 f"SELECT chunk_id, text, metadata, source_id, title FROM chunks WHERE chunk_id IN "
                                 f"({marks})", batch)]
                chunks = conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
            finally:
                conn.execute("COMMIT")
        return ChunkChanges(generation, sorted(rows), changed, chunks)

    def prune_chunk_changes(self, generation: int) -> None:
        """Forget the changes before ``generation`` (published): the log is complete from there on."""
        with self.transaction() as tx:
            row = tx.execute("SELECT value FROM meta WHERE key=?", (CHUNK_LOG,)).fetchone()
            if row is None:
                return
            record = json.loads(row[0])
            if generation > record["from"]:
                tx.execute("DELETE FROM chunk_changes WHERE generation < ?", (generation,))
                self.set_meta(CHUNK_LOG, json.dumps({**record, "from": generation}), tx)

    def chunks_by_id(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self._guarded():
            for batch in _batched(ids, 500):
                marks = ",".join("?" * len(batch))
                for cid, sid, text, title, meta in self.reader.execute(
                        f"SELECT chunk_id, source_id, text, title, metadata FROM chunks "
                        f"WHERE chunk_id IN ({marks})", batch):
                    out[cid] = {"source_id": sid, "text": text, "title": title or "", "metadata": json.loads(meta)}
        return out

    def chunk_metadata(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """Per chunk id: its metadata with ``source_id`` and ``title``, as a retriever's filter sees
        them, without the text (filters on community summaries read many chunks). Read-only."""
        out: dict[str, dict[str, Any]] = {}
        with self._guarded():
            for batch in _batched(ids, 500):
                marks = ",".join("?" * len(batch))
                for cid, sid, title, meta in self.reader.execute(
                        f"SELECT chunk_id, source_id, title, metadata FROM chunks WHERE chunk_id IN ({marks})", batch):
                    out[cid] = {**json.loads(meta), "source_id": sid, "title": title or ""}
        return out

    def source_chunks(self, source_ids: Iterable[str]) -> list[tuple[str, str, int, str, str, dict[str, Any]]]:
        """(chunk_id, source_id, ordinal, text, title, metadata) of these sources' chunks."""
        rows = []
        with self._guarded():
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                rows += [(cid, sid, ordinal, text, title or "", json.loads(meta)) for cid, sid, ordinal, text, title, meta
                         in self.conn.execute(f"SELECT chunk_id, source_id, ordinal, text, title, metadata FROM chunks "
                                              f"WHERE source_id IN ({marks}) ORDER BY chunk_id", batch)]
        return rows

    def neighbourhoods(self, chunk_ids: list[str], radius: int,
                       access: Access = None) -> dict[str, list[tuple[str, int, str]]]:
        """Per chunk id: (chunk_id, ordinal, text) of its source's chunks within ``radius`` ordinals of
        it, in order (context expansion), only those ``access`` may read. Read-only: query paths call it."""
        out: dict[str, list[tuple[str, int, str]]] = {}
        with self._guarded():
            for batch in _batched(list(dict.fromkeys(chunk_ids)), 500):
                marks = ",".join("?" * len(batch))
                for hit, cid, ordinal, text, meta in self.reader.execute(
                        f"SELECT h.chunk_id, c.chunk_id, c.ordinal, c.text, c.metadata FROM chunks h JOIN chunks c "
                        f"ON c.source_id = h.source_id AND c.ordinal BETWEEN h.ordinal - ? AND h.ordinal + ? "
                        f"WHERE h.chunk_id IN ({marks}) ORDER BY h.chunk_id, c.ordinal", [radius, radius, *batch]):
                    if access is None or readable(json.loads(meta), access):
                        out.setdefault(hit, []).append((cid, ordinal, text))
        return out

    def rename_sources(self, renamed: dict[str, Document], chunks: list[Chunk]) -> None:
        """Give sources their new ids (root-relative, see flows/resources/stores/source_ids.py) in one transaction:
        the sources keep their hash and fingerprint, their chunks their ids, text and vectors."""
        with self.transaction() as tx:
            for old, doc in renamed.items():
                tx.execute("DELETE FROM sources WHERE source_id=?", (doc.source_id,))
                tx.execute("UPDATE sources SET source_id=?, path=?, signal=? WHERE source_id=?",
                           (doc.source_id, doc.path, doc.signal, old))
            tx.executemany("UPDATE chunks SET source_id=?, metadata=? WHERE chunk_id=?",
                           [(c.source_id, json.dumps(c.metadata), c.chunk_id) for c in chunks])
            self._bump(tx)

    def documents(self, origin: str | None = None) -> list[tuple[str, str, str, float, int]]:
        """(source_id, origin, title, indexed_at, chunk count) of every source (of one pipeline), by
        id: the document API's list. Read-only."""
        sql = ("SELECT s.source_id, s.origin, s.title, s.indexed_at, "
               "(SELECT COUNT(*) FROM chunks c WHERE c.source_id = s.source_id) FROM sources s")
        sql, args = (sql + " WHERE s.origin=?", (origin,)) if origin is not None else (sql, ())
        with self._guarded():
            return [(r[0], r[1], r[2] or "", r[3], r[4]) for r in self.reader.execute(sql + " ORDER BY s.source_id", args)]

    def readers(self, origin: str | None = None) -> dict[str, tuple[str, ...] | None]:
        """Per source (of one pipeline): the groups granted to read it (() everyone; None unknown, as
        ``acls``). Read-only, for the document API's filter: a state from before access has no column."""
        sql, args = ("SELECT source_id, acl FROM sources WHERE origin=?", (origin,)) if origin is not None else (
            "SELECT source_id, acl FROM sources", ())
        with self._guarded():
            try:
                rows = self.reader.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such column" not in str(exc):
                    raise
                return {}
        return {sid: None if acl is None else tuple(json.loads(acl)) for sid, acl in rows}

    def counts(self) -> tuple[int, int]:
        with self._guarded():
            return (self.reader.execute("SELECT COUNT(*) FROM sources").fetchone()[0],
                    self.reader.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def newest_indexed_at(self) -> float | None:
        """When the most recently (re)indexed source was written (None: none is): the index's freshness."""
        with self._guarded():
            return self.reader.execute("SELECT MAX(indexed_at) FROM sources").fetchone()[0]

    def sources_indexed_since(self, timestamp: float, *, wait: float | None = None) -> int:
        """How many sources were (re)indexed at or after ``timestamp``: what an ingestion run has written so far.
        ``wait``: a status read (``peek``) that gives up after that many seconds."""
        return self._row("SELECT COUNT(*) FROM sources WHERE indexed_at >= ?", (timestamp,), wait)[0]

    def _row(self, sql: str, params: tuple[Any, ...], wait: float | None) -> tuple[Any, ...] | None:
        """One row through the shared reader, or with ``wait`` through ``peek``."""
        if wait is not None:
            return self.peek(sql, params, wait)
        with self._guarded():
            return self.reader.execute(sql, params).fetchone()

    def peek(self, sql: str, params: tuple[Any, ...], wait: float) -> tuple[Any, ...] | None:
        """One row read on a connection of its own that waits at most ``wait`` seconds for a writer.
        Why: in rollback-journal mode a committing writer blocks readers, and a status poll that
        queued on the shared reader (busy timeout 60 s, behind its lock) held every later poll with
        it; a busy file raises ``sqlite3.OperationalError`` here instead, at once for the caller."""
        conn = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, timeout=wait, isolation_level=None)
        try:
            return conn.execute(sql, params).fetchone()
        finally:
            conn.close()

    def sample_chunk_ids(self, n: int) -> list[str]:
        """Up to ``n`` chunk ids picked at random: the cheap check that a store holds what the state names."""
        with self._guarded():
            return [r[0] for r in self.reader.execute("SELECT chunk_id FROM chunks ORDER BY RANDOM() LIMIT ?", (n,))]

    def snapshot(self) -> tuple[int, list[tuple[str, str, dict[str, Any]]]]:
        """The generation and every chunk row, read in one transaction: a consistent view even while
        an ingestion run writes (a reader's for ``ragline tune``)."""
        with self._guarded():
            conn = self.reader
            conn.execute("BEGIN")
            try:
                row = conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
                rows = self._rows(conn)
            finally:
                conn.execute("COMMIT")
        return (int(row[0]) if row else 0), rows

    def quick_check(self) -> str | None:
        """SQLite's own integrity check of the file (reads every page): None when sound, else its finding."""
        with self._guarded():
            result = self.reader.execute("PRAGMA quick_check").fetchone()[0]
        return None if result == "ok" else result

    # ------------------------------------------------------------------ writes
    def forget(self, source_ids: Iterable[str]) -> None:
        """Drop sources and their chunks: step one of a replace, so a crash re-does them."""
        source_ids = list(source_ids)
        if not source_ids:
            return
        with self.transaction() as tx:
            for batch in _batched(source_ids, 500):
                marks = ",".join("?" * len(batch))
                tx.execute(f"DELETE FROM chunks WHERE source_id IN ({marks})", batch)
                tx.execute(f"DELETE FROM sources WHERE source_id IN ({marks})", batch)
            self._bump(tx)

    def record(self, origin: str, fingerprint: str, documents: list[Document], chunks: list[Chunk]) -> None:
        """Record documents as indexed with these chunks: the last step of a replace."""
        now = time.time()
        with self.transaction() as tx:
            tx.executemany(
                "INSERT OR REPLACE INTO sources (source_id, origin, content_hash, fingerprint, path, title, "
                "indexed_at, acl, signal) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(d.source_id, origin, d.content_hash, fingerprint, d.path, d.title, now, _acl_text(d.groups),
                  d.signal) for d in documents])
            tx.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?)",
                [(c.chunk_id, c.source_id, c.ordinal, c.text, c.title, json.dumps(c.metadata)) for c in chunks])
            self._bump(tx)

    def unchanged_items(self, origin: str, fingerprint: str, signals: dict[str, str]
                        ) -> dict[str, list[tuple[str, str, str, str, tuple[str, ...] | None]]]:
        """Per listed item (its source id, e.g. a file's) whose change signal is the one every source
        read from it was recorded with, under this fingerprint and pipeline: those sources as
        (source_id, content_hash, path, title, groups). An item's sources are its id and '<id>#...'
        (JSONL records, attachments). Items not returned must be read. Read-only; a state without
        the column (from before signals) or without a file knows no item."""
        return {item: [(r[0], r[1], r[2] or "", r[3] or "", None if r[4] is None else tuple(json.loads(r[4])))
                       for r in own]
                for item, own in self._unchanged_rows(origin, fingerprint, signals, full=True).items()}

    def unchanged_acls(self, origin: str, fingerprint: str, signals: dict[str, str]
                       ) -> dict[str, list[tuple[str, str, str | None]]]:
        """``unchanged_items`` as little as a listing needs, its rows as stored: (source_id,
        content_hash, acl) with acl the recorded groups' JSON text (None: unknown). A listing asks
        this of every file, so nothing is decoded here (its callers compare the text first)."""
        return self._unchanged_rows(origin, fingerprint, signals, full=False)

    def _unchanged_rows(self, origin: str, fingerprint: str, signals: dict[str, str], full: bool
                        ) -> dict[str, list[tuple]]:
        found: dict[str, list] = {}
        if not signals:
            return found
        items = sorted(signals)
        # one range read for the batch (a listing's batch is consecutive ids), not one query per item:
        # ids compare as code points here (SQLite's binary order of UTF-8; PostgreSQL's columns are C)
        columns = ("SELECT source_id, content_hash, path, title, acl, signal, fingerprint, origin FROM sources" if full
                   else "SELECT source_id, content_hash, acl, signal, fingerprint, origin FROM sources")
        cap = 8 * len(items) + RANGE_SLACK  # a batch spanning many other rows (another root's) reads per item
        try:
            with self._guarded():
                rows = self.reader.execute(f"{columns} WHERE source_id >= ? AND source_id < ? ORDER BY source_id "
                                           f"LIMIT {cap}", (items[0], items[-1] + "#\U0010ffff")).fetchall()
                if len(rows) == cap:
                    rows = sorted({tuple(r) for item in items for r in self.reader.execute(
                        f"{columns} WHERE source_id = ? OR (source_id > ? AND source_id < ?)",
                        (item, item + "#", item + "#\U0010ffff")).fetchall()})
        except StoreMissing:
            return {}
        except sqlite3.OperationalError as exc:
            if "no such column" not in str(exc):
                raise
            return {}
        ids = [r[0] for r in rows]
        tail = 5 if full else 3  # where (signal, fingerprint, origin) start
        at = 0
        for item in items:
            own, at = _item_rows(rows, ids, item, at)
            if not own:
                continue
            signal = signals[item]
            for r in own:
                if r[tail] != signal or r[tail + 1] != fingerprint or r[tail + 2] != origin:
                    break
            else:
                found[item] = own if full else [(r[0], r[1], r[2]) for r in own]
        return found

    def item_sources(self, origin: str, fingerprint: str, item: str
                     ) -> dict[str, tuple[str, tuple[str, ...] | None]]:
        """The sources read from one item ('<id>' and '<id>#...') recorded under this pipeline and
        fingerprint: source_id -> (content_hash, groups). Read-only; {} without a state file."""
        sql = ("SELECT source_id, content_hash, acl FROM sources WHERE (source_id = ? OR (source_id > ? AND "
               "source_id < ?)) AND origin = ? AND fingerprint = ?")
        try:
            with self._guarded():
                args = (item, item + "#", item + "#\U0010ffff", origin, fingerprint)
                rows = self.reader.execute(sql, args).fetchall()
                return {r[0]: (r[1], None if r[2] is None else tuple(json.loads(r[2]))) for r in rows}
        except StoreMissing:
            return {}

    # --- a run's listing, kept here rather than in memory: the sources a source step found unchanged
    # (from their change signals) are marked ``listed`` batch by batch; the sink's plan reads what is
    # gone or renamed with SQL over them, so no step holds a Document per unchanged source. Cleared
    # when a run takes the lease (what a killed run left behind is never read as this run's).

    # A root listed from its change journal (flows/sources/journal.py) marks only what it examined:
    # a ``journaled`` row for the root (item NULL), one per examined item (a file or a folder, as a
    # source id). Its other sources count as listed without a row each; of its sources, only the
    # examined items' may be unlisted (``unlisted_pages``).

    def mark_journaled(self, origin: str, root: str, items: Iterable[str]) -> None:
        rows = [(f"{origin}\n{root}\n", origin, root, None)]
        rows += [(f"{origin}\n{root}\n{item}", origin, root, item) for item in items]
        with self.transaction() as tx:
            tx.executemany("INSERT OR REPLACE INTO journaled VALUES (?, ?, ?, ?)", rows)

    def _journaled(self, origin: str) -> tuple[list[str], list[str]]:
        """This run's journal-listed roots of ``origin`` and the items examined under them."""
        with self._guarded():
            rows = self.conn.execute("SELECT root, item FROM journaled WHERE origin=?", (origin,)).fetchall()
        return sorted({r[0] for r in rows}), sorted({r[1] for r in rows if r[1] is not None})

    def count_sources(self, origin: str, item: str) -> int:
        """Sources indexed from an item: its own id, its '#' records, and below it as a folder."""
        return sum(len(page) for page in self._examined_pages(origin, [item], listed_too=True))

    def mark_listed(self, origin: str, source_ids: Iterable[str]) -> None:
        rows = [(sid, origin) for sid in source_ids]
        if rows:
            with self.transaction() as tx:
                tx.executemany("INSERT OR REPLACE INTO listed VALUES (?, ?)", rows)

    def clear_listed(self) -> None:
        with self.transaction() as tx:
            tx.execute("DELETE FROM listed")
            tx.execute("DELETE FROM queued")
            tx.execute("DELETE FROM journaled")
            tx.execute("DELETE FROM meta WHERE key >= ? AND key < ?", (DEFERRED, DEFERRED_END))

    def listed_count(self, origin: str) -> int:
        """Sources listed unchanged: marked, or under a journal-listed root and not examined."""
        roots, items = self._journaled(origin)
        with self._guarded():
            count = self.conn.execute("SELECT COUNT(*) FROM listed WHERE origin=?", (origin,)).fetchone()[0]
            for low, high in (_under(root) for root in roots):
                count += self.conn.execute("SELECT COUNT(*) FROM sources WHERE origin=? AND source_id >= ? AND "
                                           "source_id < ?", (origin, low, high)).fetchone()[0]
        examined = {sid for page in self._examined_pages(origin, items, listed_too=True) for sid, *_ in page}
        return count - len(examined)

    def unlisted_pages(self, origin: str, size: int = 5_000) -> Iterator[list[tuple[str, str, str]]]:
        """(source_id, content_hash, fingerprint) of this pipeline's indexed sources that its source
        steps did not mark listed, ``size`` at a time (keyset pages: memory is one page). Under a
        journal-listed root only its examined items' sources are read (range reads on the id), so an
        unchanged source there costs no row: the rest of the id space is read in order around them."""
        roots, items = self._journaled(origin)
        for low, high in _outside(roots):
            yield from self._unlisted_between(origin, low, high, size)
        yield from self._examined_pages(origin, items)

    def _unlisted_between(self, origin: str, low: str, high: str | None, size: int
                          ) -> Iterator[list[tuple[str, str, str]]]:
        after, first = low, True
        below = "" if high is None else "AND s.source_id < ? "
        while True:
            with self._guarded():
                rows = self.conn.execute(
                    "SELECT s.source_id, s.content_hash, s.fingerprint FROM sources s WHERE s.origin=? AND "
                    f"s.source_id {'>=' if first else '>'} ? {below}"
                    "AND NOT EXISTS (SELECT 1 FROM listed l WHERE l.source_id = s.source_id) "
                    "AND NOT EXISTS (SELECT 1 FROM queued q WHERE q.source_id = s.source_id) "
                    "ORDER BY s.source_id LIMIT ?", (origin, after, *(() if high is None else (high,)), size)
                ).fetchall()
            if not rows:
                return
            yield [tuple(r) for r in rows]
            after, first = rows[-1][0], False

    def _examined_pages(self, origin: str, items: list[str], listed_too: bool = False
                        ) -> Iterator[list[tuple[str, str, str]]]:
        """The sources of examined items (an item, its '#' records, a folder's sources below it),
        unlisted ones only unless ``listed_too``; each once."""
        seen: set[str] = set()
        unlisted = "" if listed_too else (
            "AND NOT EXISTS (SELECT 1 FROM listed l WHERE l.source_id = s.source_id) "
            "AND NOT EXISTS (SELECT 1 FROM queued q WHERE q.source_id = s.source_id) ")
        for item in items:
            with self._guarded():
                rows = self.conn.execute(
                    "SELECT s.source_id, s.content_hash, s.fingerprint FROM sources s WHERE s.origin=? AND "
                    "(s.source_id = ? OR (s.source_id > ? AND s.source_id < ?) OR (s.source_id >= ? AND "
                    f"s.source_id < ?)) {unlisted}ORDER BY s.source_id",
                    (origin, item, item + "#", item + "#\U0010ffff", *_under(item))).fetchall()
            page = [tuple(r) for r in rows if r[0] not in seen]
            seen.update(r[0] for r in page)
            if page:
                yield page

    # --- what a run commits only when it finishes: metadata a step sets for the run's end (the
    # sink's finalize promotes it), dropped if the run dies first (``clear_listed``)

    def defer_meta(self, key: str, value: str) -> None:
        self.set_meta(DEFERRED + key, value)

    def promote_deferred(self) -> None:
        with self.transaction() as tx:
            rows = tx.execute("SELECT key, value FROM meta WHERE key >= ? AND key < ?",
                              (DEFERRED, DEFERRED_END)).fetchall()
            for key, value in rows:
                self.set_meta(key[len(DEFERRED):], value, conn=tx)
            tx.execute("DELETE FROM meta WHERE key >= ? AND key < ?", (DEFERRED, DEFERRED_END))

    # --- a run's work list, kept here like ``listed``: the documents a source step listed to be read
    # (new, changed, or whose access changed), each with the step that reads it again in its batch.
    # The sink's plan drops the unchanged ones (``dequeue``; ``hold_signals`` keeps those read this
    # run until ``record_held_signals``); the engine takes the rest a batch at a time
    # (``queued_pages``), so no step holds a Document per document of the corpus.

    def queue(self, origin: str, step: str, documents: Iterable[Document]) -> None:
        rows = [(d.source_id, origin, step, d.model_dump_json(), d.signal, 0) for d in documents]
        if rows:
            with self.transaction() as tx:
                tx.executemany("INSERT OR REPLACE INTO queued VALUES (?, ?, ?, ?, ?, ?)", rows)

    def queued_count(self, origin: str) -> int:
        """Documents of the work list still to index (not found unchanged)."""
        with self._guarded():
            return self.conn.execute("SELECT COUNT(*) FROM queued WHERE origin=? AND unchanged=0",
                                     (origin,)).fetchone()[0]

    def hold_signals(self, source_ids: Iterable[str]) -> None:
        """Unchanged documents read this run (a touched file, the same bytes): off the work list, their
        new signal kept for ``record_held_signals``. Not recorded now: a file's other sources may
        still be to index (a record added to a JSONL file), and a crash before they are would leave
        the file's recorded signals all new, so the next run would never read it."""
        rows = [(sid,) for sid in source_ids]
        if rows:
            with self.transaction() as tx:
                tx.executemany("UPDATE queued SET unchanged=1 WHERE source_id=?", rows)

    def record_held_signals(self, origin: str) -> None:
        """Record the signals ``hold_signals`` kept (every batch of the run is recorded by now): the
        next run skips those files without reading them."""
        with self.transaction() as tx:
            tx.execute("UPDATE sources SET signal = (SELECT q.signal FROM queued q WHERE q.source_id = "
                       "sources.source_id) WHERE source_id IN (SELECT source_id FROM queued WHERE origin=? AND "
                       "unchanged=1)", (origin,))
            tx.execute("DELETE FROM queued WHERE origin=? AND unchanged=1", (origin,))

    def queued_pages(self, origin: str, size: int | None = None, after: str = ""
                     ) -> Iterator[list[tuple[str, Document]]]:
        """(step, Document) of this pipeline's work list, ``size`` (``QUEUE_PAGE``) at a time in id order
        from after ``after`` (keyset pages: memory is one page; rows dropped behind the cursor do not
        move it)."""
        size = size or QUEUE_PAGE
        while True:
            with self._guarded():
                rows = self.conn.execute(
                    "SELECT source_id, step, document FROM queued WHERE origin=? AND unchanged=0 AND "
                    "source_id > ? ORDER BY source_id LIMIT ?", (origin, after, size)).fetchall()
            if not rows:
                return
            yield [(step, Document.model_validate_json(document)) for _, step, document in rows]
            after = rows[-1][0]

    def dequeue(self, source_ids: Iterable[str]) -> None:
        """Take documents off the work list (the plan found them unchanged)."""
        rows = [(sid,) for sid in source_ids]
        if rows:
            with self.transaction() as tx:
                tx.executemany("DELETE FROM queued WHERE source_id=?", rows)

    def sources_of(self, source_ids: Iterable[str], origin: str | None = None) -> dict[str, tuple[str, str]]:
        """``sources`` for these ids only (under ``origin`` when given): source_id -> (hash, fingerprint)."""
        out: dict[str, tuple[str, str]] = {}
        with self._guarded():
            for batch in _batched(list(source_ids), 500):
                sql = f"SELECT source_id, content_hash, fingerprint FROM sources WHERE source_id IN " \
                      f"({','.join('?' * len(batch))})"
                args = tuple(batch)
                if origin is not None:
                    sql, args = sql + " AND origin=?", args + (origin,)
                out.update((r[0], (r[1], r[2])) for r in self.reader.execute(sql, args))
        return out

    def set_signals(self, signals: dict[str, str | None]) -> None:
        """Record the change signal sources were last read with (a touched file whose content is the
        same: the next run skips it without reading)."""
        if signals:
            with self.transaction() as tx:
                tx.executemany("UPDATE sources SET signal=? WHERE source_id=?", [(v, k) for k, v in signals.items()])

    def acls(self, source_ids: Iterable[str]) -> dict[str, tuple[str, ...] | None]:
        """Per source: the groups its chunks were last granted (() public; None unknown: a state from
        before access, or a re-grant a crash interrupted). Writers only (the column is added on write)."""
        out: dict[str, tuple[str, ...] | None] = {}
        with self._guarded():
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                for sid, acl in self.conn.execute(f"SELECT source_id, acl FROM sources WHERE source_id IN ({marks})",
                                                  batch):
                    out[sid] = None if acl is None else tuple(json.loads(acl))
        return out

    def forget_access(self, source_ids: Iterable[str]) -> None:
        """Step one of a re-grant: the sources' access becomes unknown, so a crash before the stores
        are updated makes the next run grant them again, whatever their rules are by then."""
        with self.transaction() as tx:
            tx.executemany("UPDATE sources SET acl=NULL WHERE source_id=?", [(s,) for s in source_ids])

    def regrant(self, grants: dict[str, tuple[str, ...]]) -> None:
        """The last step of a re-grant: the sources' chunks carry their new groups (metadata only)
        and the sources record them, in one transaction; BM25 is republished from it."""
        with self.transaction() as tx:
            for batch in _batched(list(grants), 500):
                marks = ",".join("?" * len(batch))
                rows = tx.execute(f"SELECT chunk_id, source_id, metadata FROM chunks WHERE source_id IN ({marks})",
                                  batch).fetchall()
                tx.executemany("UPDATE chunks SET metadata=? WHERE chunk_id=?", [
                    (json.dumps({**without_acl(json.loads(meta)), **acl_metadata(grants[sid])}), cid)
                    for cid, sid, meta in rows])
            tx.executemany("UPDATE sources SET acl=? WHERE source_id=?",
                           [(_acl_text(groups), sid) for sid, groups in grants.items()])
            self._bump(tx)

    # ------------------------------------------------------------------ writer lease
    def lease_holder(self, name: str = "writer", *, wait: float | None = None) -> LeaseHolder | None:
        """Who holds the lease ``name`` now; ``wait``: a status read (``peek``)."""
        row = self._row("SELECT holder, pid, host, acquired_at, heartbeat_at FROM lease WHERE name=?", (name,), wait)
        return LeaseHolder(*row) if row else None

    @contextmanager
    def lease(self, holder: str, *, wait: bool = True, timeout: float | None = None, stale_after: float = 30.0,
              heartbeat: float = 5.0, on_wait: Callable[[LeaseHolder], None] | None = None,
              name: str = "writer") -> Iterator[None]:
        """Hold the index's single-writer lease for the block: two ingestion runs never write one
        index at once. A held lease makes this wait (``on_wait`` is told once) or, with ``wait=False``
        or past ``timeout``, raise IndexBusy; a lease whose holder died is taken over."""
        token = uuid.uuid4().hex
        self._acquire(name, holder, token, wait, timeout, stale_after, on_wait)
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(name, token, heartbeat, stop),
                                name="ragline-lease-heartbeat", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()
            with self.transaction() as tx:
                tx.execute("DELETE FROM lease WHERE name=? AND token=?", (name, token))

    def _acquire(self, name: str, holder: str, token: str, wait: bool, timeout: float | None,
                 stale_after: float, on_wait: Callable[[LeaseHolder], None] | None) -> None:
        started, told = time.monotonic(), False
        while True:
            current = self._try_acquire(name, holder, token, stale_after)
            if current is None:
                return
            if not wait or (timeout is not None and time.monotonic() - started > timeout):
                raise IndexBusy(f"the index at {self.index_location} is being written by {current.describe()}; "
                                f"try again when that run ends")
            if on_wait is not None and not told:
                on_wait(current)
                told = True
            time.sleep(0.5)

    def _try_acquire(self, name: str, holder: str, token: str, stale_after: float) -> LeaseHolder | None:
        """Take the lease if it is free or stale; else return who holds it."""
        now = time.time()
        with self.transaction() as tx:
            row = tx.execute("SELECT holder, pid, host, acquired_at, heartbeat_at FROM lease WHERE name=?",
                             (name,)).fetchone()
            if row is not None and not LeaseHolder(*row).stale(now, stale_after):
                return LeaseHolder(*row)
            tx.execute("INSERT OR REPLACE INTO lease VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (name, holder, os.getpid(), socket.gethostname(), token, now, now))
        return None

    def _heartbeat(self, name: str, token: str, every: float, stop: threading.Event) -> None:
        """Keep the lease fresh. A beat the disk refuses (full, read-only) is skipped with a warning:
        the run's own writes fail on that disk and say so; a traceback from this thread would not."""
        while not stop.wait(every):
            try:
                with self.transaction() as tx:
                    tx.execute("UPDATE lease SET heartbeat_at=? WHERE name=? AND token=?", (time.time(), name, token))
            except StorageError as exc:
                log.warning("writer lease heartbeat skipped: %s", exc)

    @property
    def location(self) -> str:
        return f"index state {self.path}"

    @property
    def index_location(self) -> str:
        """The index this state belongs to, in a busy writer's message."""
        return str(self.path.parent)

    def warm_up(self) -> None:
        """Open the read connection, when there is a state to read (none is created)."""
        self.exists()

    def health(self, index_state: Any = None) -> Health:
        try:
            sources, chunks = self.counts()
        except StoreMissing as exc:
            return Health.degraded(str(exc), sources=0, chunks=0)
        return Health.up(sources=sources, chunks=chunks)

    def close(self) -> None:
        with self._lock:
            self._drop_connection()


def expected_chunks(state: IndexState | None) -> int | None:
    """How many chunks a store of this index state should hold (0: none indexed yet; None: no state)."""
    if state is None:
        return None
    try:
        return state.counts()[1]
    except StoreMissing:
        return 0


def store_health(location: str, count: Callable[[], int], index_state: IndexState | None,
                 unit: str = "chunks") -> Health:
    """A store's health by its count: reachable, and holding as many ``unit`` as ``index_state``
    names chunks (when given). A store that is missing is degraded while nothing is indexed, down
    once the state holds chunks."""
    expected = expected_chunks(index_state)
    detail: dict[str, Any] = {} if expected is None else {"state_chunks": expected}
    try:
        detail["chunks"] = count()
    except StoreMissing as exc:
        detail["chunks"] = 0
        if expected:
            return Health.down(f"{exc} while the index state holds {expected} chunks", **detail)
        return Health.degraded(f"{exc}", **detail) if expected is None else Health.up(**detail)
    if expected is not None and detail["chunks"] != expected:
        return Health.down(f"{location} holds {detail['chunks']} {unit}, the index state names {expected} chunks; "
                           f"{REMEDY}", **detail)
    return Health.up(**detail)


def _add_acl_column(conn: sqlite3.Connection) -> None:
    """A state from before document access gets the ``acl`` column, NULL (unknown) for every source:
    the next ingestion run grants each its groups in place (metadata only, nothing re-embedded)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(sources)")}
    if "acl" not in columns:
        conn.execute("ALTER TABLE sources ADD COLUMN acl TEXT")


def _add_signal_column(conn: sqlite3.Connection) -> None:
    """A state from before change signals gets the ``signal`` column, NULL (unknown) for every source:
    the next run reads each once and records the signal it was read with."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(sources)")}
    if "signal" not in columns:
        conn.execute("ALTER TABLE sources ADD COLUMN signal TEXT")


def _add_change_log(conn: sqlite3.Connection) -> None:
    """The triggers that log chunk changes, and the log's record: a new id, complete from the current
    generation (a state from before the log: what happened earlier is not in it)."""
    conn.executescript(CHANGE_LOG)
    if conn.execute("SELECT 1 FROM meta WHERE key=?", (CHUNK_LOG,)).fetchone() is None:
        row = conn.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
        conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES(?, ?)",
                     (CHUNK_LOG, json.dumps({"id": uuid.uuid4().hex, "from": int(row[0]) if row else 0})))


def _rollback_journal(conn: sqlite3.Connection) -> None:
    """Rollback-journal mode, not WAL: a WAL file's readers create and keep its -wal and -shm files,
    so a query would change the index folder. A WAL file left by an older version is converted when
    no other connection holds it (else it stays WAL until a later run)."""
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise


def _acl_text(groups: Iterable[str]) -> str:
    return json.dumps(sorted(set(groups)))


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _batched(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _item_rows(rows: list, ids: list[str], item: str, lo: int = 0) -> tuple[list, int]:
    """The rows (sorted by source id) of one listed item: its own id and '<id>#...' (records,
    attachments), and where it is (no row of a later item lies before ``lo``: items are asked in order)."""
    at = bisect.bisect_left(ids, item, lo)
    own = [rows[at]] if at < len(ids) and ids[at] == item else []
    start, prefix = at + len(own), item + "#"
    if start < len(ids) and ids[start] < prefix:  # ids between the item and its records ('a.md!')
        start = bisect.bisect_left(ids, prefix, start)
    while start < len(ids) and ids[start].startswith(prefix) and ids[start] < prefix + "\U0010ffff":
        own.append(rows[start])
        start += 1
    return own, at
