"""The index state record: one SQLite file that says what both indexes should contain.

It maps each source to its content hash, the settings fingerprint that produced its chunks,
and the chunks themselves (text and metadata, from which the BM25 index is rebuilt). Writes
follow "forget, write, record": a crash at any point leaves the state naming only chunks that
are fully written, and ``reconcile`` removes whatever the stores hold beyond it.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Chunk, Document

SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    source_id TEXT PRIMARY KEY, origin TEXT NOT NULL, content_hash TEXT NOT NULL,
    fingerprint TEXT NOT NULL, path TEXT, title TEXT, indexed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    chunk_id TEXT PRIMARY KEY, source_id TEXT NOT NULL, ordinal INTEGER NOT NULL,
    text TEXT NOT NULL, title TEXT, metadata TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_source ON chunks(source_id);
CREATE INDEX IF NOT EXISTS sources_by_origin ON sources(origin);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lease (
    name TEXT PRIMARY KEY, holder TEXT NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
    token TEXT NOT NULL, acquired_at REAL NOT NULL, heartbeat_at REAL NOT NULL);
"""


class IndexBusy(RuntimeError):
    """Another ingestion run holds the index's writer lease."""


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
        return self.host == socket.gethostname() and not _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["index_state"]
    path: str = Field(".ragline/state.sqlite", description="SQLite file beside the indexes")


class IndexState:
    """Thread-safe access to the state file; every public write is one transaction."""

    def __init__(self, spec: StateSpec, base_dir: Path | None = None):
        self.spec = spec
        self.base_dir = base_dir or Path.cwd()
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.RLock()

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=60)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(SCHEMA)
            self._conn = conn
        return self._conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._lock:
            row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
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
        with self._lock:
            return {r[0]: (r[1], r[2]) for r in self.conn.execute(sql, args)}

    def known(self, source_ids: Iterable[str]) -> set[str]:
        """Which of these sources the state already has."""
        found: set[str] = set()
        with self._lock:
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                found.update(r[0] for r in self.conn.execute(
                    f"SELECT source_id FROM sources WHERE source_id IN ({marks})", batch))
        return found

    def chunk_ids(self, source_ids: Iterable[str] | None = None) -> set[str]:
        with self._lock:
            if source_ids is None:
                return {r[0] for r in self.conn.execute("SELECT chunk_id FROM chunks")}
            ids: set[str] = set()
            for batch in _batched(list(source_ids), 500):
                marks = ",".join("?" * len(batch))
                ids.update(r[0] for r in self.conn.execute(
                    f"SELECT chunk_id FROM chunks WHERE source_id IN ({marks})", batch))
            return ids

    def chunk_rows(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(chunk_id, text, metadata) of every chunk, in a stable order, for the BM25 rebuild."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT chunk_id, text, metadata, source_id, title FROM chunks ORDER BY chunk_id").fetchall()
        return [(cid, text, {**json.loads(meta), "source_id": sid, "title": title or ""})
                for cid, text, meta, sid, title in rows]

    def chunks_by_id(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for batch in _batched(ids, 500):
                marks = ",".join("?" * len(batch))
                for cid, sid, text, title, meta in self.conn.execute(
                        f"SELECT chunk_id, source_id, text, title, metadata FROM chunks "
                        f"WHERE chunk_id IN ({marks})", batch):
                    out[cid] = {"source_id": sid, "text": text, "title": title or "", "metadata": json.loads(meta)}
        return out

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return (self.conn.execute("SELECT COUNT(*) FROM sources").fetchone()[0],
                    self.conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

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
                "INSERT OR REPLACE INTO sources VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(d.source_id, origin, d.content_hash, fingerprint, d.path, d.title, now) for d in documents])
            tx.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?)",
                [(c.chunk_id, c.source_id, c.ordinal, c.text, c.title, json.dumps(c.metadata)) for c in chunks])
            self._bump(tx)

    # ------------------------------------------------------------------ writer lease
    def lease_holder(self, name: str = "writer") -> LeaseHolder | None:
        with self._lock:
            row = self.conn.execute("SELECT holder, pid, host, acquired_at, heartbeat_at FROM lease WHERE name=?",
                                    (name,)).fetchone()
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
                raise IndexBusy(f"the index at {self.path.parent} is being written by {current.describe()}; "
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
        while not stop.wait(every):
            with self.transaction() as tx:
                tx.execute("UPDATE lease SET heartbeat_at=? WHERE name=? AND token=?", (time.time(), name, token))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _batched(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
