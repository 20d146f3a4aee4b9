"""Formats: how the bytes of one file become the text of a Document (and its pages and attachments).

Each binary or structured format is a module here with a ``convert(data, name, options) -> Converted`` that
raises ``FormatError`` (or whatever its library raises) on a file it cannot read; ``load`` turns
that into a per-document failure with the reason. Converters register in the ``ragline.formats``
entry-point group by file extension (``docx = "ragline.flows.formats.docx:convert"``), so a package
adds a format without a change here. Their text is Markdown: headings as '#' lines (the chunker's
section path) and tables as Markdown tables (never split mid-row).

May import the base modules only; ``tasks`` (the ``load`` stage) imports it.
"""
from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Callable

from ragline.flows.formats.base import Attachment, BudgetExceeded, Converted, FormatError, Options, check_archive

GROUP = "ragline.formats"  # entry-point group: `<extension> = "package.module:convert"`
Converter = Callable[[bytes, str, Options], Converted]

__all__ = ["Attachment", "BudgetExceeded", "Converted", "Converter", "FormatError", "GROUP", "Options", "check_archive",
           "converter", "extensions"]


@functools.cache
def _registry() -> dict[str, Converter]:
    found: dict[str, Converter] = {}
    for entry in entry_points(group=GROUP):
        found.setdefault("." + entry.name.lower().lstrip("."), entry.load())
    return found


def converter(suffix: str) -> Converter | None:
    """The converter registered for a file extension ('.docx'), or None for text formats."""
    return _registry().get(suffix.lower())


def extensions() -> list[str]:
    """Every registered extension, with its dot."""
    return sorted(_registry())
