"""Measuring a run's tracemalloc peak without CPython's table of interned strings in it."""
from __future__ import annotations

import sys
from pathlib import Path


def interned_names(folder: Path) -> list[str]:
    """Every path part below ``folder``, interned: hold the list while measuring. Why: the table of
    interned strings is one per process and is reallocated whole when it fills (3.8 MB in a test
    worker, 8 MB in one that ran many tests first); pathlib interns each path's parts each time a
    Path is made, so a run over more files crossed that point more often and charged the table to
    its documents (CI: 0.8 MB over 800 documents; 8 MB over 480). Held, the names are found in the
    table, never added."""
    return [sys.intern(part) for path in folder.rglob("*") for part in path.parts]
