"""The index state record: one SQLite file that says what both indexes should contain.

It maps each source to its content hash, the settings fingerprint that produced its chunks,
and the chunks themselves (text and metadata, from which the BM25 index is rebuilt). Writes
follow "forget, write, record": a crash at any point leaves the state naming only chunks that
are fully written, and ``reconcile`` removes whatever the stores hold beyond it.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from flows.contracts import Chunk, Document

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
"""


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

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _batched(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
