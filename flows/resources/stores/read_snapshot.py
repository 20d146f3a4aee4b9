"""A private, consistent copy of an embedded store's folder, for a process that only reads it.

Why: embedded Chroma (1.5) writes its folder whenever a process opens it, even to read: opening a
``PersistentClient`` inserts a row into ``chroma.sqlite3`` (its ``acquire_write`` table), and the
first read of a collection replays the log into the HNSW segment and saves it (``length.bin``,
and the other segment files when vectors were still unsaved), then purges the log. Chroma has no
read-only mode, and a reader that skipped its engine would have to re-implement its log, HNSW and
metadata formats. So a process that has not written opens a copy: the store's own files are never
written by a ``search``, ``ask``, ``eval`` or ``check``, and a copy taken while an ingestion run
writes the folder is detected (a file changed during the copy) and taken again. A long-lived reader (``ragline api``
over an embedded folder, a test process) compares the folder's ``mark`` before every read and
takes a new copy once another process (or its own ingestion) has written. A process that
goes on to write (ingestion, ``check --repair``) drops the copy and opens the folder itself.

The copy costs what the folder weighs (``os.sendfile`` in the kernel, a reflink on file systems
that have them); docs/configuration.md gives the figures. While ``ragline serve``/``api`` runs,
its managed Chroma server owns the folder and no process copies it (``ops.chroma_server``).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ragline.flows.resources.stores.state import IndexBusy, StorageError, disk_fault

log = logging.getLogger("ragline.snapshot")

ATTEMPTS = 12  # copies tried while a writer keeps changing the folder (backoff 0.05 s doubling, 2 s cap: ~15 s)
SKIPPED = ("-shm",)  # SQLite's shared-memory index: rebuilt by the first connection, never copied
_open: set[Path] = set()  # snapshots of this process, removed at exit if a store was never closed


def take(source: Path, what: str) -> Path:
    """A private copy of the folder ``source`` that no file change interrupted; IndexBusy naming
    the folder when a writer kept changing it through every attempt."""
    for attempt in range(ATTEMPTS):
        before = signature(source)
        target = Path(tempfile.mkdtemp(prefix="ragline-read-"))
        _open.add(target)
        try:
            copied = _copied(source, target, what)
        except BaseException:
            discard(target)
            raise
        if copied and signature(source) == before:
            return target
        discard(target)
        time.sleep(min(2.0, 0.05 * 2 ** attempt))
    raise IndexBusy(f"{what}: {source} kept changing while it was copied for reading ({ATTEMPTS} attempts): an "
                    f"ingestion run is writing it; try again when it ends, or serve the store (`ragline serve`)")


def mark(folder: Path) -> tuple[tuple[str, int, int, int], ...]:
    """The files directly in ``folder`` (Chroma's ``chroma.sqlite3`` and its journal) with size,
    modification time and inode: every write to the store changes one (its log and metadata live
    there), so a reader compares it before each read to know its copy is stale. A few stat calls:
    cheap enough for every query."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return ()
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and not entry.name.endswith(SKIPPED):
                info = entry.stat(follow_symlinks=False)
                found.append((entry.name, info.st_size, info.st_mtime_ns, info.st_ino))
        except FileNotFoundError:
            continue
    return tuple(sorted(found))


def signature(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``folder`` with its size, modification time and inode: a write changes one."""
    found = {}
    for path in folder.rglob("*"):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if path.is_file() and not path.name.endswith(SKIPPED):  # (a writer's reads change its -shm)
            found[str(path.relative_to(folder))] = (info.st_size, info.st_mtime_ns, info.st_ino)
    return found


def discard(snapshot: Path | None) -> None:
    """Remove a snapshot (nothing when None)."""
    if snapshot is not None:
        shutil.rmtree(snapshot, ignore_errors=True)
        _open.discard(snapshot)


def _copied(source: Path, target: Path, what: str) -> bool:
    """Copy ``source`` into ``target``: False when a file vanished meanwhile (a writer replaced it);
    a disk that refuses the copy (full temporary folder) is a StorageError naming both folders."""
    try:
        _copy(source, target)
    except FileNotFoundError:
        return False
    except shutil.Error as exc:  # copytree's list of (source, target, reason), one per file that failed
        if all("No such file" in str(reason) for *_, reason in exc.args[0]):
            return False
        raise _refused(exc, source, target, what) from exc
    except OSError as exc:
        raise _refused(exc, source, target, what) from exc
    return True


def _refused(exc: BaseException, source: Path, target: Path, what: str) -> StorageError:
    return disk_fault(exc, target, f"{what}: the private copy for reading in") or StorageError(
        f"{what}: could not copy {source} to {target} for reading ({type(exc).__name__}: {exc})")


def _copy(source: Path, target: Path) -> None:
    shutil.copytree(source, target, dirs_exist_ok=True,
                    ignore=lambda _folder, names: [n for n in names if n.endswith(SKIPPED)])


@atexit.register
def _remove_left() -> None:
    for snapshot in list(_open):
        discard(snapshot)
