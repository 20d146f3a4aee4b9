"""The ``convert`` stage: HTML to clean text with its headings, and tidy whitespace in every format.

``content_hash`` is left as ``load`` computed it from the raw content: it is the change-detection
key, and must not move when only the conversion changes. A page lxml cannot read completely
(libxml2 stops at 255 levels of nesting) is read by a streaming fallback instead of losing its text.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

import lxml.html
from lxml import etree
from pydantic import BaseModel, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.spec.registry import stage

# Below trafilatura's own MIN_EXTRACTED_SIZE it falls back to a raw dump of the page that keeps
# navigation and loses headings; for such short pages the plain fallback below does better...
SHORT_PAGE_CHARS = 250
# ...unless the page itself is long: then the short pick is main text amid boilerplate.
FALLBACK_MAX_CHARS = 1000

DROP_TAGS = ("head", "script", "style", "noscript", "template", "svg", "nav", "header", "footer", "aside")
HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
BLOCK_TAGS = ("p", "div", "section", "article", "main", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr",
              "caption", "blockquote", "pre", "figure", "figcaption", "address", "details", "summary",
              "br", "hr")
VERTICAL_SPACE = re.compile(r"\r\n?|[\v\f\x85\u2028\u2029]")
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0/C1 controls; \t and \n are kept
BLANK_RUNS = re.compile(r"\n{3,}")
SPACE_RUNS = re.compile(r"[^\S\n]+")
# a backslash escape of ASCII punctuation, or a code span / fenced block (where backslashes are literal)
MARKDOWN_ESCAPE = re.compile(r"(`+).*?\1|\\([!-/:-@\[-`{-~])", re.S)
BREAK = "\ue000"  # private-use marker for block boundaries in the fallback; source newlines are spaces
# The streaming fallback has no tree, so it only hides elements that are reliably closed and never body text.
STREAM_HIDDEN = ("script", "style", "noscript", "template", "svg")
NO_TEXT = "no text after conversion"


class UnreadableHtml(Exception):
    """Neither lxml nor the streaming fallback could read the page."""


class Params(BaseModel):
    """How HTML is turned into text and how whitespace is tidied."""

    model_config = {"extra": "forbid"}

    keep_headings: bool = Field(True, description="keep HTML headings as markdown '#' lines")
    include_tables: bool = Field(True, description="keep the text of HTML tables")
    favor_recall: bool = Field(True, description="let trafilatura keep more text when unsure")
    normalize_whitespace: bool = Field(True, description="collapse space runs and blank lines, strip control "
                                                         "characters, in every format")
    min_chars: int = Field(1, ge=1, le=1_000_000,
                           description="documents with fewer characters after conversion are reported and dropped")


@stage("convert", params=Params, produces="documents", kind="ingestion")
def convert(documents: list[Document], params: Params, ctx: StepContext) -> list[Document]:
    """Turn HTML into clean text and tidy whitespace, dropping documents left without text."""
    converted: list[Document] = []
    for document in documents:
        try:
            text, title, note = _html_to_text(document.text, params) if document.format == "html" \
                else (document.text, "", "")
        except UnreadableHtml as exc:
            ctx.fail(document.source_id, f"HTML could not be parsed: {exc}")
            continue
        pages = document.pages
        if params.normalize_whitespace:
            text, pages = tidy_pages(text, pages) if pages else (tidy_whitespace(text), pages)
        size = len(text.strip())
        if size < params.min_chars:
            reason = f"only {size} characters after conversion, min_chars is {params.min_chars}" if size else NO_TEXT
            ctx.fail(document.source_id, f"{reason} ({note})" if note else reason)
            continue
        converted.append(document.model_copy(update={
            "text": text, "title": document.title or title, "metadata": dict(document.metadata), "pages": pages}))
        ctx.progress("documents", 1)
    return converted


def tidy_whitespace(text: str) -> str:
    """Collapse space runs and blank-line runs, drop control characters.

    Leading indentation is kept: markdown lists and code blocks depend on it.
    """
    text = CONTROL_CHARS.sub("", VERTICAL_SPACE.sub("\n", text))
    lines = []
    for line in text.split("\n"):
        body = line.lstrip(" \t")
        lines.append((line[:len(line) - len(body)] + SPACE_RUNS.sub(" ", body)).rstrip())
    return BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def tidy_pages(text: str, pages: list[int]) -> tuple[str, list[int]]:
    """``tidy_whitespace`` page by page, with the page starts moved to where the pages now start. A
    page that goes on with a Markdown table (joined to the page before by one newline, as the PDF
    converter does) stays joined so, so the table stays one."""
    ends = pages[1:] + [len(text)]
    tidied, starts = "", []
    for start, end in zip(pages, ends):
        page = tidy_whitespace(text[start:end])
        if page and tidied:
            goes_on = page.startswith("|") and text[start - 2:start] != "\n\n" and text[start - 1:start] == "\n" \
                and tidied.rsplit("\n", 1)[-1].startswith("|")
            tidied += "\n" if goes_on else "\n\n"
        starts.append(len(tidied))
        tidied += page
    return tidied, starts


def _html_to_text(raw: str, params: Params) -> tuple[str, str, str]:
    """(text, <title>, note): lxml and trafilatura when the page parses completely, else the
    streaming fallback, with a note saying why (so "no text" is not mistaken for a lost page)."""
    try:
        tree, problem = _parse(raw)
        if problem is None:
            return (*_tree_text(raw, tree, params), "")
    except RecursionError:
        problem = "nesting too deep to walk"
    text, title = _stream_text(raw, params, problem)
    return text, title, f"read with the fallback parser; lxml: {problem}"


def _tree_text(raw: str, tree: lxml.html.HtmlElement | None, params: Params) -> tuple[str, str]:
    """(text, <title>): trafilatura's main content, or the plain fallback for short pages."""
    title = " ".join((tree.findtext(".//title") or "").split()) if tree is not None else ""
    main = _main_content(raw, params)
    if len(main) < SHORT_PAGE_CHARS:
        plain = _plain_text(tree, params)
        if plain and (not main or len(plain) <= FALLBACK_MAX_CHARS):
            return plain, title
    return main, title


def _main_content(raw: str, params: Params) -> str:
    """Main text without scripts, navigation, footers and boilerplate; headings as '#' lines."""
    import trafilatura  # here: ~0.3 s to import, which `ragline validate` and `--help` need not pay

    try:
        text = trafilatura.extract(
            raw, output_format="markdown" if params.keep_headings else "txt",
            include_tables=params.include_tables, favor_recall=params.favor_recall,
            include_comments=False, include_links=False, include_images=False, deduplicate=False)
    except Exception:  # malformed markup can surface lxml errors: the plain fallback takes over
        return ""
    text = (text or "").strip()
    return _unescape_markdown(text) if params.keep_headings else text


def _unescape_markdown(text: str) -> str:
    """Undo trafilatura's markdown escapes ('snake\\_case'): keyword search wants words as written.
    Code spans and fenced blocks are left alone, since backslashes are literal there."""
    return MARKDOWN_ESCAPE.sub(lambda match: match.group(2) or match.group(0), text)


def _parse(raw: str) -> tuple[lxml.html.HtmlElement | None, str | None]:
    """(tree, problem): an lxml tree (None for markup with nothing in it), and why it cannot be
    trusted when libxml2 stopped early: past 255 levels of nesting it drops the rest of the page
    with a fatal error instead of raising. Parsed from bytes with an explicit encoding, since lxml
    refuses str input that carries an XML encoding declaration."""
    parser = lxml.html.HTMLParser(encoding="utf-8")  # per call: lxml parsers are not thread-safe
    try:
        tree = lxml.html.document_fromstring(raw.encode("utf-8", "replace"), parser=parser)
    except etree.ParserError:
        return None, None  # "Document is empty": nothing but whitespace or comments
    except ValueError as exc:
        return None, str(exc)
    fatal = [e.message for e in parser.error_log if e.level >= etree.ErrorLevels.FATAL]
    return tree, (fatal[0].strip() if fatal else None)


def _plain_text(tree: lxml.html.HtmlElement | None, params: Params) -> str:
    """Visible text minus page furniture, one line per block, headings kept as '#' lines."""
    if tree is None:
        return ""
    drop = DROP_TAGS if params.include_tables else DROP_TAGS + ("table",)
    for element in list(tree.iter(*drop)):
        element.drop_tree()
    for heading in list(tree.iter(*HEADINGS)):
        text = " ".join(heading.text_content().split())
        marker = "#" * int(heading.tag[1]) + " " if text and params.keep_headings else ""
        heading.clear(keep_tail=True)
        heading.text = f"{BREAK}{marker}{text}{BREAK}"
    for element in tree.iter(*BLOCK_TAGS):
        element.text = BREAK + (element.text or "")
        element.tail = BREAK + (element.tail or "")
    for cell in tree.iter("td", "th"):
        cell.tail = " " + (cell.tail or "")
    lines = (" ".join(line.split()) for line in tree.text_content().split(BREAK))
    return BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def _stream_text(raw: str, params: Params, problem: str) -> tuple[str, str]:
    """(text, <title>) from html.parser's token stream: it keeps no tree and never recurses, so
    any nesting depth works. Raises UnreadableHtml if even this fails."""
    collector = _TextCollector(params)
    try:
        collector.feed(raw)
        collector.close()
    except Exception as exc:  # html.parser is lenient, but a page that defeats both must not stop the run
        raise UnreadableHtml(f"{problem}; fallback: {type(exc).__name__}: {exc}") from exc
    return collector.text(), " ".join("".join(collector.title).split())


class _TextCollector(HTMLParser):
    """Visible text, one line per block, headings as '#' lines, from start/end tags and data."""

    def __init__(self, params: Params):
        super().__init__(convert_charrefs=True)
        self.hide = STREAM_HIDDEN if params.include_tables else STREAM_HIDDEN + ("table",)
        self.keep_headings = params.keep_headings
        self.hidden = 0  # open elements whose text is dropped
        self.in_title = False
        self.heading_at: int | None = None  # where the open heading's marker sits in parts
        self.parts: list[str] = []
        self.title: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.hide:
            self.hidden += 1
        elif self.hidden:
            return
        elif tag == "title":  # the page's, not an <svg>'s
            self.in_title = True
        else:
            self._open(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.hide:
            self.hidden = max(0, self.hidden - 1)
        elif tag == "title":
            self.in_title = False
        elif not self.hidden:
            self._close(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in self.hide and not self.hidden:  # <br/>, <hr/>: a boundary like <br>, nothing inside
            self._open(tag)

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title.append(data)
        elif not self.hidden:
            self.parts.append(data)

    def _open(self, tag: str) -> None:
        if tag in HEADINGS:
            self.parts.append(BREAK)
            self.heading_at = len(self.parts)
            self.parts.append("#" * int(tag[1]) + " " if self.keep_headings else "")
        elif tag in BLOCK_TAGS:
            self.parts.append(BREAK)

    def _close(self, tag: str) -> None:
        if tag in HEADINGS:
            if self.heading_at is not None and not self._text_since(self.heading_at + 1):
                self.parts[self.heading_at] = ""  # an empty heading leaves no stray '#'
            self.heading_at = None
            self.parts.append(BREAK)
        elif tag in BLOCK_TAGS:
            self.parts.append(BREAK)
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def _text_since(self, start: int) -> bool:
        return bool("".join(self.parts[start:]).replace(BREAK, "").strip())

    def text(self) -> str:
        lines = (" ".join(line.split()) for line in "".join(self.parts).split(BREAK))
        return BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
