"""A converted file that turns unreadable keeps what was indexed from it (and from its attachments)
on a real Chroma, BM25 and state record: the failure is the file's, with the converter's reason."""
from __future__ import annotations

import json

import pytest

from tests.helpers.harness import run_index, snapshot
from tests.helpers.layout_pdfs import real_pdf
from tests.helpers.office_files import docx_bytes, eml_bytes

pytestmark = pytest.mark.integration


def test_a_corrupted_office_mail_or_pdf_file_keeps_its_indexed_chunks(tmp_path, index_project):
    project = index_project(batch_size=4)
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "report.docx").write_bytes(docx_bytes())
    (docs / "mail.eml").write_bytes(eml_bytes())
    (docs / "slides.pdf").write_bytes(real_pdf(["Radar pulses reflect from the bedrock beneath the glacier at every station.",
                                                     "The ice is thickest in the north, where the survey began."]))
    first = run_index(project)
    assert first.added == 5 and first.failed == 1  # report, mail, its docx and txt attachments, the PDF; broken.xlsx
    before = snapshot(project)
    metadata = [json.loads(meta) for _, _, meta in before["chroma"]]
    assert sorted(m["page_start"] for m in metadata if m["source"].endswith("slides.pdf")) == [1, 2]
    assert {m["section"] for m in metadata if m["source"].endswith("report.docx")} == {"Field Report"}  # small: one chunk

    (docs / "report.docx").write_bytes(b"PK\x03\x04 damaged in transit")
    (docs / "mail.eml").write_bytes(b"\x00\x01 not mail any more")
    (docs / "slides.pdf").write_bytes(b"%PDF-1.4 truncated")
    report = run_index(project)

    assert report.deleted == 0 and report.failed == 3
    reasons = {f.source_id.rsplit("/", 1)[-1]: f.reason for f in report.failures}
    assert reasons["report.docx"].startswith("unreadable DOCX") and reasons["slides.pdf"].startswith("unreadable PDF")
    assert reasons["mail.eml"].startswith("not an e-mail message")
    assert snapshot(project)["chroma"] == before["chroma"]  # nothing of the three files (or the attachments) lost
