"""PDF page by page, with its layout: the page starts travel with the text, so chunks cite pages.

pypdf opens the file first (encryption, the metadata title, and the ``document_max_member_bytes``
limit on every content stream, enforced while inflating), then PDFium (pypdfium2; ``pdfium_page``)
reads each page's characters and ruling lines, which pdfplumber groups into words and its ruling-line
table finder into tables (pdfminer.six, which pdfplumber reads through on its own, took five times
as long):

- tables as Markdown tables, header row first; a table that goes on at the top of the next page
  with as many columns is one table (a repeated header row there is dropped), joined to the page
  before by a single newline so it stays one Markdown table, its rows still on their own page;
- reading order by columns: a page whose lines share a wide vertical gap is read left column, then
  right, between the lines that cross the gap (a title, a full-width figure caption);
- running headers and footers (a line in the top or bottom band of most pages, digits aside, page
  numbers included) are dropped, and a word hyphenated at a line end is joined;
- a page PDFium cannot read falls back to pypdf's text; a page without a text layer (a scan) is
  read by OCR from its images, up to ``ocr_max_pages`` a file.
"""
from __future__ import annotations

import bisect
import io
import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ragline.flows.formats import ocr, pdfium_page
from ragline.flows.formats.base import Converted, FormatError, Options, markdown_table

# a metadata title that names nothing (what PDF writers put when the author gave none)
MEANINGLESS_TITLE = re.compile(r"^(\(?anonymous\)?|untitled[\s\d-]*|none|null|unknown|document\d*|title|\W*)$", re.I)
BAND = 0.15  # top and bottom share of a page where running headers and footers are looked for
EDGE_ROWS = 2  # rows of each band looked at
REPEATED_SHARE = 0.4  # a band line on at least this share of the pages (and two pages) is a running one
MIN_GUTTER = 9.0  # points: the narrowest gap between two columns
WORD_GAP = 0.15  # a gap between two characters over this share of their size separates words (pdftotext-like)
HYPHENATED = re.compile(r"[^\W\d_]-$")
UNMAPPED = re.compile(r"\(cid:\d+\)")  # pdfminer's name for a glyph its font maps to no character
# ruling edges of one page above which its tables are not looked for (read as lines of words): the
# table finder's cost grows faster than its edges (one page of 2,400 drawn cells, 9,600 edges, takes
# seconds); a page of real tables has hundreds to a few thousand
MAX_TABLE_EDGES = 12_000
TEXT_TOLERANCE = 3  # points: pdfplumber's default x and y tolerance of extract_text, which cell texts follow


@dataclass
class _Row:
    """Words on one line of a page (outside tables): (x0, x1, text) each, left to right."""

    top: float
    bottom: float
    words: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def x0(self) -> float:
        return self.words[0][0]

    @property
    def x1(self) -> float:
        return self.words[-1][1]

    @property
    def text(self) -> str:
        return " ".join(w[2] for w in self.words)


@dataclass
class _PageTable:
    """A table pdfplumber found on a page: its bounding box and its rows of cell text."""

    top: float
    bottom: float
    x0: float
    x1: float
    rows: list[list[str]]


@dataclass
class _Page:
    width: float = 0.0
    height: float = 0.0
    rows: list[_Row] = field(default_factory=list)
    tables: list[_PageTable] = field(default_factory=list)
    text: str | None = None  # pypdf's text, when PDFium could not read the page


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from pypdf import PdfReader, apply_configuration  # here: only a PDF needs it (`ragline validate` need not)
    from pypdf.errors import LimitReachedError

    try:
        with apply_configuration(**_stream_limits(options)):  # this thread's reads only (a context variable)
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):  # an empty user password still opens many
                raise FormatError("encrypted PDF: a password is needed to read it")
            _inflate_contents(reader, options)
            title = str((reader.metadata.title if reader.metadata else None) or "").strip()
            laid_out = _layout(data, reader, options)
            pages, glued = _page_texts(laid_out, options)
            metadata, why_not = _ocr_scans(reader, pages, options)
    except FormatError:
        raise
    except LimitReachedError as exc:  # a stream that inflates past the limit, refused while inflating it
        raise FormatError(f"a PDF stream inflates past the document_max_member_bytes limit of "
                          f"{options.max_member_bytes} bytes ({exc})") from None
    except Exception as exc:  # pypdf raises many exception types on malformed files
        raise FormatError(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
    text, starts = _joined(pages, glued)
    if not text:
        raise FormatError("PDF has no extractable text (scanned images?)" + (f"; {why_not}" if why_not else ""))
    tables = sum(1 for page in laid_out for _ in page.tables)
    return Converted(text=text, title="" if MEANINGLESS_TITLE.match(title) else title, pages=starts,
                     metadata={"pages": len(starts), **({"tables": tables} if tables else {}), **metadata})


def _stream_limits(options: Options) -> dict[str, int]:
    """pypdf's own limits on what one stream may inflate to (every filter), set to the document's."""
    limit = options.max_member_bytes
    return {key: limit for key in ("zlib_maximum_output_length", "lzw_maximum_output_length",
                                   "run_length_maximum_output_length", "jbig2_maximum_output_length",
                                   "brotli_maximum_output_length", "array_based_stream_maximum_output_length",
                                   "maximum_declared_stream_length", "image_maximum_buffer_size")}


def _inflate_contents(reader: Any, options: Options) -> None:
    """Every page's content stream and form XObjects inflated once by pypdf, under the stream limits:
    PDFium has no such setting, so a bomb is refused here first."""
    for page in reader.pages:
        options.check()
        contents = page.get_contents()
        if contents is not None:
            contents.get_data()
        resources = page.get("/Resources")
        xobjects = resources.get_object().get("/XObject") if resources is not None else None
        for ref in (xobjects.get_object().values() if xobjects is not None else ()):
            xobject = ref.get_object()
            if xobject.get("/Subtype") == "/Form":
                xobject.get_data()


# --- layout: PDFium's characters and ruling lines, pdfplumber's words and tables per page ------

def _layout(data: bytes, reader: Any, options: Options) -> list[_Page]:
    """Each page's rows of words and its tables (positions in points from the top); a page (or a
    file) PDFium cannot read keeps pypdf's text instead."""
    try:
        document = pdfium_page.open_document(data)
    except Exception:  # PDFium refuses what pypdf read: the file's text as pypdf gives it
        return [_Page(text=page.extract_text() or "") for page in _checked(reader.pages, options)]
    laid_out: list[_Page] = []
    size = 0
    try:
        for n in _checked(range(pdfium_page.page_count(document)), options, lambda: size):
            try:
                laid_out.append(_read_page(*pdfium_page.read_page(document, n, MAX_TABLE_EDGES)))
            except Exception:  # a page PDFium trips on: pypdf's text for it
                laid_out.append(_Page(text=reader.pages[n].extract_text() or ""))
            size += sum(len(r.text) + 1 for r in laid_out[-1].rows) + len(laid_out[-1].text or "") + \
                sum(len(c) + 3 for t in laid_out[-1].tables for row in t.rows for c in row)
    finally:
        pdfium_page.close_document(document)
    return laid_out


def _checked(pages: Any, options: Options, size: Any = lambda: 0) -> Any:
    """The pages, the document's time and text budget checked before each."""
    for page in pages:
        options.check(size())
        yield page


@dataclass
class _RuledPage:
    """What pdfplumber's table finder reads of a page (its ``edges`` and ``bbox``), from PDFium."""

    edges: list[dict]
    bbox: tuple[float, float, float, float]


def _read_page(view: pdfium_page.PageView, chars: list[dict], edges: list[dict]) -> _Page:
    """The page's tables (pdfplumber's finder on its ruling edges) and its rows of words outside them."""
    from pdfplumber.table import TableFinder, TableSettings
    from pdfplumber.utils import extract_words

    ruled = _RuledPage(edges, (0.0, 0.0, view.width, view.height))
    tables = TableFinder(ruled, TableSettings.resolve(None)).tables if 0 < len(edges) <= MAX_TABLE_EDGES else []
    boxes = [t.bbox for t in tables]
    found = []
    rows_of = _CharRows(chars) if tables else None
    for table in tables:
        rows = [[" ".join((c or "").split()) for c in row] for row in _cell_texts(table, rows_of)]
        rows = [row for row in rows if any(row)]
        if rows:
            x0, top, x1, bottom = table.bbox
            found.append(_PageTable(top, bottom, x0, x1, rows))
    outside = [c for c in chars if not _inside(c, boxes)] if boxes else chars
    words = extract_words(outside, x_tolerance_ratio=WORD_GAP, keep_blank_chars=False, use_text_flow=False)
    return _Page(width=view.width, height=view.height, rows=_rows(words), tables=found)


class _CharRows:
    """A page's characters ordered by their vertical centre, to take a table row's by bisection."""

    def __init__(self, chars: list[dict]):
        self.chars = sorted(chars, key=_middle_y)
        self.middles = [_middle_y(c) for c in self.chars]

    def between(self, top: float, bottom: float) -> list[dict]:
        return self.chars[bisect.bisect_left(self.middles, top):bisect.bisect_left(self.middles, bottom)]


def _middle_y(char: dict) -> float:
    return (char["top"] + char["bottom"]) / 2


def _cell_texts(table: Any, chars: _CharRows) -> list[list[str | None]]:
    """The table's cell texts by pdfplumber's own rule (a character belongs to the cell holding its
    centre; ``Table.extract``), without its scan of every character of the page for each row: that
    is quadratic, and one page of 10,000 ruled cells took 117 s."""
    from pdfplumber.utils import extract_text

    texts = []
    for row in table.rows:
        in_row = chars.between(row.bbox[1], row.bbox[3])
        cells: list[str | None] = []
        for cell in row.cells:
            if cell is None:
                cells.append(None)
                continue
            x0, top, x1, bottom = cell
            inside = [c for c in in_row if x0 <= (c["x0"] + c["x1"]) / 2 < x1 and top <= _middle_y(c) < bottom]
            cells.append((_one_line_text(inside) or extract_text(inside)) if inside else "")
        texts.append(cells)
    return texts


def _one_line_text(chars: list[dict]) -> str | None:
    """``extract_text`` of upright characters on one line (tops within its y tolerance), by its rule
    in one pass: words split at a blank or where a character starts left of the one before or more
    than its x tolerance after its end, ligatures expanded; None for other cells (pdfplumber's own
    call reads them). Most cells are one line, and ``extract_text`` costs a tenth of a millisecond each."""
    from pdfplumber.utils.text import LIGATURES

    tops = [c["top"] for c in chars]
    if max(tops) - min(tops) > TEXT_TOLERANCE or not all(c["upright"] for c in chars):
        return None
    words: list[str] = []
    word: list[str] = []
    last = None
    for char in sorted(chars, key=lambda c: (c["x0"], c["bottom"])):
        text = char["text"]
        if text.isspace():
            last = None
        elif last is not None and (char["x0"] < last["x0"] or char["x0"] > last["x1"] + TEXT_TOLERANCE):
            last = char
        else:
            word.append(LIGATURES.get(text, text))
            last = char
            continue
        if word:
            words.append("".join(word))
        word = [LIGATURES.get(text, text)] if last is char else []
    if word:
        words.append("".join(word))
    return " ".join(words)


def _inside(obj: dict, boxes: list[tuple[float, float, float, float]]) -> bool:
    x, y = (obj["x0"] + obj["x1"]) / 2, (obj["top"] + obj["bottom"]) / 2
    return any(x0 <= x <= x1 and top <= y <= bottom for x0, top, x1, bottom in boxes)


def _rows(words: list[dict]) -> list[_Row]:
    """Words grouped into lines: a word whose top is within half a line of the row's joins it."""
    rows: list[_Row] = []
    for word in sorted(words, key=lambda w: (w["top"], w["x0"])):
        height = word["bottom"] - word["top"]
        if rows and word["top"] - rows[-1].top <= max(2.0, height / 2):
            row = rows[-1]
            row.bottom = max(row.bottom, word["bottom"])
        else:
            row = _Row(word["top"], word["bottom"])
            rows.append(row)
        row.words.append((float(word["x0"]), float(word["x1"]), UNMAPPED.sub("", word["text"]) or word["text"]))
    for row in rows:
        row.words.sort()
    return rows


# --- text: headers and footers out, columns in order, tables joined ------------------------------

def _page_texts(laid_out: list[_Page], options: Options) -> tuple[list[str], list[bool]]:
    """Each page's Markdown, and whether it goes on with the table the page before ends with."""
    running = _running_lines(laid_out)
    items_of = []
    for page in laid_out:
        if page.text is not None:
            items_of.append([])
            continue
        rows = [row for zone, row in _banded(page) if (zone, _key(row.text)) not in running]
        items_of.append(_reading_order(rows, page.tables, page.width))
    texts, glued, size = [], [], 0
    header: list[str] | None = None  # the header row of the table the page before ends with
    for page, items in zip(laid_out, items_of):
        options.check(size)
        if page.text is not None:
            texts.append(page.text)
            glued.append(False)
            header = None
            continue
        goes_on = bool(items) and header is not None and isinstance(items[0], _PageTable) \
            and len(items[0].rows[0]) == len(header)
        if goes_on and items[0].rows[0] == header:  # the header row repeated on the new page
            items[0].rows.pop(0)
            if not items[0].rows:
                items.pop(0)
                goes_on = bool(items) and isinstance(items[0], _PageTable) and len(items[0].rows[0]) == len(header)
        texts.append(_markdown(items, continued=goes_on))
        glued.append(goes_on)
        size += len(texts[-1])
        if items and isinstance(items[-1], _PageTable):
            header = header if goes_on and len(items) == 1 else items[-1].rows[0]
        else:
            header = None
    return texts, glued


def _banded(page: _Page) -> list[tuple[str, _Row]]:
    """Each row with its band: 'top' or 'bottom' for the first and last rows in those bands, else ''."""
    rows = page.rows
    banded = []
    for n, row in enumerate(rows):
        zone = ""
        if n < EDGE_ROWS and row.bottom <= page.height * BAND:
            zone = "top"
        elif n >= len(rows) - EDGE_ROWS and row.top >= page.height * (1 - BAND):
            zone = "bottom"
        banded.append((zone, row))
    return banded


def _key(text: str) -> str:
    """A line as compared across pages: case and spacing aside, every number the same."""
    return re.sub(r"\d+", "#", " ".join(text.split()).lower())


def _running_lines(laid_out: list[_Page]) -> set[tuple[str, str]]:
    """(band, key) of the lines in the top or bottom band of most pages: running headers, footers,
    page numbers."""
    pages = [page for page in laid_out if page.rows]
    seen: Counter = Counter()
    for page in pages:
        seen.update({(zone, _key(row.text)) for zone, row in _banded(page) if zone})
    least = max(2, math.ceil(REPEATED_SHARE * len(pages)))
    return {line for line, count in seen.items() if count >= least}


def _reading_order(rows: list[_Row], tables: list[_PageTable], width: float) -> list[_Row | _PageTable]:
    """Rows and tables in reading order: top to bottom, or by columns when the page has two."""
    gutter = _gutter(rows, width)
    items: list[tuple[float, int, _Row | _PageTable]] = [(r.top, 0, r) for r in rows] + [(t.top, 1, t) for t in tables]
    items.sort(key=lambda item: (item[0], item[1]))
    if gutter is None:
        return [item for _, _, item in items]
    ordered: list[_Row | _PageTable] = []
    left: list[_Row | _PageTable] = []
    right: list[_Row | _PageTable] = []
    for _, _, item in items:
        if isinstance(item, _PageTable):
            parts = (item, None) if item.x1 <= gutter else (None, item) if item.x0 >= gutter else None
        else:
            parts = _split(item, gutter)
        if parts is None:  # across both columns: the columns above it come first
            ordered.extend(left + right + [item])
            left, right = [], []
            continue
        if parts[0] is not None:
            left.append(parts[0])
        if parts[1] is not None:
            right.append(parts[1])
    return ordered + left + right


def _split(row: _Row, gutter: float) -> tuple[_Row | None, _Row | None] | None:
    """A row's words left and right of the gutter; None when a word crosses it or the two sides are
    closer than a gutter (one line across both columns)."""
    left = [w for w in row.words if w[1] <= gutter]
    right = [w for w in row.words if w[0] >= gutter]
    if len(left) + len(right) < len(row.words):
        return None
    if left and right and right[0][0] - left[-1][1] < MIN_GUTTER:
        return None
    return (_Row(row.top, row.bottom, left) if left else None, _Row(row.top, row.bottom, right) if right else None)


def _gutter(rows: list[_Row], width: float) -> float | None:
    """The x of the gap between two columns of text, or None for a page of one column: a gap of at
    least MIN_GUTTER points in the middle of the page, inside at least three rows and a quarter of
    them, with lines of column width (a fifth of the page, typically) on both sides."""
    if len(rows) < 6 or width <= 0:
        return None
    gaps = []  # (start, end) of each row's wide gaps in the middle of the page
    for row in rows:
        row_gaps = [(a[1], b[0]) for a, b in zip(row.words, row.words[1:])
                    if b[0] - a[1] >= MIN_GUTTER and a[1] < width * 0.7 and b[0] > width * 0.3]
        gaps.append(row_gaps)
    best, count = None, 0
    for x in range(int(width * 0.3), int(width * 0.7) + 1, 2):
        covering = sum(1 for row_gaps in gaps if any(a <= x <= b for a, b in row_gaps))
        if covering > count:
            best, count = float(x), covering
    if best is None or count < max(3, len(rows) // 4):
        return None
    split = [parts for row in rows if (parts := _split(row, best)) is not None and parts[0] and parts[1]]
    lefts = [p[0].x1 - p[0].x0 for p in split]
    rights = [p[1].x1 - p[1].x0 for p in split]
    if not split or statistics.median(lefts) < width / 5 or statistics.median(rights) < width / 5:
        return None  # labels and values, not columns
    return best


def _markdown(items: list[_Row | _PageTable], continued: bool) -> str:
    """Rows as lines (a blank line where the text leaves a gap, a hyphenated word joined), tables as
    Markdown tables (the first going on from the page before: its rows only)."""
    blocks: list[str] = []
    lines: list[str] = []
    last: _Row | None = None
    for n, item in enumerate(items):
        if isinstance(item, _PageTable):
            if lines:
                blocks.append("\n".join(lines))
            lines, last = [], None
            table = markdown_table(item.rows)
            if n == 0 and continued:
                head, _, rest = table.partition("\n")
                table = "\n".join([head] + rest.split("\n")[1:])  # no separator line: rows of the table above
            blocks.append(table)
            continue
        text = item.text
        if last is not None and lines:
            height = max(1.0, last.bottom - last.top)
            if item.top < last.top or item.top - last.bottom > 0.8 * height:  # a new column or a paragraph
                blocks.append("\n".join(lines))
                lines = []
            elif HYPHENATED.search(lines[-1]) and text[:1].islower():
                first, _, text = text.partition(" ")
                lines[-1] = lines[-1][:-1] + first
        if text:
            lines.append(text)
        last = item
    if lines:
        blocks.append("\n".join(lines))
    return "\n\n".join(b for b in blocks if b.strip())


def _joined(pages: list[str], glued: list[bool]) -> tuple[str, list[int]]:
    """Page texts joined by blank lines (by one newline before a page that goes on with a table, so
    it stays one Markdown table), with each page's start offset (an empty page starts where the next
    one does, so page numbers stay those of the file)."""
    text, starts = "", []
    for page, glue in zip(pages, glued):
        page = page.strip()
        if page and text:
            text += "\n" if glue else "\n\n"
        starts.append(len(text))
        text += page
    return text, starts


def _ocr_scans(reader: Any, pages: list[str], options: Options) -> tuple[dict[str, int | float], str]:
    """OCR the pages without text that carry images, in place; (metadata, why OCR did not run)."""
    scanned = [n for n, text in enumerate(pages) if not text.strip() and reader.pages[n].images]
    if not scanned:
        return {}, ""
    if not options.ocr:
        return {}, "OCR is turned off (ocr: false)"
    if (reason := ocr.unavailable()) is not None:
        return {}, f"OCR is not available: {reason}"
    confidences = []
    for n in scanned[:options.ocr_max_pages]:
        options.check()  # seconds a page: the document's time budget
        texts = []
        for picture in reader.pages[n].images:
            text, confidence = ocr.read(picture.image, options.ocr_languages)
            if text:
                texts.append(text)
                confidences.append(confidence)
        pages[n] = "\n\n".join(texts)
    metadata: dict[str, int | float] = {"ocr_pages": min(len(scanned), options.ocr_max_pages)}
    if confidences:
        metadata["ocr_confidence"] = round(sum(confidences) / len(confidences), 3)
    skipped = len(scanned) - options.ocr_max_pages
    if skipped > 0:
        metadata["ocr_skipped_pages"] = skipped
    return metadata, (f"{skipped} scanned pages over the ocr_max_pages budget of {options.ocr_max_pages}"
                      if skipped > 0 else "")
