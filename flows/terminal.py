"""Text from data, made safe to print on a terminal (issue 16 item 14).

File names, titles, document ids and error messages come from the documents: a file named
``$'\\e]0;pwned\\a'`` or ``$'a\\nok: 0 failed'`` would otherwise retitle the terminal, ring its
bell, move the cursor, or forge a line of the CLI's output. ``printable`` writes every control
character (C0, DEL, C1), the Unicode line and paragraph separators and the bidirectional
overrides (which reorder what is shown) as Python escapes (``\\x1b``, ``\\n``, ``\\u202e``);
everything else, non-ASCII text included, is shown as it is.
"""
from __future__ import annotations

import logging
import re
from typing import Any

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_KEEPING_LINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                                   "\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def printable(value: Any, keep_newlines: bool = False) -> str:
    """``str(value)`` with every control character escaped: one line, unless ``keep_newlines``
    (an answer's paragraphs), when only ``\\n`` is kept."""
    text = value if isinstance(value, str) else str(value)
    return (_UNSAFE_KEEPING_LINES if keep_newlines else _UNSAFE).sub(_escape, text)


class PrintableFormatter(logging.Formatter):
    """Log lines for the terminal: the message escaped (it names files and documents); a
    traceback (``-v``) keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message)
        return super().formatMessage(record)


class TerminalFormatter(PrintableFormatter):
    """The CLI's stderr lines. Without ``-v``: no traceback (the CLI says the failure in one line),
    and a progress line (INFO: the LLM is slow, retried, checked) as ``… message``, not a log record."""

    def __init__(self, verbose: bool):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        if self.verbose:
            return super().format(record)
        record.message = printable(record.getMessage())
        if record.levelno < logging.WARNING:
            return f"… {record.message}"
        return self.formatMessage(record)  # the message alone, without the exception's traceback


class TerminalFilter(logging.Filter):
    """What the terminal shows: records at ``level`` and above, plus the INFO progress of the
    ``progress`` loggers (what a waiting user needs); without ``-v`` never Prefect's records (each
    failed task and flow run logged its chained tracebacks, ~340 lines, before the CLI's one line)
    and each progress line once (parallel calls retried in step printed it once per call)."""

    def __init__(self, level: int, progress: tuple[str, ...] = (), verbose: bool = False, prefect: bool = False):
        super().__init__()
        self.level, self.progress, self.verbose, self.prefect = level, progress, verbose, prefect
        self._shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (self.verbose or self.prefect) and (record.name == "prefect" or record.name.startswith("prefect.")):
            return False
        if record.levelno >= self.level:
            return True
        if record.levelno < logging.INFO or not record.name.startswith(self.progress) or not self.progress:
            return False
        if self.verbose:
            return True
        message = record.getMessage()
        if message in self._shown:
            return False
        self._shown.add(message)
        return True


def configure_terminal(verbose: bool, progress: tuple[str, ...] = (), prefect: bool = False) -> logging.Handler:
    """Log records on stderr as the CLI shows them (see ``TerminalFilter``); ``-v``: every INFO
    record with its logger's name and any traceback; ``prefect``: Prefect's warnings too (a
    long-running ``serve`` reports its runner's problems that way)."""
    terminal = logging.StreamHandler()
    terminal.setFormatter(TerminalFormatter(verbose))
    terminal.addFilter(TerminalFilter(logging.INFO if verbose else logging.WARNING, progress, verbose, prefect))
    logging.basicConfig(level=logging.WARNING, handlers=[terminal])
    for name in progress:
        logging.getLogger(name).setLevel(logging.INFO)
    return terminal
