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
