"""PDF conversion against ground truth (issue 35.4): PDFs written by fpdf2 from known content
(tests/helpers/layout_pdfs.py: a 75-row table with a header row across three pages, printed with
and without its header repeated per page; two columns positioned line by line across the page; a
running header and footer with page numbers on every page; a word hyphenated at a line end), read by
each converter:

- `pypdf` - each page's `extract_text()`, the converter before issue 35;
- `pdfplumber layout` - flows/formats/pdf.py now (pypdf opens, PDFium reads characters and ruling
  lines, pdfplumber groups words and finds tables).

When LibreOffice is installed, a fourth document: the same table report written as a DOCX by
python-docx (a bordered table whose header row repeats on each page, the running header and a footer
with a page number field, a line break after "quar-") and converted to PDF by LibreOffice, the way
office documents usually become PDFs. Bench-only (CI does not need it); on Debian 12, about a minute:

    apt-get install -y --no-install-recommends libreoffice-writer-nogui

Figures per converter: words of the source found in order (difflib over lower-cased words; the
table's source is its header and rows), table rows whole on one line, table cells exact (Markdown
cells equal to the source's, row and column), header rows shown (1 is right: once per table),
two-column sentences intact and in reading order, running header/footer lines leaked, the
hyphenated word joined, pages per second (median of --repeats over all the PDFs).

Usage: .venv/bin/python bench/pdf_quality.py [--repeats 5] [--no-readme]
"""
from __future__ import annotations

import argparse
import difflib
import io
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import publish, save
from pypdf import PdfReader

from ragline.flows.formats import pdf
from tests.helpers.layout_pdfs import (CAPTION, COLUMNS, FOOTER, HEADER, HYPHENATED, LEFT, RIGHT, ROWS, table_report,
                                       two_column_report)

WORD = re.compile(r"\w+")
INTRO = ("This review reports the parcels each depot handled per day in 2025, its on-time rate and the vans it "
         "ran.")


def pypdf_text(data: bytes) -> str:
    return "\n\n".join(page.extract_text() or "" for page in PdfReader(io.BytesIO(data)).pages)


def layout_text(data: bytes) -> str:
    return pdf.convert(data, "report.pdf").text


def libreoffice_report() -> bytes:
    """The table report as a DOCX (python-docx), converted to PDF by LibreOffice (``soffice``)."""
    import docx
    from docx.oxml import parse_xml
    from docx.oxml.ns import nsdecls

    document = docx.Document()
    section = document.sections[0]
    section.header.paragraphs[0].text = HEADER
    footer = section.footer.paragraphs[0]
    footer.text = f"{FOOTER} page "
    footer._p.append(parse_xml(f'<w:fldSimple {nsdecls("w")} w:instr="PAGE"><w:r><w:t>1</w:t></w:r></w:fldSimple>'))
    document.add_paragraph(INTRO)
    document.add_paragraph(CAPTION)
    table = document.add_table(rows=0, cols=len(COLUMNS))
    table.style = "Table Grid"  # ruled cells
    for cells in [COLUMNS, *ROWS]:
        row = table.add_row()
        for cell, text in zip(row.cells, cells):
            cell.text = text
    table.rows[0]._tr.get_or_add_trPr().append(parse_xml(f"<w:tblHeader {nsdecls('w')}/>"))  # repeated per page
    paragraph = document.add_paragraph(HYPHENATED[0])
    paragraph.runs[0].add_break()
    paragraph.add_run(HYPHENATED[1])
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "report.docx"
        document.save(source)
        subprocess.run(["soffice", f"-env:UserInstallation=file://{folder}/profile", "--headless", "--convert-to",
                        "pdf", "--outdir", folder, str(source)], check=True, capture_output=True, timeout=300)
        return (Path(folder) / "report.pdf").read_bytes()


CONVERTERS = {"pypdf": pypdf_text, "pdfplumber layout": layout_text}
DOCUMENTS = {"table, header repeated per page": table_report(True), "table, header once": table_report(False),
             "two columns": two_column_report()}
if shutil.which("soffice"):
    DOCUMENTS["table, DOCX via LibreOffice"] = libreoffice_report()


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def word_accuracy(source: str, text: str) -> float:
    """Share of the source's words the output holds in the source's order."""
    wanted, got = words(source), words(text)
    matched = sum(block.size for block in difflib.SequenceMatcher(None, wanted, got, autojunk=False).get_matching_blocks())
    return matched / len(wanted)


def table_figures(text: str) -> dict[str, float]:
    lines = text.split("\n")
    on_one_line = sum(any(re.search(r"\s*\W*\s*".join(re.escape(c) for c in row), line) for line in lines)
                      for row in ROWS)
    parsed = {cells[0]: cells for line in lines if line.startswith("|")
              for cells in [[c.strip() for c in line.strip().strip("|").split("|")]] if cells}
    exact = sum(a == b for row in ROWS for a, b in zip(row, parsed.get(row[0], [])))
    header = "| " + " | ".join(COLUMNS) + " |"
    return {"rows whole on a line": on_one_line / len(ROWS), "cells exact": exact / (len(ROWS) * len(COLUMNS)),
            "header rows shown": float(sum(line == header for line in lines))}


def column_figures(text: str) -> dict[str, float]:
    flat = " ".join(text.split())
    sentences = LEFT + RIGHT
    at = [flat.find(s) for s in sentences]
    intact = [p for p in at if p >= 0]
    return {"sentences intact": len(intact) / len(sentences),
            "in reading order": float(len(intact) == len(sentences) and at == sorted(at))}


def figures(name: str, text: str) -> dict[str, float]:
    if name.startswith("table"):
        source = "\n".join([INTRO, CAPTION, " ".join(COLUMNS), *(" ".join(r) for r in ROWS),
                            HYPHENATED[0][:-1] + HYPHENATED[1]])
        found = table_figures(text)
    else:
        source = "\n".join(["Fleet and depots in two columns", *LEFT, *RIGHT,
                            "A second page of one column, so the running header and footer repeat."])
        found = column_figures(text)
    flat = " ".join(text.split())
    return {"words in order": word_accuracy(source, text), **found,
            "header/footer lines leaked": float(flat.count(HEADER) + flat.count(FOOTER)),
            **({"hyphenated word joined": float("quarter of the year" in flat)} if name.startswith("table") else {})}


def pages_per_second(convert, repeats: int) -> float:
    pages = sum(len(PdfReader(io.BytesIO(data)).pages) for data in DOCUMENTS.values())
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for data in DOCUMENTS.values():
            convert(data)
        seconds.append(time.perf_counter() - started)
    return pages / statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    result: dict = {}
    for converter, convert in CONVERTERS.items():
        result[converter] = {name: figures(name, convert(data)) for name, data in DOCUMENTS.items()}
        result[converter]["pages/s"] = pages_per_second(convert, args.repeats)
    save("pdf_quality", result)
    lines = ["| document | figure | " + " | ".join(CONVERTERS) + " |", "|---|---|" + "---:|" * len(CONVERTERS)]
    for name in DOCUMENTS:
        for key in result["pypdf"][name]:
            lines.append(f"| {name} | {key} | " + " | ".join(f"{result[c][name][key]:.2f}".rstrip("0").rstrip(".")
                                                             if key.endswith(("leaked", "shown")) else
                                                             f"{result[c][name][key]:.2f}" for c in CONVERTERS) + " |")
    lines.append(f"| all {len(DOCUMENTS)} | pages/s | " + " | ".join(f"{result[c]['pages/s']:.1f}" for c in CONVERTERS) + " |")
    publish("pdf_quality", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
