"""Excel workbooks (.xlsx) through openpyxl, read-only and with cached values (no formulas run):
each sheet a heading and a Markdown table of its used rows."""
from __future__ import annotations

import io
from typing import Any, Iterator

from ragline.flows.formats.base import Converted, FormatError, Options, blocks, heading, markdown_table


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    import openpyxl  # here: only a .xlsx needs it

    try:
        workbook = openpyxl.load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    except Exception as exc:
        raise FormatError(f"unreadable XLSX (not an Excel workbook): {type(exc).__name__}: {exc}") from None
    try:
        parts = []
        for sheet in workbook.worksheets:
            rows = list(_rows(sheet, options))
            rows = [row for row in rows if any(v is not None and str(v).strip() for v in row)]
            width = max((max((i + 1 for i, v in enumerate(r) if v is not None), default=0) for r in rows), default=0)
            if width:
                parts += [heading(1, sheet.title), markdown_table(row[:width] for row in rows)]
        title = (workbook.properties.title or "").strip() if workbook.properties else ""
    finally:
        workbook.close()
    return Converted(text=blocks(parts), title=title)


CHECK_EVERY = 1000  # rows between two checks of the document's budget


def _rows(sheet: Any, options: Options) -> Iterator[list[Any]]:
    """The sheet's rows, the document's time and size budget checked every CHECK_EVERY rows (the
    cells' characters counted roughly, as their text)."""
    size = 0
    for number, row in enumerate(sheet.iter_rows(values_only=True)):
        size += sum(len(str(v)) + 3 for v in row if v is not None)
        if number % CHECK_EVERY == 0:
            options.check(size)
        yield list(row)
