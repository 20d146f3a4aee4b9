"""Measuring a run's tracemalloc peak: in a fresh interpreter, without CPython's table of interned
strings in it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.data import REPO

_CALL = """
import json, sys
from importlib import import_module
module, name = sys.argv[1].rsplit(":", 1)
result = getattr(import_module(module), name)(*json.loads(sys.argv[2]))
with open(sys.argv[3], "w") as out:
    json.dump(result, out)
"""


def interned_names(folder: Path) -> list[str]:
    """Every path part below ``folder``, interned: hold the list while measuring. Why: the table of
    interned strings is one per process and is reallocated whole when it fills (3.8 MB in a test
    worker, 8 MB in one that ran many tests first); pathlib interns each path's parts each time a
    Path is made, so a run over more files crossed that point more often and charged the table to
    its documents (CI: 0.8 MB over 800 documents; 8 MB over 480). Held, the names are found in the
    table, never added."""
    return [sys.intern(part) for path in folder.rglob("*") for part in path.parts]


def in_a_fresh_process(target: str, *args: Any, result: Path, timeout: float = 1500) -> Any:
    """``module:function`` called with JSON ``args`` in a new interpreter, its JSON result back.
    Why: tracemalloc traces every thread of a process, and a test worker keeps the threads earlier
    tests left (a served app's, a client's pool): what they allocated inside a run's window was
    charged to its documents (CI: 257 B a document on a 150 B bound that measures 1 B alone)."""
    done = subprocess.run([sys.executable, "-c", _CALL, target, json.dumps(args), str(result)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{target} failed in its own process:\n{done.stderr[-4000:]}"
    return json.loads(result.read_text())
