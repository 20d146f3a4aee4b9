"""Office, OpenDocument, EPUB, e-mail and RTF files made in memory with their own libraries, and the
load stage run over files: shared by the format tests (flows/formats/test_formats.py, test_bounds.py)
and the incremental ingestion of formats."""
from __future__ import annotations

import io
from email.message import EmailMessage
from pathlib import Path

from ragline.flows.context import StepContext
from ragline.tasks.ingest.load import Params, load

ROWS = [["Item", "Cost", "Owner"], ["Radar", "1200", "Ana"], ["Boat | hire", "300", "Bo"]]


def run(*paths: Path):
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=Params(paths=[str(p) for p in paths]), ctx=ctx)
    return {d.source_id.rsplit("/", 1)[-1]: d for d in documents}, {f.source_id.rsplit("/", 1)[-1]: f.reason
                                                                     for f in ctx.failures}


def docx_bytes() -> bytes:
    import docx

    document = docx.Document()
    document.core_properties.title = "Field Report"
    document.add_heading("Field Report", 0)
    document.add_paragraph("An introduction to the survey.")
    document.add_heading("Methods", 1)
    document.add_heading("Sampling", 2)
    document.add_paragraph("Stations were sampled weekly.")
    document.add_paragraph("first bullet", style="List Bullet")
    table = document.add_table(rows=0, cols=3)
    for row in ROWS:
        cells = table.add_row().cells
        for cell, value in zip(cells, row):
            cell.text = value
    document.add_heading("Results", 1)
    document.add_paragraph("Ice was thicker in the north.")
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def pptx_bytes() -> bytes:
    from pptx import Presentation
    from pptx.util import Inches

    deck = Presentation()
    for title, body in [("Kick-off", "Goals for the season"), ("Budget", None)]:
        slide = deck.slides.add_slide(deck.slide_layouts[5 if body is None else 1])
        slide.shapes.title.text = title
        if body:
            slide.placeholders[1].text = body
            slide.notes_slide.notes_text_frame.text = "Speak slowly"
        else:
            shape = slide.shapes.add_table(3, 3, Inches(1), Inches(2), Inches(6), Inches(2))
            for r, row in enumerate(ROWS):
                for c, value in enumerate(row):
                    shape.table.cell(r, c).text = value
    buffer = io.BytesIO()
    deck.save(buffer)
    return buffer.getvalue()


def xlsx_bytes() -> bytes:
    import openpyxl

    workbook = openpyxl.Workbook()
    sheet = workbook.active
    sheet.title = "Costs"
    for row in ROWS:
        sheet.append(row)
    workbook.create_sheet("Empty")
    notes = workbook.create_sheet("Notes")
    notes.append(["checked", None, None])
    buffer = io.BytesIO()
    workbook.save(buffer)
    return buffer.getvalue()


def odt_bytes() -> bytes:
    from odf.opendocument import OpenDocumentText
    from odf.table import Table, TableCell, TableColumn, TableRow
    from odf.text import H, P

    document = OpenDocumentText()
    document.text.addElement(H(outlinelevel=1, text="Methods"))
    document.text.addElement(H(outlinelevel=2, text="Sampling"))
    document.text.addElement(P(text="Stations were sampled weekly."))
    table = Table(name="costs")
    table.addElement(TableColumn(numbercolumnsrepeated=3))
    for row in ROWS:
        table_row = TableRow()
        for value in row:
            cell = TableCell()
            cell.addElement(P(text=value))
            table_row.addElement(cell)
        table.addElement(table_row)
    document.text.addElement(table)
    buffer = io.BytesIO()
    document.write(buffer)
    return buffer.getvalue()


def epub_bytes(path: Path) -> bytes:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("id-1")
    book.set_title("Ice Book")
    book.set_language("en")
    chapters = []
    for number, (title, body) in enumerate([("Methods", "<h2>Sampling</h2><p>Stations were sampled weekly.</p>"),
                                            ("Costs", "<table><tr><th>Item</th><th>Cost</th><th>Owner</th></tr>"
                                                      "<tr><td>Radar</td><td>1200</td><td>Ana</td></tr>"
                                                      "<tr><td>Boat | hire</td><td>300</td><td>Bo</td></tr></table>")],
                                           start=1):
        chapter = epub.EpubHtml(title=title, file_name=f"c{number}.xhtml", lang="en")
        chapter.content = f"<html><body><h1>{title}</h1>{body}</body></html>"
        book.add_item(chapter)
        chapters.append(chapter)
    book.toc = chapters
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = chapters
    epub.write_epub(str(path), book)
    return path.read_bytes()


def eml_bytes() -> bytes:
    message = EmailMessage()
    message["From"] = "Ana <ana@example.org>"
    message["To"] = "team@example.org"
    message["Subject"] = "Survey results"
    message["Date"] = "Mon, 02 Jun 2025 10:00:00 +0000"
    message.set_content("Hello team,\nthe radar survey is done.\n")
    message.add_attachment(docx_bytes(), maintype="application",
                           subtype="vnd.openxmlformats-officedocument.wordprocessingml.document", filename="report.docx")
    message.add_attachment(b"Plain notes about the boats.", maintype="text", subtype="plain", filename="notes.txt")
    message.add_attachment(b"\x89PNG\r\n\x1a\n....", maintype="image", subtype="png", filename="photo.png")
    message.add_attachment(b"not a workbook", maintype="application", subtype="octet-stream", filename="broken.xlsx")
    return message.as_bytes()


RTF = rb"{\rtf1\ansi{\fonttbl\f0\fswiss Helvetica;}\f0\pard Survey notes.\par The radar worked {\b well}.\par}"
