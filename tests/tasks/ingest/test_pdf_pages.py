"""PDFs page by page: every chunk knows the pages its text is on, and never spans two pages."""
from __future__ import annotations

import io
import random
import re

from pypdf import PdfReader

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document, Passage, Source
from ragline.tasks.ingest.chunk import Params as ChunkParams, chunk
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params as LoadParams, load
from tests.helpers.layout_pdfs import real_pdf

WORDS = "protein membrane receptor pathway signal tumour cohort treatment antibody vaccine".split()


def page_text(page: int, sentences: int, rng: random.Random) -> str:
    """Sentences that each carry their page's marker (p7x), so a chunk's page can be checked word by word."""
    return " ".join(f"P{page}x {' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 12)))}."
                    for _ in range(sentences))


def chunks_of(path, minilm, **params):
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=LoadParams(paths=[str(path)]), ctx=ctx)
    documents = convert.fn(documents=documents, params=ConvertParams(), ctx=ctx)
    chunks = chunk.fn(documents=documents, params=ChunkParams(**params), ctx=StepContext(pipeline="t", step_id="c"),
                      embedder=minilm)
    return documents, chunks, ctx


def test_every_chunk_cites_the_page_its_text_is_on(tmp_path, minilm):
    rng = random.Random(3)
    # pages of very different lengths, one blank page (7) that keeps the numbering of the ones after it
    texts = [page_text(n, count, rng) if count else "" for n, count in
             enumerate([30, 3, 55, 12, 1, 40, 0, 20, 8], start=1)]
    (tmp_path / "report.pdf").write_bytes(real_pdf(texts))
    reader = PdfReader(io.BytesIO((tmp_path / "report.pdf").read_bytes()))
    assert len(reader.pages) == 9

    documents, chunks, ctx = chunks_of(tmp_path / "report.pdf", minilm, size=128, overlap=16)

    assert ctx.failures == []
    (document,) = documents
    assert len(document.pages) == 9 and document.metadata["pages"] == 9
    assert len(chunks) > 10
    for c in chunks:
        markers = {int(m) for m in re.findall(r"P(\d+)x", c.text)}
        assert markers, c.text
        start, end = c.metadata["page_start"], c.metadata["page_end"]
        assert markers == set(range(start, end + 1)) & markers and min(markers) == start and max(markers) == end
        body = c.text.split("\n", 1)[1]
        pages_text = " ".join(" ".join((reader.pages[n - 1].extract_text() or "").split())
                              for n in range(start, end + 1))
        assert " ".join(body.split()) in pages_text  # the text really is on the pages the chunk names
        assert start == end, f"chunk {c.ordinal} crosses pages {start}-{end}"  # every page here is long enough
    assert {c.metadata["page_start"] for c in chunks} == {1, 2, 3, 4, 5, 6, 8, 9}


def test_a_page_shorter_than_min_tokens_joins_the_page_before(minilm):
    text = "Alpha beta gamma delta epsilon zeta eta theta iota kappa.\n\n7\n\nLambda mu nu xi omicron pi rho sigma tau."
    pages = [0, text.index("7"), text.index("Lambda")]
    document = Document(source_id="d", text=text, format="pdf", pages=pages)

    chunks = chunk.fn(documents=[document], params=ChunkParams(size=20, overlap=0, min_tokens=4),
                      ctx=StepContext(pipeline="t", step_id="c"), embedder=minilm)

    assert [(c.metadata["page_start"], c.metadata["page_end"]) for c in chunks] == [(1, 2), (3, 3)]
    assert "7" in chunks[0].text and chunks[1].text.startswith("Lambda")


def test_sources_show_the_page_and_link_to_it():
    passage = Passage(chunk_id="c", source_id="docs/report.pdf", text="t", title="Report",
                      metadata={"source": "https://example.org/docs/report.pdf", "url": "https://example.org/docs/report.pdf",
                                "page_start": 12, "page_end": 12, "section": "Results > Cohort"})
    source = Source.of(3, passage)
    assert (source.page, source.url, source.section) == ("p. 12", "https://example.org/docs/report.pdf#page=12",
                                                         "Results > Cohort")
    assert source.model_dump(mode="json")["page"] == "p. 12"
    spread = Source.of(1, passage.model_copy(update={"metadata": {"page_start": 2, "page_end": 3}}))
    assert (spread.page, spread.url, spread.path) == ("pp. 2-3", "", "docs/report.pdf")
    assert Source.of(1, passage.model_copy(update={"metadata": {}})).page == ""
