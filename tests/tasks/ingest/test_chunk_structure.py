"""Chunks follow a document's structure: headings bound them (small sections are packed together),
each chunk names its section path, and a Markdown table is never split mid-row."""
from __future__ import annotations

import io

import docx

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.chunk import Params
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params as LoadParams, load
from tests.helpers.chunking import prose, run



def test_a_large_section_starts_its_own_chunk_and_each_chunk_names_its_section(minilm):
    text = (f"# Intro\n\n{prose('ia', 2)}\n\n## Background\n\n{prose('bg', 40, 1)}\n\n# Methods\n\n{prose('me', 3, 2)}\n\n"
            f"## Sampling\n\n{prose('sa', 2, 3)}")
    chunks = run(Document(source_id="d", text=text, format="markdown"), minilm, size=64, overlap=8, prepend_title=False)

    for c in chunks:  # no chunk mixes the big section's text with another section's
        markers = {w for w in ("ia", "bg", "me", "sa") if f"{w} " in c.text}
        assert "bg" not in markers or markers <= {"bg", "ia"}, c.text
        assert "bg" not in markers or c.text.startswith("## Background") or markers == {"bg"}
    sections = [c.metadata["section"] for c in chunks]
    assert sections[0] == "Intro" and set(sections[1:-1]) == {"Intro > Background"}
    # Methods and its small subsection fit one chunk together: packed, named by where the chunk starts
    assert chunks[-1].text.startswith("# Methods") and "## Sampling" in chunks[-1].text
    assert sections[-1] == "Methods"
    assert all(not c.text.startswith(("ia ", "me ", "sa ")) for c in chunks)  # every chunk starts at a heading


def test_small_sections_are_packed_into_one_chunk(minilm):
    text = "# A\n\nAlpha is first.\n\n# B\n\nBeta is second.\n\n## C\n\nGamma is third."
    (only,) = run(Document(source_id="d", text=text, format="markdown"), minilm, size=128, prepend_title=False)
    assert only.text == text and only.metadata["section"] == "A"


def test_hash_lines_of_plain_text_are_not_headings(minilm):
    text = "# not a heading in a text file\n\n" + prose("tx", 20)
    chunks = run(Document(source_id="d", text=text, format="text"), minilm, size=64, overlap=0)
    assert all("section" not in c.metadata for c in chunks)


def test_a_table_in_a_word_file_is_never_split_mid_row(tmp_path, minilm):
    document = docx.Document()
    document.add_heading("Inventory", 1)
    document.add_paragraph(prose("in", 3))
    table = document.add_table(rows=0, cols=4)
    rows = [["Item", "Count", "Place", "Note"]] + [[f"item{n}", str(n * 7), f"shelf {n % 5}", prose("no", 1, n)]
                                                   for n in range(60)]
    for row in rows:
        for cell, value in zip(table.add_row().cells, row):
            cell.text = value
    buffer = io.BytesIO()
    document.save(buffer)
    (tmp_path / "inventory.docx").write_bytes(buffer.getvalue())
    ctx = StepContext(pipeline="t", step_id="load")
    documents = convert.fn(documents=load.fn(params=LoadParams(paths=[str(tmp_path)]), ctx=ctx),
                           params=ConvertParams(), ctx=ctx)

    chunks = run(documents[0], minilm, size=96, overlap=16)

    assert len(chunks) > 5
    table_lines = [line for c in chunks for line in c.text.split("\n") if line.startswith("|")]
    assert table_lines and all(line.endswith("|") and line.count("|") - line.count("\\|") == 5
                               for line in table_lines)
    for n in range(60):  # every row is whole in some chunk
        assert any(line.startswith(f"| item{n} |") for line in table_lines)
    assert {c.metadata["section"] for c in chunks} == {"Inventory"}


def test_prepend_section_starts_each_chunk_with_its_section_path_within_the_budget(minilm):
    text = f"# Guide\n\n{prose('ia', 2)}\n\n## Background\n\n{prose('bg', 40, 1)}\n\n### Early work\n\n{prose('ew', 3, 2)}"
    document = Document(source_id="d", text=text, format="markdown", title="Guide")
    plain = run(document, minilm, size=64, overlap=8)
    prefixed = run(document, minilm, size=64, overlap=8, prepend_section=True)
    background = [c for c in prefixed if c.metadata["section"] == "Guide > Background"]
    assert len(background) > 2
    for c in background:  # the title, then the path below it, then the piece (its heading not repeated)
        assert c.text.startswith("Guide\nBackground\n") or c.text.startswith("Guide\n## Background"), c.text
    assert not any(c.text.startswith("Guide\nBackground\n## Background") for c in prefixed)
    early = next(c for c in prefixed if c.metadata["section"].endswith("Early work"))
    assert early.text.startswith("Guide\nBackground\n### Early work"), early.text  # its parents: its heading opens it
    assert all(len(minilm.tokenizer(c.text, add_special_tokens=False)["input_ids"]) <= 64 for c in prefixed)
    assert [c.metadata for c in plain] != [] and all("Guide\nBackground\n" not in c.text for c in plain)
    # the default leaves the params (and so every existing index's fingerprint) as they were
    assert "prepend_section" not in Params().model_dump() and Params(prepend_section=True).model_dump()["prepend_section"]
