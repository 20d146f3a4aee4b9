"""An ingestion's progress lines without a terminal (flows.run.progress): each line is one write,
its newline included, so a Ctrl-C between writes never leaves a line open for `interrupted`."""
from __future__ import annotations

import io

from ragline.flows.run.progress import IngestProgress


class Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_each_progress_line_is_one_write_with_its_newline(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    progress = IngestProgress("index\x1b[2J")  # a terminal control in a name is shown, never sent
    progress.start(3)
    progress.advance(2, 5)
    progress.advance(1, 1)
    progress.close()
    assert stderr.calls == ["index\\x1b[2J: 2/3 documents, 5 chunks\n", "index\\x1b[2J: 3/3 documents, 6 chunks\n"]
