"""Is a recorded process still the one that wrote the record? Liveness by pid, identity by the
process's start time (pids are reused). Shared by every file that names a live ragline process:
the index lease, a managed Chroma server's record, the running API's discovery file."""
from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Some process has ``pid`` (one we may not signal counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), as records keep it; None if unknown."""
    return _stat_field(pid, 19)


def parent_pid(pid: int) -> int | None:
    """The process's parent (Linux); None if unknown (gone, or no /proc)."""
    parent = _stat_field(pid, 1)
    return int(parent) if parent is not None else None


def _stat_field(pid: int, index: int) -> str | None:
    """A field of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def same_process(pid: int, started: str | None) -> bool:
    """The process is alive and is the one recorded (its start time matches, when both are known)."""
    return pid_alive(pid) and (started is None or start_time(pid) in (None, started))
