"""Named crash points for crash-safety tests: RAGLINE_FAILPOINTS=name[:n],... kills the process
with SIGKILL the n-th time (default first) execution reaches ``hit(name)``. Unset, it costs a dict lookup."""
from __future__ import annotations

import os
import signal

from ragline.flows import settings

_counts: dict[str, int] = {}


def _armed() -> dict[str, int]:
    spec = settings.project().failpoints
    armed = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition(":")
        armed[name] = int(nth or 1)
    return armed


def hit(name: str) -> None:
    armed = _armed()
    if name not in armed:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] >= armed[name]:
        os.kill(os.getpid(), signal.SIGKILL)
