"""Chunks keep a table whole or repeat its header (issue 35.2): a table longer than a chunk is split
between rows, every piece after the first opening with the header row again; table chunks carry
``table: true`` and their caption; pages stay exact. End to end on a generated PDF report (a 75-row
table over three pages, running header and footer), and on Markdown."""
from __future__ import annotations

import functools
import io

import pytest
from pypdf import PdfReader

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params as LoadParams, load
from tests.helpers.chunking import prose as structure_prose, run
from tests.helpers.layout_pdfs import CAPTION, COLUMNS, FOOTER, HEADER, ROWS, table_report, two_column_report

HEAD = "| " + " | ".join(COLUMNS) + " |\n|---|---|---|---|"
WORDS = "depot parcel route van driver schedule warehouse freight".split()
prose = functools.partial(structure_prose, words=WORDS)  # the logistics report's vocabulary


def body(c) -> str:
    return c.text.split("\n", 1)[1] if c.title and c.text.startswith(c.title + "\n") else c.text


def test_a_pdf_table_is_chunked_by_rows_with_its_header_on_its_pages(tmp_path, minilm):
    data = table_report()
    (tmp_path / "review.pdf").write_bytes(data)
    (tmp_path / "fleet.pdf").write_bytes(two_column_report())
    ctx = StepContext(pipeline="t", step_id="load")
    documents = convert.fn(documents=load.fn(params=LoadParams(paths=[str(tmp_path)]), ctx=ctx),
                           params=ConvertParams(), ctx=ctx)
    assert ctx.failures == [] and {d.title for d in documents} == {"review", "fleet"}  # not "(anonymous)"

    chunks = run(next(d for d in documents if d.title == "review"), minilm, size=128, overlap=16)
    others = run(next(d for d in documents if d.title == "fleet"), minilm, size=128, overlap=16)

    for c in chunks + others:  # no running header or footer in any chunk
        assert "Quillfeather" not in c.text and "Confidential" not in c.text and HEADER not in c.text
        assert FOOTER not in c.text
        assert len(minilm.tokenizer(c.text, add_special_tokens=False)["input_ids"]) <= 128
    tables = [c for c in chunks if c.metadata.get("table")]
    assert len(tables) >= 6 and all(c.metadata["caption"] == CAPTION for c in tables)
    assert all(body(c).startswith(HEAD + "\n| Depot ") for c in tables)  # the header opens every piece
    assert not any(c.metadata.get("table") for c in chunks if "|" not in c.text)
    pages = [page.extract_text() for page in PdfReader(io.BytesIO(data)).pages]
    for row in ROWS:  # every row whole in a chunk that names the page the PDF prints it on
        line = "| " + " | ".join(row) + " |"
        holding = [c for c in tables if line in body(c).split("\n")]
        assert holding, row
        page = next(n for n, text in enumerate(pages, start=1) if row[0] + " " in text)
        assert all(c.metadata["page_start"] == c.metadata["page_end"] == page for c in holding), row
    for c in tables:  # only whole rows: a header, a rule or a row of four cells
        assert all(text.startswith("| ") and text.endswith(" |") and text.count(" | ") == 3
                   for text in body(c).split("\n") if text != "|---|---|---|---|")
    assert {c.metadata["page_start"] for c in tables} == {1, 2, 3}


def test_a_small_table_stays_whole_and_a_long_one_repeats_its_header(minilm):
    small = "| Van | Range |\n|---|---|\n" + "\n".join(f"| van{n} | {100 + n} km |" for n in range(4))
    long = HEAD + "\n" + "\n".join("| " + " | ".join(row) + " |" for row in ROWS[:30])
    text = (f"# Fleet\n\n{prose('fl', 12)}\n\nVans and their range\n\n{small}\n\n{prose('mi', 12, 1)}\n\n"
            f"## Depots\n\n{long}\n\n{prose('en', 4, 2)}")
    chunks = run(Document(source_id="d", text=text, format="markdown", title="Fleet"), minilm, size=96, overlap=8)

    holding = [c for c in chunks if "| van0 |" in c.text]
    assert len(holding) == 1 and all(f"| van{n} |" in holding[0].text for n in range(4))
    assert holding[0].metadata["table"] is True and holding[0].metadata["caption"] == "Vans and their range"
    depots = [c for c in chunks if "| Depot " in c.text]
    assert len(depots) >= 3
    for c in depots:  # no caption line before it: the section's heading names the table
        assert c.metadata["table"] is True and c.metadata["caption"] == "Depots"
        assert HEAD in c.text and c.text.count(HEAD) == 1
    assert all("table" not in c.metadata for c in chunks if "|" not in c.text)
    assert all(len(minilm.tokenizer(c.text, add_special_tokens=False)["input_ids"]) <= 96 for c in chunks)
    found = "\n".join(c.text for c in depots)
    assert all("| " + " | ".join(row) + " |" in found for row in ROWS[:30])


@pytest.mark.integration  # real ingestion: PDF, Chroma, BM25, the shipped ask_extractive
@pytest.mark.parametrize("question, column", [("How many vans does Depot 42 have?", 3),
                                              ("What is the on-time rate of Depot 42?", 2),
                                              ("How many parcels per day does Depot 57 handle?", 1)])
def test_a_question_on_a_pdf_table_is_answered_by_the_cell_of_its_row_and_column_citing_its_page(
        tmp_path, question, column):
    """Issue 35.3: the row the question names, the cell of the column it names, the page it is printed on."""
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project
    from tests.helpers.data import REPO

    data = table_report()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "review.pdf").write_bytes(data)
    (tmp_path / "prompts").symlink_to(REPO / "prompts")
    (tmp_path / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    project = load_project(tmp_path / "pipelines.yaml", tuned=False)
    engine.run(project.pipeline("index"), orchestrate=False)
    answer = engine.run(project.pipeline("ask_extractive"), {"query": question}, orchestrate=False)

    depot = next(w for w in question.split() if w.rstrip("?").isdigit()).rstrip("?")
    row = next(r for r in ROWS if r[0] == f"Depot {depot}")
    assert answer.answered_by == "evidence" and answer.evidence.value == row[column], answer.text
    pages = [page.extract_text() for page in PdfReader(io.BytesIO(data)).pages]
    page = next(n for n, text in enumerate(pages, start=1) if row[0] + " " in text)
    [source] = answer.sources
    assert (source.page_start, source.page_end) == (page, page) and source.source_id.endswith("review.pdf")
