"""Excel workbooks (.xlsx) through openpyxl, read-only and with cached values (no formulas run):
each sheet a heading and a Markdown table of its used rows."""
from __future__ import annotations

import io

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
            rows = [list(row) for row in sheet.iter_rows(values_only=True)]
            rows = [row for row in rows if any(v is not None and str(v).strip() for v in row)]
            width = max((max((i + 1 for i, v in enumerate(r) if v is not None), default=0) for r in rows), default=0)
            if width:
                parts += [heading(1, sheet.title), markdown_table(row[:width] for row in rows)]
        title = (workbook.properties.title or "").strip() if workbook.properties else ""
    finally:
        workbook.close()
    return Converted(text=blocks(parts), title=title)
