"""Issue 39 items 5 and 6: what one document may cost. Zip bombs in every zip-based format and
compressed PDF streams are refused before parsing, with the member and the limit named; a document
past its time or text budget is skipped with the reason; the rest of the run goes on.

The bombs are built here with zipfile (small on disk, huge inflated); they are valid packages, so
a loader without the limits parses them (the 100 MB one for half an hour)."""
from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import pytest

from ragline.flows import settings
from tests.helpers.office_files import RTF, docx_bytes, epub_bytes, odt_bytes, pptx_bytes, run, xlsx_bytes

PARAGRAPH = b"<w:p><w:r><w:t>Stations were sampled weekly.</w:t></w:r></w:p>"


def inflated(package: bytes, member: str, head: bytes, repeated: bytes, tail: bytes, size: int) -> bytes:
    """``package`` with ``member`` replaced by ``head + repeated * n + tail`` of about ``size`` bytes,
    written a piece at a time (the test never holds the inflated text)."""
    source = zipfile.ZipFile(io.BytesIO(package))
    assert member in source.namelist(), source.namelist()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for info in source.infolist():
            if info.filename != member:
                target.writestr(info, source.read(info))
                continue
            entry = zipfile.ZipInfo(member)
            entry.compress_type = zipfile.ZIP_DEFLATED
            with target.open(entry, "w", force_zip64=True) as stream:
                stream.write(head)
                piece = repeated * max(1, 1_000_000 // len(repeated))
                for _ in range(max(1, size // len(piece))):
                    stream.write(piece)
                stream.write(tail)
    return out.getvalue()


def docx_body(package: bytes) -> tuple[bytes, bytes]:
    """word/document.xml of a package cut around its body's content: (up to <w:body>, from </w:body>)."""
    xml = zipfile.ZipFile(io.BytesIO(package)).read("word/document.xml")
    start = xml.index(b"<w:body>") + len(b"<w:body>")
    return xml[:start], xml[xml.index(b"</w:body>"):]


def docx_bomb(size: int) -> bytes:
    head, tail = docx_body(docx_bytes())
    return inflated(docx_bytes(), "word/document.xml", head, PARAGRAPH, tail, size)


@pytest.mark.timeout(120)  # without the limits: about 36 minutes of parsing at 1.9 GB
def test_a_341_kb_docx_inflating_to_100_mb_is_skipped_before_parsing_and_the_run_goes_on(tmp_path):
    bomb = docx_bomb(100_000_000)
    assert len(bomb) < 400_000
    (tmp_path / "bomb.docx").write_bytes(bomb)
    (tmp_path / "good.rtf").write_bytes(RTF)
    documents, failures = run(tmp_path)
    assert list(documents) == ["good.rtf"]
    assert "'word/document.xml'" in failures["bomb.docx"], failures
    assert "document_max_member_bytes limit of 64000000" in failures["bomb.docx"]


def _sheet_parts(package: bytes) -> tuple[bytes, bytes]:
    xml = zipfile.ZipFile(io.BytesIO(package)).read("xl/worksheets/sheet1.xml")
    start = xml.index(b"<sheetData>") + len(b"<sheetData>")
    return xml[:start], xml[xml.index(b"</sheetData>"):]


# (name, package builder, member, head/tail, the piece repeated): each a valid package, ~4 MB inflated
BOMBS = {
    "docx": (lambda tmp: docx_bytes(), "word/document.xml", lambda p: docx_body(p), PARAGRAPH),
    "xlsx": (lambda tmp: xlsx_bytes(), "xl/worksheets/sheet1.xml", _sheet_parts,
             b'<row><c t="inlineStr"><is><t>Radar</t></is></c></row>'),
    "pptx": (lambda tmp: pptx_bytes(), "ppt/slides/slide1.xml", None, b"<!-- speaker notes, repeated -->"),
    "odt": (lambda tmp: odt_bytes(), "content.xml", None, b"<!-- sampled weekly, repeated -->"),
    "epub": (lambda tmp: epub_bytes(tmp.parent / f"{tmp.name}.epub"), "EPUB/c1.xhtml", None, b"<!-- a chapter, repeated -->"),
}


def _bomb(kind: str, tmp_path: Path, size: int) -> bytes:
    build, member, cut, piece = BOMBS[kind]
    package = build(tmp_path)
    if cut is not None:
        head, tail = cut(package)
    else:  # a comment before the root element: the member stays well-formed XML
        xml = zipfile.ZipFile(io.BytesIO(package)).read(member)
        split = xml.index(b"?>") + 2 if xml.startswith(b"<?xml") else 0
        head, tail = xml[:split], xml[split:]
    return inflated(package, member, head, piece, tail, size)


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_every_zip_based_format_refuses_a_member_inflating_past_the_expansion_ratio(tmp_path, kind):
    (tmp_path / f"bomb.{kind}").write_bytes(_bomb(kind, tmp_path, 4_000_000))
    (tmp_path / "good.rtf").write_bytes(RTF)
    documents, failures = run(tmp_path)
    assert list(documents) == ["good.rtf"], failures
    reason = failures[f"bomb.{kind}"]
    assert f"archive member '{BOMBS[kind][1]}' inflates" in reason
    assert "document_max_expansion_ratio limit of 100" in reason


def test_member_and_package_sizes_have_their_own_limits(tmp_path, monkeypatch):
    (tmp_path / "report.docx").write_bytes(docx_bytes())
    monkeypatch.setenv(settings.env_name("document_max_member_bytes"), "2000")
    failures = run(tmp_path)[1]
    assert "over the document_max_member_bytes limit of 2000" in failures["report.docx"]
    assert "archive member '" in failures["report.docx"]
    monkeypatch.delenv(settings.env_name("document_max_member_bytes"))
    monkeypatch.setenv(settings.env_name("document_max_expanded_bytes"), "20000")
    failures = run(tmp_path)[1]
    assert "inflate to over 20000 bytes together" in failures["report.docx"]
    monkeypatch.delenv(settings.env_name("document_max_expanded_bytes"))
    assert list(run(tmp_path)[0]) == ["report.docx"]  # the defaults read a normal document


def flate_pdf(content: bytes) -> bytes:
    """A one-page PDF whose content stream is ``content``, Flate-compressed."""
    packed = zlib.compress(content, 9)
    bodies = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [5 0 R] /Count 1 >>",
              b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
              b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream",
              b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
              b"/Contents 4 0 R >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(bodies, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(bodies) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(bodies) + 1, xref)
    return bytes(out)


def test_a_pdf_stream_inflating_past_the_member_limit_is_skipped(tmp_path, monkeypatch):
    line = b"BT /F1 12 Tf 72 720 Td (Stations were sampled weekly) Tj ET\n"
    (tmp_path / "bomb.pdf").write_bytes(flate_pdf(line * 60_000))  # 3.5 MB of drawing, 15 KB on disk
    (tmp_path / "small.pdf").write_bytes(flate_pdf(line * 10))
    monkeypatch.setenv(settings.env_name("document_max_member_bytes"), "1000000")
    documents, failures = run(tmp_path)
    assert list(documents) == ["small.pdf"]
    assert "PDF stream inflates past the document_max_member_bytes limit of 1000000" in failures["bomb.pdf"]


# --- the per-document budget: time and text -------------------------------------------------

def long_docx(paragraphs: int) -> bytes:
    import docx

    document = docx.Document()
    for number in range(paragraphs):
        document.add_paragraph(f"Paragraph {number}: stations were sampled weekly.")
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def test_a_document_past_its_time_budget_is_skipped_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "long.docx").write_bytes(long_docx(200))
    (tmp_path / "good.txt").write_text("A short note.")
    monkeypatch.setenv(settings.env_name("document_max_seconds"), "0.000001")  # over once the file is opened
    documents, failures = run(tmp_path)
    assert list(documents) == ["good.txt"]  # a text file has no loop to check: its size bounds it
    assert failures["long.docx"] == "took over the document_max_seconds limit of 1e-06 s"


@pytest.mark.parametrize("name", ["long.docx", "long.txt"])
def test_a_document_past_its_text_budget_is_skipped_with_the_reason(tmp_path, monkeypatch, name):
    if name.endswith(".docx"):
        (tmp_path / name).write_bytes(long_docx(200))
    else:
        (tmp_path / name).write_text("stations were sampled weekly. " * 400)
    (tmp_path / "good.txt").write_text("A short note.")
    monkeypatch.setenv(settings.env_name("document_max_chars"), "5000")
    documents, failures = run(tmp_path)
    assert list(documents) == ["good.txt"]
    assert "over the document_max_chars limit" in failures[name] and "5000" in failures[name]
