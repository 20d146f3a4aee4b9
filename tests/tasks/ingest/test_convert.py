"""Unit tests for the ``convert`` stage: HTML extraction, the short-page fallback, whitespace."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document, content_hash
from ragline.tasks.ingest.convert import Params, convert, tidy_whitespace
from ragline.tasks.ingest.load import Params as LoadParams, load

PARAGRAPH = ("This opening paragraph of the article talks about vector search, retrieval and ranking, "
             "and it is long enough for the extractor to treat it as the main content of the page.")
ARTICLE = f"""<!DOCTYPE html>
<html><head><title>Vector Search Notes</title>
<style>.banner {{ color: red }}</style>
<script>var tracking = "SCRIPT_SECRET";</script></head>
<body>
<nav><ul><li><a href="/">Home</a></li><li><a href="/about">NAV_ABOUT_LINK</a></li></ul></nav>
<article>
<h1>Vector Search</h1>
<p>{PARAGRAPH}</p>
<h2>Ranking Basics</h2>
<p>Rankers use snake_case [notes] and <code>re.sub(r'\\d+\\.', x)</code> to reorder the candidates that a retriever returned, using a slower but more precise model
that reads the query and the passage together before scoring them.</p>
<table><tr><th>Model</th><th>Score</th></tr><tr><td>TABLE_CELL_BM25</td><td>0.41</td></tr></table>
</article>
<footer><p>Copyright 2024 FOOTER_TEXT. All rights reserved.</p></footer>
<script>document.write("LATE_SCRIPT")</script>
</body></html>"""


def html_doc(raw: str, source_id: str = "/x/page.html", title: str = "") -> Document:
    return Document(source_id=source_id, path=source_id, text=raw, title=title, format="html",
                    content_hash=content_hash(raw), metadata={"source": source_id, "format": "html"})


def run(documents: list[Document], **options) -> tuple[list[Document], StepContext]:
    ctx = StepContext(pipeline="t", step_id="convert")
    return convert.fn(documents=documents, params=Params(**options), ctx=ctx), ctx


def test_stage_contract():
    assert (convert.name, convert.produces, convert.kind) == ("convert", "documents", "ingestion")
    assert set(convert.inputs) == {"documents"}
    with pytest.raises(ValidationError):
        Params(keep_heading=True)
    with pytest.raises(ValidationError):
        Params(min_chars=0)


def test_html_article_drops_boilerplate_and_keeps_headings():
    source = html_doc(ARTICLE)

    (doc,), ctx = run([source])

    assert ctx.failures == []
    lines = doc.text.splitlines()
    assert "# Vector Search" in lines
    assert "## Ranking Basics" in lines
    assert PARAGRAPH in lines
    assert "TABLE_CELL_BM25" in doc.text
    assert "snake_case [notes]" in doc.text  # trafilatura's markdown escapes are undone...
    assert "`re.sub(r'\\d+\\.', x)`" in doc.text  # ...but not inside code
    for boilerplate in ("SCRIPT_SECRET", "LATE_SCRIPT", "NAV_ABOUT_LINK", "FOOTER_TEXT", ".banner", "<p>"):
        assert boilerplate not in doc.text
    assert doc.title == "Vector Search Notes"  # from <title>, since the document had none
    assert doc.content_hash == content_hash(ARTICLE)  # still the raw content's hash
    assert (doc.source_id, doc.format, doc.metadata) == (source.source_id, "html", source.metadata)


def test_html_options_drop_headings_and_tables():
    (doc,), _ = run([html_doc(ARTICLE)], keep_headings=False, include_tables=False)

    assert "Vector Search" in doc.text.splitlines()
    assert not any(line.startswith("#") for line in doc.text.splitlines())
    assert "TABLE_CELL_BM25" not in doc.text
    assert PARAGRAPH in doc.text


def test_existing_title_is_kept():
    (doc,), _ = run([html_doc(ARTICLE, title="From Load")])

    assert doc.title == "From Load"


def test_short_page_uses_fallback_without_page_furniture():
    raw = ("<html><head><title>Tiny</title><script>track()</script></head><body>"
           "<header>SITE_HEADER</header><nav><a href='/'>MENU_LINK</a></nav>"
           "<h1>Hello</h1><p>A  tiny\n page.</p><p>Second <b>bit</b>.</p>"
           "<aside>SIDEBAR</aside><footer>FOOTER_TEXT</footer></body></html>")

    (doc,), ctx = run([html_doc(raw)])
    (plain,), _ = run([html_doc(raw)], keep_headings=False)

    assert ctx.failures == []
    assert doc.text == "# Hello\n\nA tiny page.\n\nSecond bit."
    assert plain.text == "Hello\n\nA tiny page.\n\nSecond bit."
    assert doc.title == "Tiny"


def test_html_without_text_is_dropped_and_reported():
    empty = html_doc("<html><head><title>Nothing</title><script>run()</script></head>"
                     "<body><div>  </div><img src='a.png'></body></html>", source_id="/x/empty.html")
    blank = html_doc("   ", source_id="/x/blank.html")
    keep = html_doc("<p>Some words.</p>", source_id="/x/keep.html")

    documents, ctx = run([empty, blank, keep])

    assert [d.source_id for d in documents] == ["/x/keep.html"]
    assert documents[0].text == "Some words."
    assert {f.source_id: f.reason for f in ctx.failures} == {
        "/x/empty.html": "no text after conversion", "/x/blank.html": "no text after conversion"}
    assert {f.stage for f in ctx.failures} == {"convert"}


def test_markdown_and_text_pass_through_with_tidy_whitespace():
    raw = "# Title\r\n\r\n\r\n\r\nSome   words\x00 here\x07.  \n\n- item\n    - nested   item\n\n\n\ttab\x0cnext"
    markdown = Document(source_id="/x/a.md", text=raw, format="markdown", title="Title", content_hash="h")
    text = Document(source_id="/x/a.txt", text=raw, format="text", content_hash="h")

    (md_doc, txt_doc), _ = run([markdown, text])
    (untouched,), _ = run([text], normalize_whitespace=False)

    expected = "# Title\n\nSome words here.\n\n- item\n    - nested item\n\n\ttab\nnext"
    assert md_doc.text == txt_doc.text == expected
    assert (md_doc.title, md_doc.content_hash, txt_doc.title) == ("Title", "h", "")
    assert untouched.text == raw


def test_min_chars_drops_short_documents():
    docs = [Document(source_id="/x/short.txt", text="tiny"), Document(source_id="/x/long.txt", text="long enough")]

    documents, ctx = run(docs, min_chars=5)

    assert [d.source_id for d in documents] == ["/x/long.txt"]
    assert ctx.failures[0].reason == "only 4 characters after conversion, min_chars is 5"


def test_inputs_are_not_mutated_and_output_is_deterministic():
    source = html_doc(ARTICLE)
    before = source.model_dump()
    progress: list[int] = []
    ctx = StepContext(pipeline="t", step_id="convert", on_progress=lambda unit, n: progress.append(n))

    (first,) = convert.fn(documents=[source], params=Params(), ctx=ctx)
    (second,), _ = run([source])
    first.metadata["extra"] = 1

    assert source.model_dump() == before
    assert first is not source
    assert first.text == second.text and first.content_hash == second.content_hash
    assert progress == [1]


def test_tidy_whitespace():
    assert tidy_whitespace("  a\u00a0\u00a0b  \n\n\n\n  c\u2028d\x85e\x1bf ") == "a b\n\n  c\nd\nef"
    assert tidy_whitespace("\n\n  \t \n") == ""


def test_load_then_convert_html_file(tmp_path):
    (tmp_path / "page.html").write_text(ARTICLE)
    load_ctx = StepContext(pipeline="t", step_id="load")
    loaded = load.fn(params=LoadParams(paths=[str(tmp_path)]), ctx=load_ctx)

    (doc,), ctx = run(loaded)

    assert doc.title == "Vector Search Notes"
    assert doc.text.startswith("# Vector Search\n")
    assert doc.content_hash == loaded[0].content_hash == content_hash(ARTICLE)


SCRIPT_ONLY = "<html><head><script>var x=1;</script></head><body></body></html>"


def deep(inner: str, levels: int = 10_000) -> str:
    return "<div>" * levels + inner + "</div>" * levels


def test_empty_batch():
    documents, ctx = run([])

    assert documents == [] and ctx.failures == []


def test_script_only_page_is_reported_as_having_no_text():
    documents, ctx = run([html_doc(SCRIPT_ONLY, source_id="/x/script.html")])

    assert documents == []
    assert [(f.source_id, f.reason) for f in ctx.failures] == [("/x/script.html", "no text after conversion")]


def test_deeply_nested_page_keeps_its_text():
    # libxml2 stops at 255 levels and silently drops the rest: the streaming fallback reads it all
    (doc,), ctx = run([html_doc(deep("deep text here"))])

    assert ctx.failures == []
    assert doc.text == "deep text here"


def test_deep_page_fallback_keeps_structure_and_drops_scripts():
    raw = ("<html><head><title>Deep  Page</title><style>.a {}</style></head><body><h1>Top &amp; tail</h1><h2></h2>"
           + deep("<p>one<br>two<br/>three</p><table><tr><td>c1</td><td>c2</td></tr></table><script>SECRET()</script>"
                  "<noscript>NOSCRIPT</noscript>tail text", 5_000) + "</body></html>")

    (doc,), ctx = run([html_doc(raw)])
    (plain,), _ = run([html_doc(raw)], keep_headings=False, include_tables=False)

    assert ctx.failures == []
    assert doc.text == "# Top & tail\n\none\ntwo\nthree\n\nc1 c2\n\ntail text"
    assert doc.title == "Deep Page"
    assert plain.text == "Top & tail\n\none\ntwo\nthree\ntail text"


def test_deep_page_without_text_says_why():
    documents, ctx = run([html_doc(deep("<script>var x = 1;</script>"), source_id="/x/deep.html")])

    assert documents == []
    [failure] = ctx.failures
    assert failure.reason.startswith("no text after conversion (read with the fallback parser; lxml: ")
    assert "depth" in failure.reason


def test_no_recursion_error_escapes(monkeypatch):
    import ragline.tasks.ingest.convert as module

    def explode(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(module, "_tree_text", explode)
    (doc,), ctx = run([html_doc("<p>Shallow words.</p>")])

    assert ctx.failures == [] and doc.text == "Shallow words."


def test_page_neither_parser_can_read_is_reported_as_a_parse_failure(monkeypatch):
    import ragline.tasks.ingest.convert as module

    def broken(self, data):
        raise AssertionError("unknown status keyword")

    monkeypatch.setattr(module._TextCollector, "feed", broken)
    documents, ctx = run([html_doc(deep("words"), source_id="/x/broken.html")])

    assert documents == []
    [failure] = ctx.failures
    assert failure.reason.startswith("HTML could not be parsed: Excessive depth")
    assert "AssertionError: unknown status keyword" in failure.reason


def test_svg_title_is_not_the_page_title():
    raw = ("<html><head><title>Page</title></head><body><svg><title>Icon</title><text>ICON_TEXT</text></svg>"
           + deep("<h2>Deep heading</h2><p>Body.</p>", 3_000) + "</body></html>")

    (doc,), _ = run([html_doc(raw)])

    assert (doc.title, doc.text) == ("Page", "## Deep heading\n\nBody.")


def test_a_table_going_on_at_the_next_page_stays_one_table_and_pages_stay_exact():
    from ragline.tasks.ingest.convert import tidy_pages
    text = "Intro  text.\n\n| A | B |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nAfter."
    pages = [0, text.index("| 3 |"), text.index("After")]
    tidied, starts = tidy_pages(text, pages)
    assert tidied == "Intro text.\n\n| A | B |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nAfter."
    assert [tidied[s:s + 5] for s in starts] == ["Intro", "| 3 |", "After"]
