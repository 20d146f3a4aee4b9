"""OpenDocument text (.odt) through odfpy: headings by outline level, paragraphs, lists, tables."""
from __future__ import annotations

import io
from typing import Any, Iterator

from ragline.flows.formats.base import Converted, FormatError, Options, blocks, heading, markdown_table

TEXT_NS = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
TABLE_NS = "urn:oasis:names:tc:opendocument:xmlns:table:1.0"
DC_NS = "http://purl.org/dc/elements/1.1/"


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from odf import teletype
    from odf.opendocument import load as load_odf  # here: only a .odt needs it

    try:
        document = load_odf(io.BytesIO(data))
    except Exception as exc:
        raise FormatError(f"unreadable ODT (not an OpenDocument package): {type(exc).__name__}: {exc}") from None
    parts = list(_checked(_blocks(document.text, teletype), options))
    titles = [teletype.extractText(e) for e in _descendants(document.meta, (DC_NS, "title"))]
    return Converted(text=blocks(parts), title=(titles[0] if titles else "").strip())


def _checked(parts: Iterator[str], options: Options) -> Iterator[str]:
    """The blocks, the document's time and text budget checked before each."""
    size = 0
    for part in parts:
        options.check(size)
        size += len(part)
        yield part


def _blocks(element: Any, teletype: Any) -> Iterator[str]:
    for child in element.childNodes:
        qname = getattr(child, "qname", None)
        if qname == (TEXT_NS, "h"):
            level = child.getAttrNS(TEXT_NS, "outline-level") or "1"
            yield heading(int(level) if str(level).isdigit() else 1, teletype.extractText(child))
        elif qname == (TEXT_NS, "p"):
            yield teletype.extractText(child)
        elif qname == (TEXT_NS, "list-item"):
            yield from ("- " + text.strip() for text in _blocks(child, teletype) if text.strip())
        elif qname == (TABLE_NS, "table"):
            rows = [[teletype.extractText(c) for c in row.childNodes if getattr(c, "qname", None) == (TABLE_NS, "table-cell")]
                    for row in _descendants(child, (TABLE_NS, "table-row"))]
            yield markdown_table(rows)
        elif getattr(child, "childNodes", None):
            yield from _blocks(child, teletype)


def _descendants(element: Any, qname: tuple[str, str]) -> Iterator[Any]:
    for child in getattr(element, "childNodes", []):
        if getattr(child, "qname", None) == qname:
            yield child
        else:
            yield from _descendants(child, qname)
