"""What a converter returns, and the Markdown pieces every converter writes the same way."""
from __future__ import annotations

import io
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterable

from ragline.flows.errors import RaglineError

HEADING_TAGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
BLOCK_TAGS = frozenset({"p", "div", "li", "pre", "blockquote", "dt", "dd", "caption", "figcaption", "section",
                        "article", "br", "tr"})
SKIPPED_TAGS = frozenset({"script", "style", "head", "template", "noscript", "svg"})


ZIP_MAGIC = b"PK\x03\x04"  # DOCX, PPTX, XLSX, ODT and EPUB are zip packages
RATIO_FLOOR = 1_000_000  # a member (or package) inflating to less is never judged by its expansion ratio


class FormatError(RaglineError, ValueError):
    """A file this format cannot read; the message is the reason shown for the document."""


@dataclass(frozen=True)
class Options:
    """What the ``load`` step lets converters do (OCR of pages and images without a text layer) and
    what one document may cost: bytes inflated from a package or a PDF stream, characters of text,
    seconds (``deadline``, on ``time.monotonic``). The limits are the ``RAGLINE_DOCUMENT_*`` settings."""

    ocr: bool = True
    ocr_max_pages: int = 50  # per file: OCR takes seconds a page
    ocr_languages: str = "eng"  # tesseract's language codes, '+'-joined
    max_member_bytes: int = 64_000_000  # one archive member or PDF stream, inflated
    max_expanded_bytes: int = 256_000_000  # every member of one archive together, inflated
    max_ratio: float = 100.0  # inflated / compressed, per member and per archive (over RATIO_FLOOR)
    max_chars: int = 16_000_000  # characters of one document's text
    seconds: float = 300.0  # what ``deadline`` was set from, for the reason
    deadline: float | None = None

    def check(self, chars: int = 0) -> None:
        """Raise ``BudgetExceeded`` once the document's time is up or its text passes ``max_chars``:
        converters call it in their loops (a page, a paragraph), the chunker per chunk."""
        if chars > self.max_chars:
            raise BudgetExceeded(f"text over the document_max_chars limit of {self.max_chars} characters")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise BudgetExceeded(f"took over the document_max_seconds limit of {self.seconds:g} s")


class BudgetExceeded(FormatError):
    """A document past its time or size budget: skipped with the reason, the run goes on."""


def check_archive(data: bytes, options: Options) -> None:
    """Refuse a zip package (DOCX, PPTX, XLSX, ODT, EPUB, or any converter's) whose members inflate
    past the limits, from its directory alone, before any parser reads it. The declared sizes are
    what counts: ``zipfile`` (which every converter's library reads through) never inflates a member
    past its declared size (a lying header fails its CRC check instead)."""
    if not data.startswith(ZIP_MAGIC):
        return
    try:
        members = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # not a readable package: its converter says why
    total = 0
    for member in members:
        _check_member(member, options)
        total += member.file_size
        if total > options.max_expanded_bytes:
            raise FormatError(f"archive members inflate to over {options.max_expanded_bytes} bytes together (at "
                              f"member {member.filename!r}), the document_max_expanded_bytes limit")
    if total > RATIO_FLOOR and total > options.max_ratio * len(data):
        raise FormatError(f"archive inflates {total / len(data):.0f} times ({len(data)} to {total} bytes), over the "
                          f"document_max_expansion_ratio limit of {options.max_ratio:g}")


def _check_member(member: zipfile.ZipInfo, options: Options) -> None:
    if member.file_size > options.max_member_bytes:
        raise FormatError(f"archive member {member.filename!r} inflates to {member.file_size} bytes, over the "
                          f"document_max_member_bytes limit of {options.max_member_bytes}")
    ratio = member.file_size / max(member.compress_size, 1)
    if member.file_size > RATIO_FLOOR and ratio > options.max_ratio:
        raise FormatError(f"archive member {member.filename!r} inflates {ratio:.0f} times ({member.compress_size} "
                          f"to {member.file_size} bytes), over the document_max_expansion_ratio limit of "
                          f"{options.max_ratio:g}")


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
