"""Writing a file so a reader never sees half of it: one helper for every record, index pointer and
cache entry ragline replaces in place."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ragline.flows.errors import ConfigError


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``: readers see
    the old content or the new, never a part, and a failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """A JSONL file's non-blank lines as (line number, value); a line that is not JSON is a
    ConfigError naming the file and the line. OSError as opening the file raises it."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not JSON: {exc.msg}", file=str(path), line=number) from None
