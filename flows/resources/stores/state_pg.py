"""The index state in PostgreSQL: one index written and read from several machines.

Selected by ``url:`` on the ``index_state`` resource (``state: {type: index_state, url:
postgresql://...}``); everything else is ``IndexState``'s own code. Only the plumbing differs:

- **SQL**: the tables, indexes and statements are state.py's, run through ``PgConnection``, which
  translates the few SQLite forms they use (``?`` marks, ``INSERT OR REPLACE``/``OR IGNORE``, a
  bare ``BEGIN``). The tables are created from state.py's ``SCHEMA`` and every column it names is
  added to an older schema (``ADD COLUMN IF NOT EXISTS``), so a column added there is added here.
- **The change log**: one PL/pgSQL trigger logs each written or deleted chunk with the generation,
  as the SQLite triggers do.
- **Writers**: every write transaction takes a transaction-scoped advisory lock first (SQLite's
  ``BEGIN IMMEDIATE``), so generation bumps never interleave; readers read snapshots (``REPEATABLE
  READ``) and never wait for a writer.
- **The writer lease** is a session advisory lock held by a connection of its own for the run,
  with the holder's description in the ``lease`` row. Why not a row lock (``SELECT ... FOR UPDATE``):
  that keeps a transaction open for the whole run, whose transaction id holds back VACUUM's horizon
  (the chunk rows the run rewrites stay dead until it ends) and which an ``idle_in_transaction_
  session_timeout`` would end. An advisory lock is released by the server when the holder's session
  ends for any reason (exit, kill -9: the socket closes; a lost machine: TCP keepalives, set to
  about 30 s on the session), and ``pg_locks`` tells readers whether it is held. A holder whose
  heartbeat stopped while its session lives (a frozen process) has its session ended
  (``pg_terminate_backend``), as the SQLite lease is taken over. The lease connection must reach
  the server directly or through a session-mode pooler (a transaction-mode pooler drops session locks).

The URL's password is never shown: ``location``, errors and health name ``user@host:port/db``.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

try:
    import psycopg
    from psycopg import sql as pgsql
    from psycopg.conninfo import conninfo_to_dict
except ImportError:  # the `postgres` extra is not installed: said when a state with a url is opened
    psycopg = None  # type: ignore[assignment]

from ragline.flows.resources.base import Health
from ragline.flows.resources.stores.state import (
    CHUNK_LOG, SCHEMA, IndexState, LeaseHolder, StateSpec, StorageError, StoreDamaged, StoreMissing)
from ragline.flows.resources.stores.summaries import DatabaseSummaries

if TYPE_CHECKING:
    from ragline.flows.resources.stores.protocols import SummaryStore

log = logging.getLogger("ragline.state")

LOCK_SPACE = 0x52414700  # the first key of ragline's advisory locks (the second: hashtext of schema.name)
CONNECT_TIMEOUT = 10
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
_SERVER_KEEPALIVES = "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3"


class StateUnreachable(StoreDamaged):
    """The state's database does not answer (down, refused, wrong credentials): nothing is damaged;
    the message names the server (never the password) and the reason."""

    error_code = "index_unavailable"


# ----------------------------------------------------------------------------- SQL from state.py
@cache
def tables() -> dict[str, tuple[list[tuple[str, str]], str]]:
    """state.py's tables: name -> ([(column, PostgreSQL definition)], primary key column)."""
    found = {}
    for name, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\)(?: WITHOUT ROWID)?;", SCHEMA, re.S):
        columns = [" ".join(part.split()) for part in body.split(",")]
        defs = [(c.split()[0], _pg_type(c.split(None, 1)[1])) for c in columns]
        key = next(col for col, definition in defs if "PRIMARY KEY" in definition)
        found[name] = (defs, key)
    return found


def _pg_type(definition: str) -> str:
    """SQLite's column types in PostgreSQL's words: REAL is a float8 (timestamps), INTEGER a bigint,
    TEXT compared byte by byte as SQLite does (collation "C"): the range scans over ids
    (``'<id>#'`` up to ``'<id>#\\U0010ffff'``) must not depend on the database's locale, which in
    en_US ignores punctuation such as '#' and '/'."""
    definition = re.sub(r"\bTEXT\b", 'TEXT COLLATE "C"', definition)
    return re.sub(r"\bINTEGER\b", "BIGINT", re.sub(r"\bREAL\b", "DOUBLE PRECISION", definition))


def schema_ddl() -> list[str]:
    """The CREATE statements of state.py's schema, for PostgreSQL, then every column as ADD COLUMN IF
    NOT EXISTS: a schema made by an older ragline gains the columns added since."""
    out = [f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(f'{c} {d}' for c, d in defs)})"
           for name, (defs, _) in tables().items()]
    out += [" ".join(s.split()) for s in re.findall(r"CREATE INDEX IF NOT EXISTS [^;]+", SCHEMA)]
    out += [f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {c} {d}" for name, (defs, key) in tables().items()
            for c, d in defs if c != key]
    return out


CHANGE_LOG_FUNCTION = """
CREATE OR REPLACE FUNCTION {schema}.log_chunk_change() RETURNS trigger LANGUAGE plpgsql SET search_path = {schema} AS $$
DECLARE g BIGINT;
BEGIN
    SELECT COALESCE(MAX(CAST(value AS BIGINT)), 0) INTO g FROM meta WHERE key = 'generation';
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        INSERT INTO chunk_changes VALUES (OLD.chunk_id, g) ON CONFLICT (chunk_id) DO UPDATE SET generation = g;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        INSERT INTO chunk_changes VALUES (NEW.chunk_id, g) ON CONFLICT (chunk_id) DO UPDATE SET generation = g;
    END IF;
    RETURN NULL;
END $$
"""
CHANGE_LOG_TRIGGER = ("CREATE OR REPLACE TRIGGER chunks_logged AFTER INSERT OR UPDATE OR DELETE ON chunks "
                      "FOR EACH ROW EXECUTE FUNCTION log_chunk_change()")


@cache
def translate(statement: str) -> str:
    """One of state.py's SQLite statements in PostgreSQL's words: ``?`` -> ``%s``; ``INSERT OR
    REPLACE`` -> an upsert of every given column on the table's key; ``INSERT OR IGNORE`` -> ``ON
    CONFLICT DO NOTHING``; a bare ``BEGIN`` (SQLite reads one snapshot) -> ``REPEATABLE READ``."""
    text = statement.strip()
    if text.upper() == "BEGIN":
        return "BEGIN ISOLATION LEVEL REPEATABLE READ"
    text = text.replace("%", "%%").replace("?", "%s")
    upsert = re.match(r"INSERT OR (REPLACE|IGNORE) INTO (\w+)\s*(\(([^)]*)\))?\s*VALUES", text, re.I)
    if upsert is None:
        return text
    how, table, _, listed = upsert.groups()
    text = f"INSERT INTO {text[upsert.start(2):]}"
    if how.upper() == "IGNORE":
        return f"{text} ON CONFLICT DO NOTHING"
    defs, key = tables()[table]
    columns = [c.strip() for c in listed.split(",")] if listed else [c for c, _ in defs]
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c != key)
    return f"{text} ON CONFLICT ({key}) DO " + (f"UPDATE SET {updates}" if updates else "NOTHING")


class PgConnection:
    """A psycopg connection that takes state.py's statements as they are written (``translate``):
    ``execute`` and ``executemany`` return a cursor (``fetchone``, ``fetchall``, iteration)."""

    def __init__(self, conn: Any):
        self.raw = conn

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Any:
        return self.raw.execute(translate(statement), tuple(params) or None)

    def executemany(self, statement: str, rows: Any) -> Any:
        cursor = self.raw.cursor()
        cursor.executemany(translate(statement), [tuple(r) for r in rows])
        return cursor

    def close(self) -> None:
        self.raw.close()


# ----------------------------------------------------------------------------- the resource
_OPEN: weakref.WeakSet[PostgresIndexState] = weakref.WeakSet()
_INHERITED: list[Any] = []  # a forked child's copies of its parent's connections: kept, never closed


def _forget_inherited_connections() -> None:
    """In a forked child: its parent's sessions are the parent's; closing one here would end it
    there (libpq says goodbye on the shared socket), so the child keeps them unused and opens its own."""
    for state in list(_OPEN):
        _INHERITED.extend(c for c in (state._conn, state._reader, *state._leases.values()) if c is not None)
        state._conn = state._reader = None
        state._leases = {}
        state._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_connections)


class PostgresIndexState(IndexState):
    """``IndexState`` on a PostgreSQL schema: the same methods and guarantees, several processes on
    several machines. Connections: one writer's, one reader's (read-only sessions), one per held lease."""

    def __init__(self, spec: StateSpec, base_dir: Path | None = None):
        super().__init__(spec, base_dir)
        if psycopg is None:
            raise ImportError(f"{self.location}: PostgreSQL needs psycopg: pip install 'ragline[postgres]'")
        self._leases: dict[str, Any] = {}
        _OPEN.add(self)

    # -- where
    @property
    def server(self) -> str:
        """user@host:port/db: the URL without its password (and without other parameters)."""
        try:
            info = conninfo_to_dict(self.spec.url)
        except Exception:  # noqa: BLE001 - a URL psycopg cannot parse: said without echoing it
            return "postgresql://<unparsable url>"
        user = f"{info['user']}@" if info.get("user") else ""
        port = f":{info['port']}" if info.get("port") else ""
        return f"postgresql://{user}{info.get('host', 'localhost')}{port}/{info.get('dbname', '')}"

    @property
    def location(self) -> str:
        return f"index state {self.server} (schema {self.spec.schema_name})"

    @property
    def index_location(self) -> str:
        return f"{self.server} (schema {self.spec.schema_name})"

    def summaries(self) -> SummaryStore:
        """This index's community summaries: rows of this schema's meta table, so every machine that
        reads the index reads the same ones (a file path would be one machine's)."""
        return DatabaseSummaries(self)

    def _redact(self, text: str) -> str:
        password = _password(self.spec.url)
        text = text.replace(self.spec.url, self.server)
        return text.replace(password, "***") if password else text

    # -- connections
    def _connect(self, *, read_only: bool = False, timeout: float = CONNECT_TIMEOUT) -> Any:
        options = "-c default_transaction_read_only=on" if read_only else ""
        conn = psycopg.connect(self.spec.url, autocommit=True, connect_timeout=max(1, int(timeout)),
                               application_name="ragline", options=options, **KEEPALIVES)
        conn.execute(pgsql.SQL("SET search_path TO {}").format(pgsql.Identifier(self.spec.schema_name)))
        return conn

    @property
    def conn(self) -> PgConnection:  # type: ignore[override]
        with self._guarded():
            if self._conn is None:
                raw = self._connect()
                try:
                    self._create(raw)
                except BaseException:
                    raw.close()
                    raise
                self._conn = PgConnection(raw)
            return self._conn

    def _create(self, raw: Any) -> None:
        """The schema, its tables, the change log's trigger and record, when any is missing: in one
        transaction after any other process doing the same and after every write in flight (DDL
        locks tables exclusively; taken in a writer's order it cannot deadlock with one). A
        current schema is only read: a new writer's session never blocks readers or writers."""
        if self._current(raw):
            return
        schema = pgsql.Identifier(self.spec.schema_name)
        with raw.transaction():
            raw.execute("SELECT pg_advisory_xact_lock(%s::integer, hashtext(%s))", (LOCK_SPACE, self._key("schema")))
            raw.execute("SELECT pg_advisory_xact_lock(%s::integer, hashtext(%s))", (LOCK_SPACE, self._key("write")))
            raw.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
            for statement in schema_ddl():
                raw.execute(statement)
            raw.execute(pgsql.SQL(CHANGE_LOG_FUNCTION.format(schema="{schema}")).format(schema=schema))
            raw.execute(CHANGE_LOG_TRIGGER)
            generation = raw.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
            record = {"id": uuid.uuid4().hex, "from": int(generation[0]) if generation else 0}
            raw.execute("INSERT INTO meta(key, value) VALUES(%s, %s) ON CONFLICT DO NOTHING",
                        (CHUNK_LOG, json.dumps(record)))

    def _current(self, raw: Any) -> bool:
        """Whether every table, column and index of state.py's schema, the change log's trigger and
        its record are there (read from the catalogs, no lock taken)."""
        present = set(raw.execute("SELECT table_name, column_name FROM information_schema.columns "
                                  "WHERE table_schema = %s", (self.spec.schema_name,)).fetchall())
        wanted = {(table, column) for table, (defs, _) in tables().items() for column, _ in defs}
        if not wanted <= present:
            return False
        indexes = re.findall(r"CREATE INDEX IF NOT EXISTS (\w+)", SCHEMA)
        found = raw.execute("SELECT " + ", ".join(["to_regclass(%s) IS NOT NULL"] * len(indexes) + [
            "EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'chunks_logged' AND tgrelid = to_regclass('chunks'))",
            "EXISTS (SELECT 1 FROM meta WHERE key = %s)"]), (*indexes, CHUNK_LOG)).fetchone()
        return all(found)

    @property
    def reader(self) -> PgConnection:  # type: ignore[override]
        """The writer's connection once this process has written, else a read-only session that
        never creates anything. A schema without the state's tables raises StoreMissing."""
        with self._guarded():
            if self._conn is not None:
                return self._conn
            if self._reader is None:
                raw = self._connect(read_only=True)
                if raw.execute("SELECT to_regclass('meta')").fetchone()[0] is None:
                    raw.close()
                    raise StoreMissing(f"{self.location} holds no index: nothing is indexed yet, or it was dropped; "
                                       f"run `ragline index`")
                self._reader = PgConnection(raw)
            return self._reader

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        """Hold the lock; the database's faults in ragline's words, naming the server, never the
        password: unreachable -> StateUnreachable, out of disk -> StorageError, a missing table ->
        StoreDamaged. The connections are dropped then, so a later call starts afresh."""
        with self._lock:
            try:
                yield
            except psycopg.Error as exc:
                fault = self._fault(exc)
                if fault is None:
                    raise
                self._drop_connection()
                raise fault from None

    def _fault(self, exc: BaseException) -> Exception | None:
        reason = self._redact(" ".join(str(exc).split()))
        state = getattr(exc, "sqlstate", None) or ""
        if state.startswith("53"):  # insufficient resources: disk full, out of memory
            fault = StorageError(errno.ENOSPC, f"{self.location}: the database server is out of space or memory "
                                               f"({type(exc).__name__}: {reason})")
            fault.filename = self.server
            return fault
        if state in ("42P01", "3F000"):  # a table or the schema dropped under a state that had them
            return self.damaged(reason)
        if (isinstance(exc, psycopg.OperationalError) and not state) or state.startswith(("08", "57P", "28")):
            return StateUnreachable(f"{self.location} is unreachable ({type(exc).__name__}: {reason}); check that "
                                    f"the database is up and the url's host, port and credentials")
        return None

    def damaged(self, exc: BaseException | str) -> StoreDamaged:
        schema = self.spec.schema_name
        return StoreDamaged(f"{self.location} is damaged ({self._redact(str(exc))}): drop it (DROP SCHEMA {schema} "
                            f"CASCADE) and run `ragline index` to re-index every source")

    def _drop_connection(self) -> None:
        for conn in (self._conn, self._reader):
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass
        self._conn = self._reader = None

    def _key(self, name: str) -> str:
        return f"{self.spec.schema_name}.{name}"

    @contextmanager
    def transaction(self) -> Iterator[PgConnection]:  # type: ignore[override]
        """One write transaction, after every other writer's (SQLite's BEGIN IMMEDIATE)."""
        with self._guarded():
            conn = self.conn
            with conn.raw.transaction():
                conn.raw.execute("SELECT pg_advisory_xact_lock(%s::integer, hashtext(%s))", (LOCK_SPACE, self._key("write")))
                yield conn

    def peek(self, sql: str, params: tuple[Any, ...], wait: float) -> tuple[Any, ...] | None:
        """One row on a session of its own that gives up after ``wait`` seconds (a status read)."""
        with self._guarded():
            raw = self._connect(read_only=True, timeout=wait)
            try:
                raw.execute("SELECT set_config('statement_timeout', %s, false)", (f"{max(1, int(wait * 1000))}ms",))
                if raw.execute("SELECT to_regclass('meta')").fetchone()[0] is None:
                    raise StoreMissing(f"{self.location} holds no index: nothing is indexed yet")
                return PgConnection(raw).execute(sql, params).fetchone()
            finally:
                raw.close()

    def quick_check(self) -> str | None:
        """PostgreSQL keeps its own pages sound; what can go wrong here is a table or the change
        log's trigger dropped by hand: None when all are there, else what is missing."""
        with self._guarded():
            present = {r[0] for r in self.reader.raw.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (self.spec.schema_name,))}
            trigger = self.reader.raw.execute(
                "SELECT 1 FROM pg_trigger WHERE tgname = 'chunks_logged' AND tgrelid = to_regclass('chunks')").fetchone()
        missing = [t for t in tables() if t not in present] + ([] if trigger else ["the chunk change trigger"])
        return f"missing: {', '.join(missing)}" if missing else None

    # -- the writer lease: a session advisory lock (see the module's docstring)
    _HOLDER = ("SELECT l.holder, l.pid, l.host, l.acquired_at, l.heartbeat_at FROM lease l WHERE l.name = ? AND "
               "EXISTS (SELECT 1 FROM pg_locks k WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 2 AND "
               "k.classid = CAST(? AS INTEGER)::oid AND k.objid = hashtext(?)::oid AND k.database = "
               "(SELECT oid FROM pg_database WHERE datname = current_database()))")

    def lease_holder(self, name: str = "writer", *, wait: float | None = None) -> LeaseHolder | None:
        """Who holds the lease ``name`` now: a row whose holder's session still holds the lock (none
        while the schema does not exist)."""
        try:
            row = self._row(self._HOLDER, (name, LOCK_SPACE, self._key(f"lease.{name}")), wait)
        except StoreMissing:
            return None
        return LeaseHolder(*row) if row else None

    @contextmanager
    def lease(self, holder: str, **options: Any) -> Iterator[None]:
        name = options.get("name", "writer")
        try:
            with super().lease(holder, **options):
                yield
        finally:
            session = self._leases.pop(name, None)
            if session is not None:
                session.close()  # ends the session: the lock is the server's to release

    def _try_acquire(self, name: str, holder: str, token: str, stale_after: float) -> LeaseHolder | None:
        """Take the lock on a session of its own and describe the holder in the row; else who holds
        it. A holder whose heartbeat stopped (or a dead process on this host) has its session ended."""
        with self._guarded():
            session = self._connect()  # a session of its own: a lock taken twice by one session is granted twice
            try:
                session.execute(_SERVER_KEEPALIVES)
                got = session.execute("SELECT pg_try_advisory_lock(%s::integer, hashtext(%s))",
                                      (LOCK_SPACE, self._key(f"lease.{name}"))).fetchone()[0]
                if not got:
                    current = self.lease_holder(name)
                    if current is not None and current.stale(time.time(), stale_after) and self._end_holder(name):
                        got = session.execute("SELECT pg_try_advisory_lock(%s::integer, hashtext(%s))",
                                              (LOCK_SPACE, self._key(f"lease.{name}"))).fetchone()[0]
                    if not got:
                        session.close()
                        return current or LeaseHolder("a run starting", 0, "?", time.time(), time.time())
                now = time.time()
                self.conn  # the schema exists before the row is written
                PgConnection(session).execute("INSERT OR REPLACE INTO lease VALUES (?, ?, ?, ?, ?, ?, ?)",
                                              (name, holder, os.getpid(), socket.gethostname(), token, now, now))
            except BaseException:
                session.close()
                raise
            self._leases[name] = session
        return None

    def _end_holder(self, name: str) -> bool:
        """End the session of a lease holder that stopped beating: its lock goes with it."""
        row = self.conn.raw.execute(
            "SELECT bool_and(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
            "objsubid = 2 AND classid = %s::integer::oid AND objid = hashtext(%s)::oid AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
            (LOCK_SPACE, self._key(f"lease.{name}"))).fetchone()
        ended = bool(row and row[0])
        if ended:
            log.warning("%s: ended the session of a writer lease holder whose heartbeat stopped", self.location)
            time.sleep(0.1)  # the server releases the lock as the session exits
        return ended

    def _heartbeat(self, name: str, token: str, every: float, stop: threading.Event) -> None:
        """Beat through the lease's own session, so a beat also proves the lock is still held; a
        session lost (the server restarted, the network gone) is said once: the lease is lost."""
        told = False
        while not stop.wait(every):
            session = self._leases.get(name)
            if session is None:
                continue
            try:
                session.execute("UPDATE lease SET heartbeat_at = %s WHERE name = %s AND token = %s",
                                (time.time(), name, token))
            except psycopg.Error as exc:
                if not told:
                    log.error("%s: the writer lease's session was lost (%s): another writer may take the lease",
                              self.location, self._redact(str(exc)))
                    told = True

    def health(self, index_state: Any = None) -> Health:
        try:
            return super().health(index_state)
        except StateUnreachable as exc:
            return Health.down(str(exc), server=self.server, schema=self.spec.schema_name)

    def close(self) -> None:
        with self._lock:
            self._drop_connection()


def _password(url: str | None) -> str | None:
    try:
        return conninfo_to_dict(url or "").get("password") or None
    except Exception:  # noqa: BLE001 - unparsable: nothing to hide that we could find
        return None
