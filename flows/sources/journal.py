"""A change journal for a local folder root: the paths that changed below it, kept by a file
watcher while ``ragline serve`` runs, so a scheduled ingestion run looks at what changed instead of
listing (and stat-ing) every file of the corpus (issue 22: at 300,000 files a full listing alone
costs ~4.5 s of CPU).

The watcher (``FolderWatcher``, a thread of the serving process) writes one SQLite file per root
(``journal_file``): its *epoch* (a fresh id each time it starts watching), when its watches were in
place (``ready``), a heartbeat, and every changed path with a sequence number. ``load`` reads it
(``Journal.live``) and trusts it only when all of these hold, else it lists the root in full:

- the watcher is alive (a heartbeat in the last ``LIVE_SECONDS``) and reported no error;
- a full listing of the root started after this epoch's watches were in place and its run
  finished (the index state's record of it, written at the run's end: ``load``'s business);
- that full listing is younger than the root's ``full_listing_hours`` (a safety net for what a
  watcher cannot see: a change made while the machine's events overflowed, a network mount).

A path leaves the journal only once a run found the index agreeing with it (``settle``: the
file's recorded signal is its signal on disk, or a gone path has nothing indexed below it), and
only if no event came for it since it was read (its sequence number is unchanged). A run that
crashes therefore leaves every path it was given in the journal for the next one.

Sits at the resources layer (with the other sources); ``tasks.load`` reads journals and
``flows.serve`` runs the watchers.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ragline.journal")

JOURNAL_DIR = Path(".ragline") / "journal"
HEARTBEAT_MS = 2_000  # the watcher writes a heartbeat at least this often
LIVE_SECONDS = 10.0  # a journal whose heartbeat is older than this is a killed (or stuck) watcher's
RESTART_SECONDS = 5.0  # a watcher that failed starts over (a new epoch) after this long, doubling while
MAX_RESTART_SECONDS = 300.0  # it fails before its watches are in place (a missing root, a full inotify table)

SCHEMA = """
CREATE TABLE IF NOT EXISTS watcher (
    id INTEGER PRIMARY KEY CHECK (id = 1), root TEXT NOT NULL, epoch TEXT NOT NULL, ready REAL,
    beat REAL NOT NULL, error TEXT, folder TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS changes (path TEXT PRIMARY KEY, seq INTEGER NOT NULL);
"""


def journal_file(data_dir: str | Path, pipeline: str, root: str) -> Path:
    """Where a pipeline's journal of the folder ``root`` lives under the project's data folder:
    one file per pipeline and root (each pipeline drops what its own index agrees with), named by
    a digest of both (the same folder under two names shares one)."""
    key = f"{pipeline}\n{os.path.realpath(root)}".encode("utf-8", "surrogateescape")
    return Path(data_dir) / JOURNAL_DIR / f"{hashlib.sha256(key).hexdigest()[:24]}.sqlite"


def folder_identity(path: str) -> str | None:
    """A folder's device and inode: a root deleted and made again (or replaced by a move) is another
    folder, which the watcher's watches do not see into."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return f"{info.st_dev}:{info.st_ino}"


@dataclass(frozen=True)
class Watch:
    """What a journal says of its watcher: which root, since when (``ready``: its watches were in
    place, None while it starts), its last heartbeat, its error if it stopped on one, and the
    identity of the folder it watches (``folder_identity``)."""

    root: str
    epoch: str
    ready: float | None
    beat: float
    error: str | None
    folder: str

    def live(self, now: float | None = None) -> bool:
        """Whether the watcher is running on the folder now at its root's path."""
        now = time.time() if now is None else now
        return (self.error is None and self.ready is not None and now - self.beat <= LIVE_SECONDS
                and folder_identity(self.root) == self.folder)


class Journal:
    """One root's journal file: written by its watcher, read and settled by ingestion runs (each
    under its own connection; SQLite's WAL lets them overlap)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @contextlib.contextmanager
    def _connect(self, create: bool = False) -> Iterator[sqlite3.Connection]:
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path if create else f"file:{self.path}?mode=rw", uri=not create, timeout=30,
                               isolation_level=None)
        try:
            if create:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(SCHEMA)
            yield conn
        finally:
            conn.close()

    # --- the watcher's side
    def begin(self, root: str, folder: str) -> str:
        """A new epoch for ``root`` (the folder ``folder_identity`` names): the old one's paths are
        dropped (a run under the new epoch lists the root in full first, which sees what they said)."""
        epoch = uuid.uuid4().hex
        with self._connect(create=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM changes")
            conn.execute("INSERT OR REPLACE INTO watcher VALUES (1, ?, ?, NULL, ?, NULL, ?)",
                         (root, epoch, time.time(), folder))
            conn.execute("COMMIT")
        return epoch

    def record(self, epoch: str, paths: Iterable[str], *, ready: bool = False) -> None:
        """Paths that changed (each gets a new sequence number) and a heartbeat; ``ready``: the
        watches are in place from now on. Ignored once another epoch took over the file."""
        now = time.time()
        rows = [(path, time.time_ns()) for path in paths]
        with self._connect() as conn:  # made by ``begin`` (gone since: the watcher starts a new epoch)
            conn.execute("BEGIN IMMEDIATE")
            if conn.execute("SELECT 1 FROM watcher WHERE epoch=?", (epoch,)).fetchone() is None:
                conn.execute("ROLLBACK")
                return
            conn.executemany("INSERT INTO changes VALUES (?, ?) ON CONFLICT(path) DO UPDATE SET seq=excluded.seq",
                             rows)
            conn.execute("UPDATE watcher SET beat=? WHERE epoch=?", (now, epoch))
            if ready:
                conn.execute("UPDATE watcher SET ready=COALESCE(ready, ?) WHERE epoch=?", (now, epoch))
            conn.execute("COMMIT")

    def fail(self, epoch: str, error: str) -> None:
        """The watcher stopped on an error: the journal is not trusted until a new epoch."""
        with contextlib.suppress(sqlite3.Error), self._connect() as conn:
            conn.execute("UPDATE watcher SET error=? WHERE epoch=?", (error[:500], epoch))

    # --- the ingestion run's side
    def watch(self) -> Watch | None:
        """The watcher's record, or None without a journal (no watcher ever ran for the root)."""
        try:
            with self._connect() as conn:
                row = conn.execute("SELECT root, epoch, ready, beat, error, folder FROM watcher").fetchone()
        except sqlite3.Error:  # none, or an older layout: list in full
            return None
        return Watch(*row) if row else None

    def changes(self) -> dict[str, int]:
        """Every path in the journal, with its sequence number (what ``settle`` compares)."""
        with self._connect() as conn:
            return dict(conn.execute("SELECT path, seq FROM changes").fetchall())

    def settle(self, paths: dict[str, int]) -> int:
        """Drop paths the index now agrees with, each only if no event came for it since it was
        read (its sequence number is the one given). Returns how many were dropped."""
        if not paths:
            return 0
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            before = conn.total_changes
            conn.executemany("DELETE FROM changes WHERE path=? AND seq=?", list(paths.items()))
            dropped = conn.total_changes - before
            conn.execute("COMMIT")
        return dropped


class FolderWatcher:
    """Keeps a folder root's journals (one per pipeline that lists it) while it runs: a thread that
    watches the folder recursively (``watchfiles``: inotify on Linux) and records every path an
    event names. A watcher error ends the epoch (the journals say so; runs list in full) and the
    watcher starts over with a new one."""

    def __init__(self, root: str, journals: list[Journal]):
        self.root = os.path.realpath(root)
        self.journals = journals
        self.epochs: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    def start(self) -> FolderWatcher:
        self._thread = threading.Thread(target=self._run, name=f"ragline-watch-{Path(self.root).name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        pause = RESTART_SECONDS / 2
        while not self._stop.is_set():
            try:
                self._watch()
                self._fail("stopped")  # a run after this lists in full: nothing records changes now
            except Exception as exc:  # noqa: BLE001 - any watcher failure: runs list in full meanwhile
                hint = (" (the system's inotify limit: raise fs.inotify.max_user_watches)"
                        if "space left" in str(exc).lower() or "too many" in str(exc).lower() else "")
                pause = RESTART_SECONDS if self.ready.is_set() else min(2 * pause, MAX_RESTART_SECONDS)
                log.warning("watching %s failed (%s: %s)%s; ingestion runs list it in full until the watcher is "
                            "back (next try in %.0f s)", self.root, type(exc).__name__, exc, hint, pause)
                self._fail(f"{type(exc).__name__}: {exc}")
                self.ready.clear()
                self._stop.wait(pause)

    def _fail(self, error: str) -> None:
        for journal, epoch in zip(self.journals, self.epochs):
            journal.fail(epoch, error)

    def _watch(self) -> None:
        from watchfiles import watch

        folder = folder_identity(self.root)
        if folder is None:
            raise FileNotFoundError(f"no folder {self.root}")
        self.epochs = [journal.begin(self.root, folder) for journal in self.journals]
        first = True
        # the watches are in place once ``watch`` first yields (its Rust side adds them when it is
        # created): only then is the epoch ``ready``; a timeout yields an empty set, the heartbeat
        # a journal may lie below its root (a data folder inside it): its writes (the file, its -wal
        # and -shm) are no change of the corpus, and recording them would write again, forever
        own = tuple({os.path.join(os.path.realpath(j.path.parent), j.path.name) for j in self.journals})
        for changes in watch(self.root, stop_event=self._stop, yield_on_timeout=True, rust_timeout=HEARTBEAT_MS,
                             debounce=400, step=50, raise_interrupt=False,
                             watch_filter=lambda _, path: not path.startswith(own)):
            if folder_identity(self.root) != folder:  # the root was replaced: its new folder is not watched
                raise FileNotFoundError(f"{self.root} was deleted or replaced")
            paths = sorted({path for _, path in changes})
            for journal, epoch in zip(self.journals, self.epochs):
                journal.record(epoch, paths, ready=first)
            if first:
                self.ready.set()
                first = False
