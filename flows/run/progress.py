"""Progress of an ingestion run: documents and chunks written, on stderr."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

from ragline.flows.terminal import printable


class IngestProgress:
    """A bar per run; without a terminal (CI, logs) it prints one line per batch instead."""

    def __init__(self, title: str, enabled: bool = True):
        self.title = printable(title)  # it names a pipeline or a data set: never a terminal control
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.chunks = 0
        self._progress: Progress | None = None
        self._task = None
        self._done = 0
        self._total = 0

    def start(self, total_documents: int) -> None:
        self._total = total_documents
        if not self.enabled:
            return
        if total_documents == 0:
            self.console.print(f"{self.title}: nothing changed", markup=False, highlight=False)
            return
        if self.console.is_terminal:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("documents, {task.fields[chunks]} chunks"), TimeElapsedColumn(),
                                      TimeRemainingColumn(), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(escape(self.title), total=total_documents, chunks=0)

    def advance(self, documents: int, chunks: int) -> None:
        self._done += documents
        self.chunks += chunks
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, advance=documents, chunks=self.chunks)
        else:
            # One write, its newline included: print writes the text and the newline apart, and a Ctrl-C
            # between the two left the line open for the `interrupted` that follows it.
            sys.stderr.write(f"{self.title}: {self._done}/{self._total} documents, {self.chunks} chunks\n")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
