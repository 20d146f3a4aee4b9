"""PDF conversion keeps the layout (issue 35.1), on PDFs fpdf2 writes from known content: a 75-row
table across three pages is one Markdown table (header kept once, each row on one line, each on the
page it is printed on), two columns read in order, running headers, footers and page numbers gone,
a hyphenated line end joined, a meaningless metadata title not used."""
from __future__ import annotations

import bisect
import io

import pytest
from pypdf import PdfReader

from ragline.flows.formats import pdf
from tests.helpers.documents import make_pdf
from tests.helpers.layout_pdfs import (CAPTION, COLUMNS, HEADER, HYPHENATED, LEFT, RIGHT, ROWS, table_report,
                                       two_column_report)


def line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def page_texts(data: bytes) -> list[str]:
    """Each page's text as pypdf extracts it: where the PDF prints what, independently of pdfplumber."""
    return [page.extract_text() for page in PdfReader(io.BytesIO(data)).pages]


def printed_on(texts: list[str], needle: str) -> int:
    """The page (1-based) whose text (``page_texts``) holds ``needle``, the only one."""
    pages = [n for n, text in enumerate(texts, start=1) if needle in text]
    assert len(pages) == 1, (needle, pages)
    return pages[0]


@pytest.mark.parametrize("repeat_header", [True, False], ids=["header-repeated-per-page", "header-once"])
def test_a_table_across_three_pages_is_one_markdown_table_on_its_pages(repeat_header):
    data = table_report(repeat_header)
    converted = pdf.convert(data, "review.pdf")

    assert len(converted.pages) == 3 == converted.metadata["pages"]
    lines = converted.text.split("\n")
    table = [n for n, text in enumerate(lines) if text.startswith("|")]
    assert table == list(range(table[0], table[0] + 77))  # one table: header, rule, 75 rows, no gap
    assert lines[table[0]] == line(COLUMNS) and lines[table[0] + 1] == "|---|---|---|---|"
    assert lines[table[0] - 2] == CAPTION
    assert [lines[n] for n in table[2:]] == [line(row) for row in ROWS]  # every row whole, in order
    assert converted.text.count(line(COLUMNS)) == 1
    pages, printed = set(), page_texts(data)
    for row in ROWS:  # each row on the page the PDF prints it on
        page = bisect.bisect_right(converted.pages, converted.text.index(line(row)))
        assert page == printed_on(printed, row[0] + " "), row
        pages.add(page)
    assert pages == {1, 2, 3}


def test_running_headers_footers_and_page_numbers_are_dropped_and_hyphens_joined():
    for data in (table_report(), two_column_report()):
        text = pdf.convert(data, "review.pdf").text
        assert HEADER not in text and "Quillfeather" not in text
        assert "Confidential" not in text and "page 1" not in text.lower()
    text = pdf.convert(table_report(), "review.pdf").text
    assert "every quarter\nof the year" in text and "quar-" not in text
    assert HYPHENATED[0][:-5] in text  # the rest of the line is untouched


def test_two_columns_are_read_column_by_column():
    converted = pdf.convert(two_column_report(), "fleet.pdf")
    flat = " ".join(converted.text.split())
    where = [flat.find(sentence) for sentence in ["Fleet and depots in two columns", *LEFT, *RIGHT]]
    assert -1 not in where, flat  # every sentence whole
    assert where == sorted(where)  # the title, then the left column, then the right one
    assert converted.pages[1] == converted.text.index("A second page")


def test_a_one_page_document_keeps_its_lines_and_a_meaningless_title_is_not_used():
    converted = pdf.convert(make_pdf(["Reindeer herding report from Lapland"], title="(anonymous)"), "r.pdf")
    assert converted.text == "Reindeer herding report from Lapland" and converted.title == ""
    for title in ("untitled", "Untitled 3", "", " "):
        assert pdf.convert(make_pdf(["Some text here"], title=title), "r.pdf").title == ""
    assert pdf.convert(make_pdf(["Some text here"], title="Annual review"), "r.pdf").title == "Annual review"


def test_a_page_number_alone_at_the_foot_of_each_page_is_dropped():
    from fpdf import FPDF
    document = FPDF()
    document.set_font("Helvetica", size=11)
    places = ["Bergen", "the Lofoten islands", "Tromso", "the North Cape"]
    for n, place in enumerate(places, start=1):
        document.add_page()
        document.multi_cell(0, 6, f"Chapter {n} tells of the voyage to {place}, day {n * 3} of the crossing.")
        document.set_y(-15)
        document.cell(0, 8, str(n), align="C")
    converted = pdf.convert(bytes(document.output()), "voyage.pdf")
    assert converted.text.split("\n\n") == [f"Chapter {n} tells of the voyage to {place}, day {n * 3} of the "
                                            f"crossing." for n, place in enumerate(places, start=1)]


def ruled_grid(rows: int) -> bytes:
    """One tall page holding a grid of ``rows`` x 4 ruled cells in a 4-point font."""
    from fpdf import FPDF

    document = FPDF(unit="pt", format=(600, rows * 6 + 100))
    document.set_auto_page_break(False)
    document.add_page()
    document.set_font("Helvetica", size=4)
    with document.table(col_widths=(100, 100, 100, 100), line_height=6, width=400) as table:
        for r in range(rows):
            table.row([f"r{r}c{c}" for c in range(4)])
    return bytes(document.output())


def test_cell_texts_are_pdfplumbers_own_without_its_scan_per_row():
    """The bisected cell texts equal Table.extract()'s (which scans every character of the page per
    row: one page of 10,000 cells took 117 s)."""
    import pdfplumber

    for data in (table_report(), ruled_grid(100)):  # 400 cells: extract() is quadratic in a page's rows
        with pdfplumber.open(io.BytesIO(data)) as document:
            for page in document.pages:
                tables = page.find_tables()
                chars = pdf._CharRows(page.chars)
                assert all(pdf._cell_texts(t, chars) == t.extract() for t in tables)
                assert tables or page.page_number > 1


def test_a_one_line_cell_has_extract_texts_text_and_other_cells_are_left_to_it():
    from pdfplumber.utils import extract_text

    def char(text, x0, top=10.0, width=5.0, upright=True):
        return {"text": text, "x0": x0, "x1": x0 + width, "top": top, "bottom": top + 9, "doctop": top,
                "size": 9.0, "upright": upright}

    cells = [
        [char("a", 0), char("\ufb01", 5), char("x", 14), char(" ", 19), char("y", 24)],  # ligature, gap, blank
        [char("b", 20), char("a", 0, top=11.5), char("c", 4)],  # out of order, tops within 3 points
        [char("r", 30), char("s", 33)],  # starting left of the one before's end: no gap
    ]
    for chars in cells:
        assert pdf._one_line_text(chars) == extract_text(chars)
    assert pdf._one_line_text([char("a", 0), char("b", 0, top=20)]) is None  # two lines: extract_text reads it
    assert pdf._one_line_text([char("a", 0, upright=False)]) is None


def test_a_page_of_more_ruled_cells_than_the_table_finder_is_given_is_read_as_lines():
    rows = pdf.MAX_TABLE_EDGES // 16 + 50  # 4 cells of 4 edges a row: over the bound
    text = pdf.convert(ruled_grid(rows), "grid.pdf").text
    lines = text.split("\n")
    assert "|" not in text and lines[0] == "r0c0 r0c1 r0c2 r0c3" and lines[-1] == f"r{rows - 1}c0 r{rows - 1}c1 " \
        f"r{rows - 1}c2 r{rows - 1}c3"
    under = pdf.convert(ruled_grid(200), "grid.pdf").text  # under it: a Markdown table
    assert under.split("\n")[:3] == ["| r0c0 | r0c1 | r0c2 | r0c3 |", "|---|---|---|---|", "| r1c0 | r1c1 | r1c2 | r1c3 |"]


# --- bad PDFs stay bounded: ten thousand pages, a page that is one image -------------------------

def long_manual(pages: int) -> bytes:
    """``pages`` pages, each a paragraph mid-page: one page written by fpdf2, repeated by pypdf (a
    page object per page, one shared content stream), so ten thousand pages take a second to make."""
    from fpdf import FPDF
    from pypdf import PdfWriter

    document = FPDF()
    document.add_page()
    document.set_font("Helvetica", size=11)
    document.set_y(120)
    document.multi_cell(0, 6, "A page of the long manual: the same paragraph on each of its pages.")
    page = PdfReader(io.BytesIO(bytes(document.output()))).pages[0]
    writer = PdfWriter()
    for _ in range(pages):
        writer.add_page(page)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def test_a_ten_thousand_page_pdf_is_stopped_by_the_time_and_text_budgets_with_the_reason():
    import time

    from ragline.flows.formats.base import BudgetExceeded, Options

    data = long_manual(10_000)
    started, cpu = time.monotonic(), time.process_time()
    with pytest.raises(BudgetExceeded, match=r"took over the document_max_seconds limit of 0.5 s"):
        pdf.convert(data, "manual.pdf", Options(seconds=0.5, deadline=started + 0.5))
    # checked before every page, not at the end (the whole file takes ~12 s of CPU): CPU time, which
    # a loaded machine does not inflate as it does the wall clock
    assert time.process_time() - cpu < 5
    with pytest.raises(BudgetExceeded, match=r"text over the document_max_chars limit of 20000 characters"):
        pdf.convert(data, "manual.pdf", Options(max_chars=20_000))  # the text held stays bounded


@pytest.mark.integration  # 10,000 pages: about 12 s on an idle 2-core machine
def test_a_ten_thousand_page_pdf_is_read_whole_with_every_page_start():
    converted = pdf.convert(long_manual(10_000), "manual.pdf")
    assert converted.metadata["pages"] == 10_000 == len(converted.pages)
    paragraph = "A page of the long manual: the same paragraph on each of its pages."
    assert converted.text == "\n\n".join([paragraph] * 10_000)
    assert converted.pages == [n * (len(paragraph) + 2) for n in range(10_000)]


def one_image_page(side: int) -> bytes:
    """One page that is one picture (``side`` pixels square, one colour: its stream is small, its
    pixels ``3 * side**2`` bytes) and no text layer."""
    from fpdf import FPDF
    from PIL import Image

    document = FPDF()
    document.add_page()
    document.image(Image.new("RGB", (side, side), "white"), x=10, y=10, w=190)
    return bytes(document.output())


def test_a_page_that_is_one_image_is_reported_with_the_reason_without_decoding_it():
    import time

    from ragline.flows.formats.base import FormatError, Options

    data = one_image_page(4000)  # 48 MB of pixels in a 50 KB stream
    started = time.process_time()  # CPU time: decoding 48 MB of pixels would show; load does not
    with pytest.raises(FormatError, match=r"^PDF has no extractable text \(scanned images\?\); OCR is turned off"):
        pdf.convert(data, "scan.pdf", Options(ocr=False))
    assert time.process_time() - started < 5
    if pdf.ocr.unavailable() is None:  # OCR would decode it: the stream limit refuses its pixels first
        with pytest.raises(FormatError, match=r"PDF stream inflates past the document_max_member_bytes limit"):
            pdf.convert(data, "scan.pdf", Options(max_member_bytes=8_000_000))


def test_pdfium_is_called_by_one_thread_at_a_time():
    """PDFium is not thread-safe (a concurrent call can crash the process): a conversion waits while
    another thread holds PDFium's lock, and conversions on several threads read as on one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ragline.flows.formats import pdfium_page

    with pdfium_page.LOCK:
        waiting = threading.Thread(target=pdf.convert, args=(two_column_report(), "r.pdf"))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive()  # blocked on the lock, not reading PDFium beside its holder
    waiting.join(timeout=30)
    assert not waiting.is_alive()
    documents = [table_report(), two_column_report(), ruled_grid(100)] * 2
    alone = [pdf.convert(data, "r.pdf").text for data in documents]
    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(lambda data: pdf.convert(data, "r.pdf").text, documents)) == alone
