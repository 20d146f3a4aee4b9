"""Real disk faults for tests: a small tmpfs that fills up (ENOSPC), a read-only bind mount over a
folder (EROFS), and a child process without root's permission override (EACCES). Root in a
container may mount; where it may not, the test is skipped saying why."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


def _umount(path: Path) -> None:
    # Lazy: a store (Chroma's engine) may still hold a file open; the mount goes once it is closed.
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "8m") mounted on ``path`` (created); unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        _umount(path)


def resize(path: Path, size: str) -> None:
    """Give a mounted tmpfs more (or less) room."""
    done = _mount("-o", f"remount,size={size}", str(path))
    assert done.returncode == 0, done.stderr


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` seen read-only (a read-only bind mount of itself on top) until the block ends.
    Files a process opened before stay writable through the mount below: open stores anew inside."""
    done = _mount("--bind", str(path), str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        done = _mount("-o", "remount,bind,ro", str(path))
        assert done.returncode == 0, done.stderr
        yield path
    finally:
        _umount(path)


def fill(folder: Path, leave: int = 0, name: str = "filler") -> Path:
    """Take all the free space of ``folder``'s file system but ``leave`` bytes; returns the filler
    (delete it to free the space)."""
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    filler = folder / name
    chunk = b"\0" * (1 << 20)
    remaining = max(free - leave, 0)
    with open(filler, "wb") as out:
        try:
            while remaining > 0:
                remaining -= out.write(chunk[:min(len(chunk), remaining)])
        except OSError:  # filled exactly: fine
            pass
    return filler


def free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def without_root_override(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python ``code`` as root minus CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (dropped from the
    bounding set before exec), so file modes bind it as they bind any user: a real EACCES. (Not
    root: run as is, modes bind already.)"""
    def drop() -> None:
        if os.geteuid() != 0:
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                os._exit(77)

    from tests.helpers.data import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=drop)
    if done.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (not root, or no CAP_SETPCAP)")
    return done
