"""Word documents (.docx) through python-docx: headings as '#' lines, tables as Markdown tables,
in the order they appear in the body."""
from __future__ import annotations

import io
import re

from ragline.flows.formats.base import Converted, FormatError, Options, blocks, heading, markdown_table

HEADING_STYLE = re.compile(r"heading\s*(\d)", re.I)


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    import docx  # here: only a .docx needs it
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as exc:  # not a zip, no word/document.xml, broken XML: one reason for all
        raise FormatError(f"unreadable DOCX (not a Word document package): {type(exc).__name__}: {exc}") from None
    parts, title = [], (document.core_properties.title or "").strip()
    for block in document.iter_inner_content():
        if isinstance(block, Table):
            parts.append(markdown_table([c.text for c in row.cells] for row in block.rows))
            continue
        style = (block.style.name if block.style is not None else "") or ""
        if style == "Title":
            title = title or block.text.strip()
            parts.append(heading(1, block.text))
        elif match := HEADING_STYLE.match(style):
            parts.append(heading(int(match.group(1)), block.text))
        elif style.startswith("List") and block.text.strip():
            parts.append("- " + block.text.strip())
        else:
            parts.append(block.text)
    return Converted(text=blocks(parts), title=title)
