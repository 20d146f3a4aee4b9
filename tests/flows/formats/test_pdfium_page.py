"""PDFium's characters and ruling edges land where pdfplumber (pdfminer) puts them: the same words at
the same places on pages turned by /Rotate, the same ruling edges, a crop box's corner as origin."""
from __future__ import annotations

import io

import pdfplumber
import pypdfium2
import pytest
from pdfplumber.utils import extract_words
from pypdf import PdfReader, PdfWriter
from pypdf.generic import RectangleObject

from ragline.flows.formats import pdfium_page
from tests.helpers.layout_pdfs import table_report


def rewritten(data: bytes, rotate: int = 0, crop: tuple[float, float] | None = None) -> bytes:
    """The PDF with its pages turned by /Rotate, or cropped from (left, bottom) onwards."""
    reader, writer = PdfReader(io.BytesIO(data)), PdfWriter()
    for page in reader.pages:
        if rotate:
            page.rotate(rotate)
        if crop:
            page.cropbox = RectangleObject([*crop, float(page.mediabox.width), float(page.mediabox.height)])
        writer.add_page(page)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def pdfium_read(data: bytes) -> tuple[pdfium_page.PageView, list[dict], list[dict]]:
    page = pypdfium2.PdfDocument(data)[0]
    view = pdfium_page.PageView(page)
    return view, pdfium_page.chars(page, view), pdfium_page.edges(page, view)


def placed(words: list[dict]) -> list[tuple[str, int, int]]:
    return [(w["text"], round(w["x0"]), round(w["top"])) for w in words]


def edge_set(edges: list[dict]) -> set[tuple]:
    return {(e["orientation"], round(e["x0"], 1), round(e["top"], 1), round(e["x1"], 1), round(e["bottom"], 1))
            for e in edges}


@pytest.mark.parametrize("rotate", [0, 90, 180, 270])
def test_words_and_ruling_edges_are_where_pdfplumber_puts_them_on_turned_pages(rotate):
    data = rewritten(table_report(), rotate=rotate)
    view, chars, edges = pdfium_read(data)
    with pdfplumber.open(io.BytesIO(data)) as document:
        page = document.pages[0]
        assert (round(view.width), round(view.height)) == (round(page.width), round(page.height))
        theirs = placed(page.extract_words())
        assert edge_set(edges) == edge_set(page.edges)
    ours = placed(extract_words(chars))
    assert [w[0] for w in ours] == [w[0] for w in theirs]
    assert all(abs(a[1] - b[1]) <= 2 and abs(a[2] - b[2]) <= 2 for a, b in zip(ours, theirs))  # ascent aside


def test_a_crop_box_is_the_page_shown_its_corner_the_origin():
    full_view, full, _ = pdfium_read(table_report())
    view, cropped, _ = pdfium_read(rewritten(table_report(), crop=(20.0, 30.0)))
    assert (view.width, view.height) == pytest.approx((full_view.width - 20, full_view.height - 30))
    assert [(c["text"], c["x0"], c["top"]) for c in cropped] == \
        [(c["text"], pytest.approx(c["x0"] - 20), pytest.approx(c["top"])) for c in full]
