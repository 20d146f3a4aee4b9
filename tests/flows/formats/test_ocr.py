"""OCR of scanned pages and images through Debian's tesseract: a known text rendered to an image
reads back word for word; a scanned PDF page gets its text and its page number; without tesseract
(or with ocr: false) they are reported with the reason."""
from __future__ import annotations

import io
import shutil

import pytest
from fpdf import FPDF
from PIL import Image, ImageDraw, ImageFont

from ragline.flows.context import StepContext
from ragline.tasks.ingest.load import Params, load

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
LINES = ["The glacier survey measured ice thickness", "with ground penetrating radar at forty",
         "stations along the northern valley in June."]
needs_tesseract = pytest.mark.skipif(shutil.which("tesseract") is None,
                                     reason="tesseract is not installed (apt-get install tesseract-ocr)")


def scan(lines: list[str] = LINES) -> Image.Image:
    """A page as a scanner would give it: black text on white, 300-dpi-like size, no text layer."""
    image = Image.new("L", (1700, 120 + 70 * len(lines)), 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(FONT, 44)
    for n, line in enumerate(lines):
        draw.text((80, 60 + 70 * n), line, fill=0, font=font)
    return image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def scanned_pdf() -> bytes:
    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    pdf.add_page()
    pdf.multi_cell(0, 7, "A typed first page about the expedition budget and its boats.")
    pdf.add_page()
    pdf.image(scan(), x=10, y=10, w=190)  # the second page is only a picture of text
    return bytes(pdf.output())


def run(path, **options):
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=Params(paths=[str(path)], **options), ctx=ctx)
    return documents, {f.source_id.rsplit("/", 1)[-1]: f.reason for f in ctx.failures}


def word_accuracy(expected: str, got: str) -> float:
    want, have = expected.lower().split(), got.lower().split()
    return sum(1 for w in want if w in have) / len(want)


@needs_tesseract
def test_an_image_is_read_by_ocr_with_its_confidence(tmp_path):
    (tmp_path / "scan.png").write_bytes(png(scan()))
    (document,), failures = run(tmp_path / "scan.png")
    assert failures == {}
    assert word_accuracy(" ".join(LINES), document.text) >= 0.95, document.text
    assert document.format == "png" and document.metadata["ocr_pages"] == 1
    assert 0.8 <= document.metadata["ocr_confidence"] <= 1


@needs_tesseract
def test_a_scanned_pdf_page_is_read_by_ocr_and_keeps_its_page_number(tmp_path):
    (tmp_path / "expedition.pdf").write_bytes(scanned_pdf())
    (document,), failures = run(tmp_path)
    assert failures == {}
    assert document.metadata["ocr_pages"] == 1 and document.metadata["ocr_confidence"] >= 0.8
    second = document.text[document.pages[1]:]
    assert document.text[:document.pages[1]].startswith("A typed first page")
    assert word_accuracy(" ".join(LINES), second) >= 0.95, second
    assert document.page_at(document.text.index("radar")) == 2


@needs_tesseract
def test_the_ocr_page_budget_reports_what_it_left_out(tmp_path):
    (tmp_path / "expedition.pdf").write_bytes(scanned_pdf())
    (document,), _ = run(tmp_path, ocr_max_pages=0)
    assert "radar" not in document.text and document.metadata["ocr_skipped_pages"] == 1


def test_without_tesseract_scans_and_images_are_reported_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "scan.png").write_bytes(png(scan()))
    pdf = FPDF()
    pdf.add_page()
    pdf.image(scan(), x=10, y=10, w=190)
    (tmp_path / "only-scans.pdf").write_bytes(bytes(pdf.output()))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # a machine without tesseract-ocr

    documents, failures = run(tmp_path, include=["*.pdf", "*.png"])

    assert documents == []
    assert failures["scan.png"] == ("an image is read by OCR, which is not available: tesseract is not installed "
                                    "(apt-get install tesseract-ocr)")
    assert failures["only-scans.pdf"] == ("PDF has no extractable text (scanned images?); OCR is not available: "
                                          "tesseract is not installed (apt-get install tesseract-ocr)")
    _, off = run(tmp_path, include=["*.pdf", "*.png"], ocr=False)
    assert off["scan.png"].endswith("(ocr: false)") and off["only-scans.pdf"].endswith("OCR is turned off (ocr: false)")
