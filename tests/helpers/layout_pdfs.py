"""PDFs written by fpdf2 from known content, the layouts real reports have: a table with a header row
across pages, two columns positioned line by line, a running header and footer on every page, a
word hyphenated at a line end. What each holds is known, so a converter's output can be checked."""
from __future__ import annotations

import textwrap

from fpdf import FPDF

HEADER = "Quillfeather Logistics - Annual Operations Review 2025"
FOOTER = "Confidential - internal use only"
CAPTION = "Table 1: Parcels per day by depot"
COLUMNS = ["Depot", "Parcels per day", "On-time rate", "Vans"]
ROWS = [[f"Depot {n:02d}", str(1000 + 37 * n), f"{90 + n % 10}.{n % 7}%", str(5 + n % 13)] for n in range(1, 76)]
HYPHENATED = ("Deliveries from the northern depots rose in every quar-", "ter of the year, the review found.")
LEFT = [f"Left sentence {n} says the {w} fleet grew steadily through the year in every region we serve."
        for n, w in enumerate(["electric", "diesel", "rented", "leased"], start=1)]
RIGHT = [f"Right sentence {n} says the {w} depots shipped more parcels on time than the year before."
         for n, w in enumerate(["coastal", "inland", "urban", "rural"], start=1)]


class Report(FPDF):
    """Every page opens with the running header and ends with the footer and its page number."""

    def header(self):
        self.set_font("Helvetica", size=9)
        self.cell(0, 8, HEADER, align="C")
        self.ln(12)
        self.set_font("Helvetica", size=11)

    def footer(self):
        self.set_y(-15)
        self.set_font("Helvetica", size=9)
        self.cell(0, 8, f"{FOOTER} page {self.page_no()}", align="C")
        self.set_font("Helvetica", size=11)


def table_report(repeat_header: bool = True) -> bytes:
    """An introduction, the 75-row table over three pages (its header row repeated on each page, as
    fpdf2 does, unless ``repeat_header`` is false), then a paragraph with a hyphenated line end."""
    pdf = Report()
    pdf.add_page()
    pdf.multi_cell(0, 6, "This review reports the parcels each depot handled per day in 2025, its on-time "
                         "rate and the vans it ran.")
    pdf.ln(4)
    pdf.multi_cell(0, 6, CAPTION)
    with pdf.table(col_widths=(40, 50, 50, 30), repeat_headings=1 if repeat_header else 0) as table:
        for row in [COLUMNS, *ROWS]:
            table.row(row)
    pdf.ln(6)
    for line in HYPHENATED:
        pdf.cell(0, 6, line, new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def two_column_report() -> bytes:
    """A page with a full-width title over two columns of text written line by line across the page
    (left line 1, right line 1, left line 2, ...: the content stream interleaves the columns, as many
    exported reports and papers do), then a page of one column."""
    pdf = Report()
    pdf.add_page()
    pdf.multi_cell(0, 8, "Fleet and depots in two columns", align="C")
    top = pdf.get_y() + 8
    left, right = textwrap.wrap(" ".join(LEFT), 44), textwrap.wrap(" ".join(RIGHT), 44)
    for n in range(max(len(left), len(right))):
        for x, lines in ((10, left), (112, right)):
            if n < len(lines):
                pdf.text(x, top + 6 * n, lines[n])
    pdf.add_page()
    pdf.multi_cell(0, 6, "A second page of one column, so the running header and footer repeat.")
    return bytes(pdf.output())


def real_pdf(pages: list[str]) -> bytes:
    """A multi-page PDF written by fpdf2, text wrapped over many lines like a real report."""
    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for text in pages:
        pdf.add_page()
        if text:
            pdf.multi_cell(0, 6, text)
    return bytes(pdf.output())
