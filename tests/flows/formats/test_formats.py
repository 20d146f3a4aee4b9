"""Office, OpenDocument, EPUB, e-mail and RTF files, written by their own libraries here, read
through the ``load`` stage: text, headings as '#' lines, tables as Markdown tables, attachments as
documents of their own; a corrupt file of each kind fails alone, with the reason."""
from __future__ import annotations

import pytest

from ragline.flows import formats
from tests.helpers.office_files import (RTF, docx_bytes, eml_bytes, epub_bytes, odt_bytes, pptx_bytes, run,
                                        xlsx_bytes)

TABLE = "| Item | Cost | Owner |\n|---|---|---|\n| Radar | 1200 | Ana |\n| Boat \\| hire | 300 | Bo |"


def test_every_builtin_format_is_registered():
    assert formats.extensions() == [".docx", ".eml", ".epub", ".jpeg", ".jpg", ".odt", ".pdf", ".png", ".pptx", ".rtf",
                                    ".tif", ".tiff", ".xlsx"]
    assert formats.converter(".DOCX") is formats.converter(".docx") and formats.converter(".txt") is None


def test_docx_headings_lists_and_tables(tmp_path):
    (tmp_path / "report.docx").write_bytes(docx_bytes())
    documents, failures = run(tmp_path)
    assert failures == {}
    document = documents["report.docx"]
    assert (document.format, document.title) == ("docx", "Field Report")
    assert document.text == ("# Field Report\n\nAn introduction to the survey.\n\n# Methods\n\n## Sampling\n\n"
                             f"Stations were sampled weekly.\n\n- first bullet\n\n{TABLE}\n\n# Results\n\n"
                             "Ice was thicker in the north.")


def test_pptx_slides_are_pages_with_titles_tables_and_notes(tmp_path):
    (tmp_path / "deck.pptx").write_bytes(pptx_bytes())
    documents, failures = run(tmp_path)
    assert failures == {}
    deck = documents["deck.pptx"]
    assert deck.title == "Kick-off"
    assert deck.text == f"# Kick-off\n\nGoals for the season\n\nNotes: Speak slowly\n\n# Budget\n\n{TABLE}"
    assert deck.pages == [0, deck.text.index("# Budget")] and deck.metadata["pages"] == 2


def test_xlsx_sheets_as_tables(tmp_path):
    (tmp_path / "costs.xlsx").write_bytes(xlsx_bytes())
    documents, failures = run(tmp_path)
    assert failures == {}
    assert documents["costs.xlsx"].text == f"# Costs\n\n{TABLE}\n\n# Notes\n\n| checked |\n|---|"


def test_odt_headings_and_tables(tmp_path):
    (tmp_path / "notes.odt").write_bytes(odt_bytes())
    documents, failures = run(tmp_path)
    assert failures == {}
    assert documents["notes.odt"].text == f"# Methods\n\n## Sampling\n\nStations were sampled weekly.\n\n{TABLE}"


def test_epub_chapters_in_reading_order(tmp_path):
    epub_bytes(tmp_path / "book.epub")
    documents, failures = run(tmp_path)
    assert failures == {}
    book = documents["book.epub"]
    assert book.title == "Ice Book"
    assert book.text == f"# Methods\n\n## Sampling\n\nStations were sampled weekly.\n\n# Costs\n\n{TABLE}"


def test_eml_body_and_attachments_as_their_own_documents(tmp_path):
    (tmp_path / "mail.eml").write_bytes(eml_bytes())
    documents, failures = run(tmp_path)
    mail = documents["mail.eml"]
    assert mail.title == "Survey results"
    assert mail.text == ("From: Ana <ana@example.org>\nTo: team@example.org\nDate: Mon, 02 Jun 2025 10:00:00 +0000"
                         "\n\nHello team,\nthe radar survey is done.")
    report, notes = documents["mail.eml#report.docx"], documents["mail.eml#notes.txt"]
    assert (report.format, report.title, report.metadata["attachment"]) == ("docx", "Field Report", "report.docx")
    assert TABLE in report.text and notes.text == "Plain notes about the boats."
    assert set(documents) == {"mail.eml", "mail.eml#report.docx", "mail.eml#notes.txt"}  # the photo is no document
    assert list(failures) == ["mail.eml#broken.xlsx"] and "XLSX" in failures["mail.eml#broken.xlsx"]


def test_rtf_text(tmp_path):
    (tmp_path / "notes.rtf").write_bytes(RTF)
    documents, failures = run(tmp_path)
    assert failures == {}
    assert documents["notes.rtf"].text == "Survey notes.\nThe radar worked well."


@pytest.mark.parametrize("name, data, reason", [
    ("bad.docx", b"PK\x03\x04 truncated zip", "unreadable DOCX"),
    ("bad.pptx", b"not a zip at all", "unreadable PPTX"),
    ("bad.xlsx", b"not a zip at all", "unreadable XLSX"),
    ("bad.odt", b"not a zip at all", "unreadable ODT"),
    ("bad.epub", b"not a zip at all", "unreadable EPUB"),
    ("bad.eml", b"\x00\x01\x02 binary junk without headers", "not an e-mail message"),
    ("bad.rtf", b"plain words, no rtf header", "not an RTF file"),
    ("bad.pdf", b"%PDF-1.4 this is not really a pdf", "unreadable PDF"),
])
def test_a_corrupt_file_fails_alone_with_its_reason(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    (tmp_path / "good.rtf").write_bytes(RTF)
    documents, failures = run(tmp_path)
    assert list(documents) == ["good.rtf"]
    assert list(failures) == [name] and failures[name].startswith(reason), failures
