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
    parts, title, size = [], (document.core_properties.title or "").strip(), 0
    for block in document.iter_inner_content():
        options.check(size)  # a block at a time: the document's time and text budget
        if isinstance(block, Table):
            parts.append(markdown_table([c.text for c in row.cells] for row in block.rows))
        else:
            style = (block.style.name if block.style is not None else "") or ""
            if style == "Title":
                title = title or block.text.strip()
            parts.append(_paragraph(style, block.text))
        size += len(parts[-1])
    return Converted(text=blocks(parts), title=title)


def _paragraph(style: str, text: str) -> str:
    """A paragraph as Markdown: a heading by its style, a list item, or its text."""
    if style == "Title":
        return heading(1, text)
    if match := HEADING_STYLE.match(style):
        return heading(int(match.group(1)), text)
    if style.startswith("List") and text.strip():
        return "- " + text.strip()
    return text
