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
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def same_process(pid: int, started: str | None) -> bool:
    """The process is alive and is the one recorded (its start time matches, when both are known)."""
    return pid_alive(pid) and (started is None or start_time(pid) in (None, started))
