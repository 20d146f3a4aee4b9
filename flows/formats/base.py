"""What a converter returns, and the Markdown pieces every converter writes the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ragline.flows.errors import RaglineError

HEADING_TAGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
BLOCK_TAGS = frozenset({"p", "div", "li", "pre", "blockquote", "dt", "dd", "caption", "figcaption", "section",
                        "article", "br", "tr"})
SKIPPED_TAGS = frozenset({"script", "style", "head", "template", "noscript", "svg"})


@dataclass(frozen=True)
class Options:
    """What the ``load`` step lets converters do: OCR of pages and images without a text layer."""

    ocr: bool = True
    ocr_max_pages: int = 50  # per file: OCR takes seconds a page
    ocr_languages: str = "eng"  # tesseract's language codes, '+'-joined


class FormatError(RaglineError, ValueError):
    """A file this format cannot read; the message is the reason shown for the document."""


@dataclass(frozen=True)
class Attachment:
    """A file inside a file (an e-mail's attachment): loaded as its own document '<file>#<name>'."""

    name: str
    data: bytes


@dataclass
class Converted:
    """A file's text (Markdown), its title, where each page starts in the text (page n at
    ``pages[n-1]``; empty for formats without pages) and the files it carries."""

    text: str
    title: str = ""
    pages: list[int] = field(default_factory=list)
    attachments: list[Attachment] = field(default_factory=list)
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)


def paged(pages: Iterable[str]) -> tuple[str, list[int]]:
    """Page texts joined by blank lines, with each page's start offset (an empty page starts where
    the next one does, so page numbers stay those of the file)."""
    text, starts = "", []
    for page in pages:
        page = page.strip()
        if page and text:
            text += "\n\n"
        starts.append(len(text))
        text += page
    return text, starts


def heading(level: int, text: str) -> str:
    """A Markdown heading line ('' for an empty heading)."""
    text = " ".join(text.split())
    return f"{'#' * max(1, min(level, 6))} {text}" if text else ""


def cell(value: Any) -> str:
    """A table cell's text on one line, with '|' escaped so it cannot end the cell."""
    text = "" if value is None else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(rows: Iterable[Iterable[Any]]) -> str:
    """Rows as a Markdown table, the first row as its header; '' when there are no cells."""
    grid = [[cell(v) for v in row] for row in rows]
    grid = [row for row in grid if any(row)]
    if not grid:
        return ""
    width = max(len(row) for row in grid)
    grid = [row + [""] * (width - len(row)) for row in grid]
    lines = ["| " + " | ".join(row) + " |" for row in grid]
    lines.insert(1, "|" + "---|" * width)
    return "\n".join(lines)


def blocks(parts: Iterable[str]) -> str:
    """Non-empty blocks separated by blank lines."""
    return "\n\n".join(part.strip() for part in parts if part and part.strip())


def html_markdown(markup: bytes | str) -> tuple[str, str]:
    """(Markdown, <title>) of an HTML/XHTML page: headings as '#' lines, tables as Markdown tables,
    one block per paragraph. For pages inside other formats (EPUB chapters, HTML mail)."""
    import lxml.html  # here: `ragline validate` imports the loader, not a parser it may not need
    from lxml import etree

    data = markup.encode("utf-8") if isinstance(markup, str) else markup
    if not data.strip():
        return "", ""
    try:
        tree = lxml.html.document_fromstring(data, parser=lxml.html.HTMLParser(encoding="utf-8"))
    except (etree.ParserError, ValueError):
        return "", ""
    title = " ".join((tree.findtext(".//title") or "").split())
    body = tree.find(".//body")
    out: list[str] = []
    _walk(body if body is not None else tree, out)
    return blocks("".join(out).split("\n\n")), title


def _walk(element: Any, out: list[str]) -> None:
    tag = element.tag if isinstance(element.tag, str) else ""
    tag = tag.rsplit("}", 1)[-1].lower()
    if tag in SKIPPED_TAGS:
        out.append(element.tail or "")
        return
    if tag in HEADING_TAGS:
        out.append("\n\n" + heading(HEADING_TAGS[tag], element.text_content()) + "\n\n")
    elif tag == "table":
        rows = [[" ".join(c.text_content().split()) for c in row.iter("td", "th", "{*}td", "{*}th")]
                for row in element.iter("tr", "{*}tr")]
        out.append("\n\n" + markdown_table(rows) + "\n\n")
    else:
        breaks = tag in BLOCK_TAGS
        out.append(("\n\n" if breaks else "") + " ".join((element.text or "").split(" ")))
        for child in element:
            _walk(child, out)
        if breaks:
            out.append("\n\n")
    out.append(element.tail or "")
