"""Reading a served data dir's query log from a test while the server writes it."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ragline.flows.serve.query_log import LOG_FOLDER, LOG_NAME, read_lines


def logged_entry(data_dir: Path, answer_id: str, timeout: float = 120.0) -> dict[str, Any]:
    """The log's entry for one answer. Entries are written off the response path (a starved server
    writes late), and a line being written is torn until its end: the product's reader skips it."""
    path = data_dir / LOG_FOLDER / LOG_NAME
    deadline = time.monotonic() + timeout
    while True:
        mine = [entry for entry in read_lines(path) if entry.get("answer_id") == answer_id]
        if mine:
            return mine[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"answer {answer_id} is not in the query log {path} after {timeout:.0f} s")
        time.sleep(0.05)
