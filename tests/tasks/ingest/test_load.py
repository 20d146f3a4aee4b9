"""Unit tests for the ``load`` stage: formats, JSONL records, discovery, and per-file failures."""
from __future__ import annotations

import fnmatch
import io
import json
import os
import posixpath
from pathlib import Path

import pytest
from pydantic import ValidationError
from pypdf import PdfReader, PdfWriter

from ragline.flows.context import StepContext
from ragline.flows.contracts import Coverage, Failure, content_hash
from ragline.tasks.ingest.load import Params, SourceRoot, load
from ragline.tasks.ingest.load.walk import _matches
from tests.helpers.documents import make_pdf


def run(paths: list[str | Path], **options) -> tuple[list, StepContext]:
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=Params(paths=[str(p) for p in paths], **options), ctx=ctx)
    return documents, ctx


def failures(ctx: StepContext) -> dict[str, str]:
    return {f.source_id: f.reason for f in ctx.failures}


def posix(path: Path) -> str:
    return path.resolve().as_posix()


def sid(root: Path, below: str = "") -> str:
    """The source id of a file below ``root``, a root outside the project (named by its folder)."""
    return f"{root.name}/{below}" if below else root.name


def test_stage_contract():
    assert (load.name, load.produces, load.kind) == ("load", "documents", "ingestion")
    assert load.inputs == {}
    with pytest.raises(ValidationError):
        Params(paths=["x"], unknown=1)
    with pytest.raises(ValidationError):
        Params(paths=["x"], encoding="no-such-codec")
    with pytest.raises(ValidationError):
        Params(paths=["x"], encoding="base64")  # a codec, but not a text encoding
    with pytest.raises(ValidationError):
        Params(paths=[])


def test_text_markdown_and_html_files(tmp_path):
    (tmp_path / "notes.txt").write_text("Plain notes.\nSecond line.\n")
    (tmp_path / "guide.md").write_text("```sh\n# not a title\n```\nintro\n\n# Install Guide #\n\nSteps.\n")
    (tmp_path / "page.html").write_text("<html><head><title> Home &amp; Away </title></head>"
                                        "<body><h1>Other</h1><p>Body</p></body></html>")
    (tmp_path / "noheading.md").write_text("just text\n")
    (tmp_path / "h1only.htm").write_text("<body><h1 class='x'>Big <b>Heading</b></h1></body>")

    documents, ctx = run([tmp_path])

    assert ctx.failures == []
    by_name = {Path(d.path).name: d for d in documents}
    notes = by_name["notes.txt"]
    assert notes.source_id == notes.path == sid(tmp_path, "notes.txt")  # never the server's absolute path
    assert (notes.format, notes.title, notes.text) == ("text", "notes", "Plain notes.\nSecond line.\n")
    assert notes.content_hash == content_hash("Plain notes.\nSecond line.\n")
    assert notes.modified == os.stat(tmp_path / "notes.txt").st_mtime
    assert notes.metadata == {"source": notes.path, "format": "text", "modified": notes.modified,
                              "file_name": "notes.txt", "root": tmp_path.name, "ragline_acl_public": True}
    assert (by_name["guide.md"].format, by_name["guide.md"].title) == ("markdown", "Install Guide")
    assert by_name["noheading.md"].title == "noheading"
    page = by_name["page.html"]
    assert (page.format, page.title) == ("html", "Home & Away")
    assert page.text.startswith("<html><head><title>")  # raw HTML: convert does the extraction
    assert by_name["h1only.htm"].title == "Big Heading"


def test_pdf_text_and_title(tmp_path):
    (tmp_path / "report.pdf").write_bytes(make_pdf(["First page text", "", "Third page text"], title="Annual Report"))
    (tmp_path / "untitled.pdf").write_bytes(make_pdf(["Only page"]))

    documents, ctx = run([tmp_path])

    assert ctx.failures == []
    report, untitled = documents
    assert (report.format, report.title) == ("pdf", "Annual Report")
    assert report.text == "First page text\n\nThird page text"
    assert report.content_hash == content_hash(report.text)
    assert report.metadata["format"] == "pdf"
    assert (untitled.title, untitled.text) == ("untitled", "Only page")


def test_bad_pdfs_are_reported_and_skipped(tmp_path):
    (tmp_path / "garbage.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (tmp_path / "blank.pdf").write_bytes(make_pdf([""]))
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(make_pdf(["secret text"]))))
    writer.encrypt(user_password="pw", algorithm="RC4-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    (tmp_path / "locked.pdf").write_bytes(buffer.getvalue())
    (tmp_path / "good.pdf").write_bytes(make_pdf(["fine"]))

    documents, ctx = run([tmp_path])

    assert [d.text for d in documents] == ["fine"]
    reasons = failures(ctx)
    assert reasons[sid(tmp_path, "garbage.pdf")].startswith("unreadable PDF")
    assert "no extractable text" in reasons[sid(tmp_path, "blank.pdf")]
    assert "password" in reasons[sid(tmp_path, "locked.pdf")]


def test_jsonl_records_and_bad_lines(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"_id": "d1", "title": "One", "text": "first text", "abstract": "more",
                    "metadata": {"year": 2020, "lang": "en", "tags": ["a"], "source": "spoof", "ok": True}}),
        "",
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"text": "no id"}),
        json.dumps({"_id": 7, "text": "seven\u2028with a line separator"}),
        json.dumps({"_id": "d1", "text": "duplicate"}),
        json.dumps({"_id": "d3", "title": "only title", "text": ""}),
    ]
    corpus.write_text("\n".join(lines) + "\n")
    path = "corpus.jsonl"  # a file root is named by the file

    documents, ctx = run([corpus], jsonl_text_fields=["text", "abstract"])

    assert [d.source_id for d in documents] == [f"{path}#7", f"{path}#d1"]
    seven, first = documents
    assert (first.title, first.text, first.format) == ("One", "first text\n\nmore", "jsonl")
    assert first.metadata == {"source": path, "format": "jsonl", "doc_id": "d1", "root": "corpus.jsonl",
                              "file_name": "corpus.jsonl", "year": 2020, "lang": "en", "ok": True, "ragline_acl_public": True}
    assert (seven.title, seven.text, seven.metadata["doc_id"]) == ("", "seven\u2028with a line separator", "7")
    reasons = failures(ctx)
    assert set(reasons) == {f"{path}:3", f"{path}:4", f"{path}:5", f"{path}:7", f"{path}:8"}
    assert reasons[f"{path}:3"].startswith("invalid JSON")
    assert "not an object" in reasons[f"{path}:4"]
    assert "'_id'" in reasons[f"{path}:5"]
    assert reasons[f"{path}:7"] == "duplicate record id 'd1', first seen on line 1"
    assert reasons[f"{path}:8"].startswith("empty document")


def test_jsonl_custom_fields_and_record_hash(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "name": "Alpha", "body": "alpha body"}) + "\n")
    params = {"jsonl_id_field": "id", "jsonl_text_fields": ["body"], "jsonl_title_field": "name"}

    (doc,), _ = run([corpus], **params)
    corpus.write_text(json.dumps({"body": "alpha body", "name": "Alpha", "id": "a"}) + "\n")  # same, reordered
    (same,), _ = run([corpus], **params)
    corpus.write_text(json.dumps({"id": "a", "name": "Alpha v2", "body": "alpha body"}) + "\n")
    (retitled,), _ = run([corpus], **params)

    assert (doc.source_id, doc.title, doc.text) == ("c.jsonl#a", "Alpha", "alpha body")
    assert same.content_hash == doc.content_hash
    assert retitled.content_hash != doc.content_hash


def test_folders_are_walked_recursively_with_include_filter(tmp_path):
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "top.md").write_text("# Top\n")
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("deep")
    (tmp_path / "a" / "UPPER.TXT").write_text("upper")
    (tmp_path / "a" / "script.py").write_text("print('not included')")

    documents, ctx = run([tmp_path])

    assert [d.path for d in documents] == [sid(tmp_path, p) for p in ["a/UPPER.TXT", "a/b/c/deep.txt", "top.md"]]
    assert ctx.failures == []


def test_globs_exclude_and_duplicates(tmp_path):
    (tmp_path / "docs" / "drafts").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    (tmp_path / "docs" / "one.md").write_text("one")
    (tmp_path / "docs" / "two.txt").write_text("two")
    (tmp_path / "docs" / "drafts" / "wip.md").write_text("wip")
    (tmp_path / ".git" / "notes.md").write_text("git internals")
    (tmp_path / "data.bin").write_text("not included by default")

    globbed, ctx = run([f"{tmp_path}/docs/**/*.md", f"{tmp_path}/docs/*", tmp_path / "docs" / "one.md"],
                       exclude=["drafts/*"])
    walked, _ = run([tmp_path], exclude=["**/.git/**"])
    explicit, _ = run([tmp_path / "data.bin"])

    assert [Path(d.path).name for d in globbed] == ["one.md", "two.txt"]
    assert ctx.failures == []
    assert [d.path for d in walked] == [sid(tmp_path, p) for p in ["docs/drafts/wip.md", "docs/one.md", "docs/two.txt"]]
    assert [d.text for d in explicit] == ["not included by default"]  # a file named directly skips `include`


def test_missing_roots_fail_and_an_empty_glob_does_not(tmp_path):
    (tmp_path / "ok.txt").write_text("ok")
    missing = posix(tmp_path / "nope")

    documents, ctx = run([tmp_path / "ok.txt", missing, f"{tmp_path}/*.nothing", f"{tmp_path}/gone/*.md"])

    assert [d.text for d in documents] == ["ok"]
    assert {f.source_id: f.root for f in ctx.failures} == {"nope": True, "gone/*.md": True}
    assert "no such file or directory" in failures(ctx)["nope"]
    # a pattern whose folder exists but matches nothing is listed completely: it covers its matches
    assert {(c.kind, c.path) for c in ctx.covered} == {("file", "ok.txt"), ("glob", f"{tmp_path.name}/*.nothing")}


def test_coverage_says_which_indexed_sources_may_be_deleted(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("a")

    _, ctx = run([tmp_path / "docs"])
    folder = ctx.covered[0]

    assert folder.covers("docs/gone.md") and folder.covers("docs/sub/c.jsonl#17")
    assert not folder.covers("docs2/x.md")
    glob_cover = Coverage(kind="glob", path="/data/notes/**/*.md")
    assert glob_cover.covers("/data/notes/a.md") and glob_cover.covers("/data/notes/x/y/b.md")
    assert not glob_cover.covers("/data/notes/a.txt") and not glob_cover.covers("/data/other/a.md")
    star = Coverage(kind="glob", path="/data/*.md")
    assert star.covers("/data/a.md") and not star.covers("/data/sub/a.md")


def test_failures_protect_what_was_indexed_from_their_path():
    folder = Failure(source_id="/d/sub", stage="load", reason="cannot list folder")
    jsonl = Failure(source_id="/d/c.jsonl", stage="load", reason="not valid utf-8")
    line = Failure(source_id="/d/c.jsonl:7", stage="load", reason="invalid JSON")

    assert folder.protects("/d/sub/x.md") and not folder.protects("/d/subway.md")
    assert jsonl.protects("/d/c.jsonl#1") and jsonl.protects("/d/c.jsonl")
    assert line.protects("/d/c.jsonl#42") and not line.protects("/d/other.jsonl#42")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder")
def test_unreadable_subfolder_is_reported_not_silently_skipped(tmp_path):
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "secret.md").write_text("s")
    (tmp_path / "ok.md").write_text("ok")
    (tmp_path / "locked").chmod(0)
    try:
        documents, ctx = run([tmp_path])
    finally:
        (tmp_path / "locked").chmod(0o755)

    assert [d.text for d in documents] == ["ok"]
    assert [f.source_id for f in ctx.failures] == [sid(tmp_path, "locked")]
    assert ctx.failures[0].protects(sid(tmp_path, "locked/secret.md"))


def test_unreadable_subfolder_reported_via_walk_errors(tmp_path, monkeypatch):
    """The same as above for root, who can read anything: the walk's error callback is the contract."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "ok.md").write_text("ok")
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path).name == "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    documents, ctx = run([tmp_path])

    assert [d.text for d in documents] == ["ok"]
    assert failures(ctx) == {sid(tmp_path, "sub"): "cannot list folder: Permission denied"}
    assert ctx.covered[0].kind == "folder"


def test_named_pipe_is_skipped_with_a_reason(tmp_path):
    (tmp_path / "ok.txt").write_text("ok")
    os.mkfifo(tmp_path / "pipe.txt")

    documents, ctx = run([tmp_path])

    assert [d.text for d in documents] == ["ok"]
    assert failures(ctx) == {sid(tmp_path, "pipe.txt"): "not a regular file (named pipe)"}


def test_empty_binary_undecodable_and_oversized_files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.md").write_text("  \n\t\n  ")
    (tmp_path / "binary.txt").write_bytes(b"abc\x00\x01\x02def")
    (tmp_path / "latin.txt").write_bytes(b"abc\xff\xfe\xfa")
    (tmp_path / "big.txt").write_text("x" * 200)
    (tmp_path / "fine.txt").write_text("fine")

    documents, ctx = run([tmp_path], max_bytes=100)

    assert [d.text for d in documents] == ["fine"]
    reasons = failures(ctx)
    assert reasons[sid(tmp_path, "empty.txt")] == "empty document"
    assert reasons[sid(tmp_path, "blank.md")] == "empty document"
    assert reasons[sid(tmp_path, "binary.txt")] == "binary content, not text"
    assert reasons[sid(tmp_path, "latin.txt")] == "not valid utf-8: cannot decode byte 0xff at offset 3"
    assert reasons[sid(tmp_path, "big.txt")] == "file is 200 bytes, over the max_bytes limit of 100"
    assert len(reasons) == 5


def test_configured_encoding(tmp_path):
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "wide.txt").write_bytes("\ufeffwide text".encode("utf-16-le"))

    (latin,), _ = run([tmp_path / "latin.txt"], encoding="latin-1")
    (wide,), ctx = run([tmp_path / "wide.txt"], encoding="utf-16-le")

    assert latin.text == "café"
    assert wide.text == "wide text" and ctx.failures == []


def test_order_hash_and_progress_are_deterministic(tmp_path):
    for name in ["b.txt", "a.md", "c.html", "sub/z.txt", "sub/0.md"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"content of {name}")
    counted: list[tuple[str, int]] = []
    ctx = StepContext(pipeline="t", step_id="load", on_progress=lambda unit, n: counted.append((unit, n)))

    first = load.fn(params=Params(paths=[str(tmp_path)]), ctx=ctx)
    second, _ = run([tmp_path / "sub", tmp_path])

    assert [d.source_id for d in first] == sorted(d.source_id for d in first)
    assert [d.model_dump() for d in first] == [d.model_dump() for d in second]
    assert [d.content_hash for d in first] == [content_hash(d.text) for d in first]
    assert len({d.content_hash for d in first}) == 5
    assert counted == [("documents", 1)] * 5


# --- issue 16 items 8 and 9, issue 15 item 4: links out of the roots, spoofed links, server paths ----

def test_file_links_out_of_every_root_are_skipped_with_a_reason(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.md").write_text("the secret")
    (tmp_path / "passwd").write_text("root:x:0:0")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "ok.md").write_text("fine")
    (docs / "passwd.txt").symlink_to(tmp_path / "passwd")
    (docs / "secret.md").symlink_to("../outside/secret.md")
    (docs / "sub" / "alias.md").symlink_to("../ok.md")  # a link that stays inside the root is fine
    (docs / "outdir").symlink_to(tmp_path / "outside", target_is_directory=True)

    for paths in ([docs], [f"{docs}/**/*"], [f"{docs}/*.txt", f"{docs}/*.md"]):
        documents, ctx = run(paths)
        texts = sorted(d.text for d in documents)
        assert "root:x:0:0" not in texts and "the secret" not in texts and "fine" in texts, paths
        skipped = {f.source_id: f for f in ctx.failures}
        assert {"docs/passwd.txt", "docs/secret.md"} <= set(skipped), paths
        assert all(f.skipped and not f.protects(f.source_id) for f in skipped.values())
        assert "outside every source root" in skipped["docs/secret.md"].reason
    named = [tmp_path / "passwd"]  # a file named directly is a root of its own
    assert [d.text for d in run(named)[0]] == ["root:x:0:0"]


def test_follow_links_per_root_or_per_step_indexes_them(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.md").write_text("the secret")
    (tmp_path / "outside" / "loop").symlink_to(tmp_path / "outside", target_is_directory=True)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "secret.md").symlink_to("../outside/secret.md")
    (docs / "outdir").symlink_to(tmp_path / "outside", target_is_directory=True)

    ctx = StepContext(pipeline="t", step_id="load")
    per_root = load.fn(params=Params(paths=[{"path": str(docs), "follow_links": True}]), ctx=ctx)
    assert sorted(d.source_id for d in per_root) == ["docs/outdir/secret.md", "docs/secret.md"] and not ctx.failures
    per_step, ctx = run([docs], follow_links=True)
    assert len(per_step) == 2 and not ctx.failures  # the link loop is walked once


# --- issue 39 item 4: hard links --------------------------------------------------------------

def test_files_with_more_than_one_hard_link_are_skipped_with_a_reason(tmp_path):
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "secret.md").write_text("the salaries")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "ok.md").write_text("fine")
    os.link(tmp_path / "srv" / "secret.md", docs / "hard.md")  # `ln /srv/secret.md docs/hard.md`
    os.link(docs / "ok.md", docs / "sub" / "twin.md")  # both names inside the root: the count is all one sees
    (docs / "soft.md").symlink_to(docs / "hard.md")  # a symbolic link inside the root, to the hard link

    everything = {"docs/hard.md", "docs/ok.md", "docs/soft.md", "docs/sub/twin.md"}
    for paths, expected in (([docs], everything), ([f"{docs}/**/*"], everything),
                            ([f"{docs}/*.md"], everything - {"docs/sub/twin.md"})):
        documents, ctx = run(paths)
        assert [d.text for d in documents] == [], paths
        skipped = {f.source_id: f for f in ctx.failures}
        assert set(skipped) == expected, paths
        assert all(f.skipped and not f.protects(f.source_id) for f in skipped.values())
        assert "2 hard links" in skipped["docs/hard.md"].reason and "hard_links: true" in skipped["docs/hard.md"].reason
    assert [d.text for d in run([tmp_path / "srv" / "secret.md"])[0]] == ["the salaries"]  # named directly


def test_hard_links_per_root_or_per_step_are_indexed_when_allowed(tmp_path):
    (tmp_path / "secret.md").write_text("the salaries")
    docs = tmp_path / "docs"
    docs.mkdir()
    os.link(tmp_path / "secret.md", docs / "hard.md")
    ctx = StepContext(pipeline="t", step_id="load")
    per_root = load.fn(params=Params(paths=[{"path": str(docs), "hard_links": True}]), ctx=ctx)
    assert [d.text for d in per_root] == ["the salaries"] and not ctx.failures
    per_step, ctx = run([docs], hard_links=True)
    assert [d.text for d in per_step] == ["the salaries"] and not ctx.failures
    ctx = StepContext(pipeline="t", step_id="load")
    assert load.fn(params=Params(paths=[{"path": str(docs), "hard_links": False}], hard_links=True), ctx=ctx) == []
    assert [f.source_id for f in ctx.failures] == ["docs/hard.md"]  # the root's own word wins


def test_a_local_folder_read_through_fsspec_skips_hard_links_too(tmp_path):
    (tmp_path / "secret.md").write_text("the salaries")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.md").write_text("fine")
    os.link(tmp_path / "secret.md", docs / "hard.md")
    root = {"type": "fsspec", "url": f"file://{posix(docs)}", "name": "docs"}
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    assert [d.text for d in load.fn(params=Params(paths=[root]), ctx=ctx)] == ["fine"]
    assert [(f.source_id, f.skipped) for f in ctx.failures] == [("docs/hard.md", True)]
    assert "2 hard links" in ctx.failures[0].reason
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    allowed = load.fn(params=Params(paths=[{**root, "hard_links": True}]), ctx=ctx)
    assert sorted(d.text for d in allowed) == ["fine", "the salaries"] and not ctx.failures


def test_jsonl_metadata_cannot_set_where_a_record_comes_from_or_links_to(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"_id": "a", "text": "t", "metadata": {
        "path": "https://evil.example/phish", "url": "https://evil.example/x", "source": "https://evil.example/y",
        "root": "evil", "lang": "en"}}) + "\n")
    ctx = StepContext(pipeline="t", step_id="load")
    (doc,) = load.fn(params=Params(paths=[{"path": str(tmp_path), "name": "corpus",
                                           "url_prefix": "https://wiki.example.com/base"}]), ctx=ctx)
    assert doc.source_id == "corpus/c.jsonl#a" and doc.path == "https://wiki.example.com/base/c.jsonl"
    assert doc.metadata == {"source": "https://wiki.example.com/base/c.jsonl", "url": "https://wiki.example.com/base/c.jsonl",
                            "root": "corpus", "file_name": "c.jsonl", "format": "jsonl", "doc_id": "a", "lang": "en",
                                "ragline_acl_public": True}
    (plain,), _ = run([tmp_path / "c.jsonl"])
    assert "url" not in plain.metadata and "path" not in plain.metadata and "evil" not in json.dumps(plain.metadata)


def test_ids_are_relative_to_the_pipelines_folder_and_never_absolute(tmp_path):
    (tmp_path / "proj" / "docs" / "a").mkdir(parents=True)
    (tmp_path / "proj" / "docs" / "a" / "x.md").write_text("x")
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "y.md").write_text("y")
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path / "proj"))
    documents = load.fn(params=Params(paths=["docs", "../wiki", str(tmp_path / "proj" / "docs" / "a" / "x.md"),
                                             "docs/**/*.md"]), ctx=ctx)
    assert [(d.source_id, d.path) for d in documents] == [("docs/a/x.md", "docs/a/x.md"), ("wiki/y.md", "wiki/y.md")]
    assert str(tmp_path) not in json.dumps([d.model_dump() for d in documents] +
                                           [f.model_dump() for f in ctx.failures] + [c.model_dump() for c in ctx.covered])
    with pytest.raises(ValidationError, match="root name"):
        Params(paths=[{"path": "docs", "name": "../up"}])
    with pytest.raises(ValidationError, match="url_prefix"):
        Params(paths=[{"path": "docs", "url_prefix": "javascript:alert(1)"}])


def test_two_roots_that_would_share_a_name_are_a_clear_root_failure(tmp_path):
    for side in ("a", "b"):
        (tmp_path / side / "docs").mkdir(parents=True)
        (tmp_path / side / "docs" / "x.md").write_text(side)
    documents, ctx = run([tmp_path / "a" / "docs", tmp_path / "b" / "docs"])
    assert [d.text for d in documents] == ["a"]
    assert [f.root for f in ctx.failures] == [True] and "give one of them a `name`" in ctx.failures[0].reason


@pytest.mark.parametrize(("location", "path"), [
    ("/a/b", "/a/b/c.md"), ("/a/b", "/a/b/x/y/z.md"), ("/a/b", "/a/b/.hidden"), ("/a/b", "/a/b/x/../y.md"),
    ("/", "/etc/x"), ("/a/b/", "/a/b/c"), ("/a/b", "/a/bc/d"), ("/a/b", "/a/b"), ("/a/b", "/a/b/c/"),
    ("/a/b", "/a/b//c")])
def test_a_path_below_a_root_is_what_relpath_says(location, path):
    """The listing's fast path (a prefix cut) gives relpath's answer, including paths it must not cut."""
    assert SourceRoot(given="x", location=location, name="n").below(path) == posixpath.relpath(path, location)


@pytest.mark.parametrize("path", ["docs/Report.PDF", "a/drafts/x.md", "a/.git/", "notes.txt", "deep/a/b/c.md"])
def test_include_exclude_patterns_match_as_fnmatch_did(path):
    """One compiled expression per pattern list answers as fnmatch on the name, the path and its ends."""
    patterns = ["*.pdf", "drafts/*", "**/.git/**", "*.md", "a/*"]
    name, lower = path.rstrip("/").rsplit("/", 1)[-1].lower(), path.lower()
    for pattern in patterns:
        p = pattern.lower()
        expected = (fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(lower, p)
                    or fnmatch.fnmatchcase(lower, "*/" + p))
        assert _matches(path, [pattern]) == expected, pattern
    assert _matches(path, patterns) == any(_matches(path, [p]) for p in patterns)
    assert not _matches(path, [])


def test_jsonl_version_field_hashes_the_version_not_the_record(tmp_path):
    """With ``jsonl_version_field`` a record's content hash is its version's: an edit that keeps the
    version keeps the hash (the record's own change signal), a new version changes it, a record
    without the field is hashed whole, and a version that is no string or number is reported
    naming the field and its line."""
    corpus = tmp_path / "v.jsonl"
    rows = [{"_id": "a", "text": "alpha", "updated_at": "2024-01-01"}, {"_id": "b", "text": "beta"},
            {"_id": "c", "text": "gamma", "updated_at": {"at": 1}}, {"_id": "d", "text": "delta", "updated_at": 3}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, ctx = run([corpus], jsonl_version_field="updated_at")
    assert [d.source_id for d in first] == ["v.jsonl#a", "v.jsonl#b", "v.jsonl#d"]
    assert set(failures(ctx)) == {"v.jsonl:3"} and "'updated_at'" in failures(ctx)["v.jsonl:3"]
    rows[0]["text"], rows[1]["text"] = "alpha edited", "beta edited"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    edited, _ = run([corpus], jsonl_version_field="updated_at")
    assert edited[0].text == "alpha edited" and edited[0].content_hash == first[0].content_hash
    assert edited[1].content_hash != first[1].content_hash  # no version: its content is hashed
    rows[0]["updated_at"] = "2024-02-01"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bumped, _ = run([corpus], jsonl_version_field="updated_at")
    assert bumped[0].content_hash != first[0].content_hash
    plain, _ = run([corpus])
    assert plain[0].content_hash not in {d.content_hash for d in bumped}  # the option off: the record's hash


def test_jsonl_version_field_must_be_a_field_of_its_own(tmp_path):
    for clash, role in (("_id", "id field"), ("text", "a text field")):
        with pytest.raises(ValidationError, match=f"jsonl_version_field '{clash}' is the {role}"):
            Params(paths=[str(tmp_path)], jsonl_version_field=clash)


# --- issue 22: the listing's cost per unchanged file (scandir walk, suffix patterns, kept files) ----

def _os_walk_listing(folder: Path, follow: bool, include: list[str], exclude: list[str]) -> list[str]:
    """What the listing found with os.walk before it kept scandir's entries: the reference."""
    seen, out = {os.path.realpath(folder)}, []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=follow):
        dirnames[:] = sorted(d for d in dirnames if not _matches(f"{dirpath}/{d}/", exclude))
        if follow:
            kept = []
            for d in dirnames:
                real = os.path.realpath(os.path.join(dirpath, d))
                if real not in seen:
                    seen.add(real)
                    kept.append(d)
            dirnames[:] = kept
        out += [f"{dirpath}/{n}" for n in sorted(filenames)
                if _matches(f"{dirpath}/{n}", include) and not _matches(f"{dirpath}/{n}", exclude)]
    return out


@pytest.mark.parametrize("follow", [False, True])
def test_the_walk_lists_the_files_os_walk_listed(tmp_path, follow):
    """Nested, excluded, hidden and non-ASCII folders, file and folder links (inside, outside, a loop,
    broken): the scandir walk finds the files os.walk did, in the same order, and says which are links."""
    docs, outside = tmp_path / "docs", tmp_path / "outside"
    for folder in ("a/b/c", ".hidden", "drafts/x", "Ünï cödé", "node_modules/m"):
        (docs / folder).mkdir(parents=True)
        (docs / folder / "f.md").write_text(folder)
        (docs / folder / "g.TXT").write_text(folder)
        (docs / folder / "skip.bin").write_text(folder)
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "o.md").write_text("outside")
    (docs / "link.md").symlink_to("a/b/c/f.md")
    (docs / "out.md").symlink_to(outside / "deep" / "o.md")
    (docs / "broken.md").symlink_to(tmp_path / "nowhere.md")
    (docs / "outdir").symlink_to(outside, target_is_directory=True)
    (docs / "a" / "loop").symlink_to(docs / "a", target_is_directory=True)
    include, exclude = ["*.md", "*.txt"], ["drafts/*", "**/node_modules/**"]
    root = SourceRoot(given=str(docs), location=docs.as_posix(), name="docs", follow_links=follow)
    ctx = StepContext(pipeline="t", step_id="load")
    from ragline.tasks.ingest.load.walk import _folder_files

    walked = list(_folder_files(docs.as_posix(), root, Params(paths=[str(docs)], include=include, exclude=exclude), ctx))
    assert [path for path, _ in walked] == _os_walk_listing(docs, follow, include, exclude)
    assert {posixpath.relpath(p, docs) for p, link in walked if link} == {"link.md", "out.md", "broken.md"}
    assert any("Ünï cödé" in p for p, _ in walked) and not any("drafts" in p or "node_modules" in p for p, _ in walked)
    assert any("/outdir/" in p for p, _ in walked) == follow and not ctx.failures


def test_walked_files_are_judged_links_by_their_entry_and_an_escaping_one_is_still_refused(tmp_path, monkeypatch):
    """No lstat per walked file (the directory entry's type says which is a link), and a file link out
    of every root is still skipped with its reason, one that stays inside still listed."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.md").write_text("the secret")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "ok.md").write_text("fine")
    (docs / "secret.md").symlink_to("../outside/secret.md")
    (docs / "sub" / "alias.md").symlink_to("../ok.md")
    real_islink = os.path.islink
    walked = set()

    def islink(path):
        walked.add(str(path))
        return real_islink(path)

    monkeypatch.setattr(os.path, "islink", islink)
    documents, ctx = run([docs])
    assert sorted(d.source_id for d in documents) == ["docs/ok.md", "docs/sub/alias.md"]
    assert {f.source_id for f in ctx.failures} == {"docs/secret.md"} and ctx.failures[0].skipped
    assert "outside every source root" in ctx.failures[0].reason
    assert not {p for p in walked if p.endswith(".md")}  # no file was lstat-ed to learn it is a link


def test_suffix_patterns_answer_as_the_compiled_expressions(tmp_path):
    """Patterns that are all '*<literal>' (the default include) are matched by suffix: the same answer
    as fnmatch's translation on names, paths and folder paths ('x.md/'), for random paths."""
    import random
    import re
    rng = random.Random(22)
    alpha = "aB./#\\x-"
    for _ in range(5_000):
        patterns = ["*" + "".join(rng.choice(alpha) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        path = "/" + "".join(rng.choice(alpha + "/") for _ in range(rng.randint(1, 12))) + rng.choice(["", "/"])
        lowered = [p.lower() for p in patterns]
        by_name = re.compile("|".join(fnmatch.translate(p) for p in lowered)).match
        by_path = re.compile("|".join(fnmatch.translate(q) for p in lowered for q in (p, "*/" + p))).match
        low = path.lower()
        expected = bool(by_name(low.rstrip("/").rsplit("/", 1)[-1]) or by_path(low))
        assert _matches(path, patterns) == expected, (path, patterns)
    assert _matches("/d/notes.MD/", ["*.md"]) and not _matches("/d/notes.md.bak", ["*.md"])


def test_an_unchanged_file_is_kept_as_ids_without_a_document_unless_its_access_changed(tmp_path):
    """``KnownItems.kept``: an unchanged file's sources come back as ids only; a changed rule, an
    unknown grant (a re-grant a crash interrupted) or groups recorded in another spelling are judged
    on the decoded groups; a file that failed last run, or has no signal, is read."""
    from ragline.flows.contracts import Document
    from ragline.flows.resources.stores.state import IndexState, StateSpec
    from ragline.tasks.ingest.load.known import KnownItems

    state = IndexState(StateSpec(type="index_state", path="s.sqlite"), base_dir=tmp_path)
    state.conn
    docs = [Document(source_id=s, text="", content_hash=f"h-{s}", signal="s1", groups=g)
            for s, g in (("kb/a.md", []), ("kb/hr/b.jsonl#1", ["hr"]), ("kb/hr/b.jsonl#2", ["hr"]),
                         ("kb/c.md", []), ("kb/d.md", ["x", "y"]))]
    state.record("t", "fp", docs, [])
    state.forget_access(["kb/c.md"])
    with state.transaction() as tx:
        tx.execute("UPDATE sources SET acl='[\"x\",\"y\"]' WHERE source_id='kb/d.md'")  # no space: another spelling
    known = KnownItems(state, "t", "fp", failed=("kb/e.md",))
    folder = (tmp_path / "kb").as_posix()
    rules = [{"prefix": "hr/", "groups": ["hr"]}, {"prefix": "d.md", "groups": ["y", "x"]}]
    params = Params(paths=[{"path": folder, "access": rules}])
    root = SourceRoot(given=folder, location=folder, name="kb", access=tuple(params.paths[0].access))
    items = ["kb/a.md", "kb/hr/b.jsonl", "kb/c.md", "kb/d.md", "kb/e.md"]
    same = known.unchanged_acls({i: "s1" for i in items})
    assert set(same) == {"kb/a.md", "kb/hr/b.jsonl", "kb/c.md", "kb/d.md"}

    def kept(item, signal="s1", params=params, root=root):
        return known.kept(same.get(item), signal, item, f"{folder}/{item[3:]}", root, params)

    assert (kept("kb/a.md").ids, kept("kb/a.md").regrant) == (["kb/a.md"], [])
    assert (kept("kb/hr/b.jsonl").ids, kept("kb/hr/b.jsonl").regrant) == (["kb/hr/b.jsonl#1", "kb/hr/b.jsonl#2"], [])
    assert kept("kb/d.md").regrant == []  # the same groups, recorded without spaces
    unknown = kept("kb/c.md")  # its grant was forgotten: re-granted with the root's groups
    assert [(d.source_id, d.groups, d.content_hash, d.signal) for d in unknown.regrant] == [
        ("kb/c.md", [], "h-kb/c.md", "s1")]
    assert kept("kb/a.md", signal=None) is None and kept("kb/e.md") is None
    moved = [{"prefix": "", "groups": ["eng"]}]  # every rule changed: each file's documents are re-granted
    params2 = Params(paths=[{"path": folder, "access": moved}])
    root2 = SourceRoot(given=folder, location=folder, name="kb", access=tuple(params2.paths[0].access))
    changed = kept("kb/hr/b.jsonl", params=params2, root=root2)
    assert [(d.source_id, d.groups) for d in changed.regrant] == [("kb/hr/b.jsonl#1", ["eng"]),
                                                                    ("kb/hr/b.jsonl#2", ["eng"])]
    own = Params(paths=[folder], acl_field="groups")  # groups of their own: kept while recorded, else read
    plain = SourceRoot(given=folder, location=folder, name="kb")
    assert kept("kb/hr/b.jsonl", params=own, root=plain).regrant == [] and kept("kb/c.md", params=own, root=plain) is None
    assert kept("kb/hr/b.jsonl", params=own, root=root) is None  # a rule matches too: only the content says whose
    state.close()


def test_the_folders_a_change_journal_may_list(tmp_path):
    """What `ragline serve` watches (tasks.load.watched_folders): folder roots whose source ids are
    exactly the ids below their name and whose every change a watch sees."""
    from ragline.tasks.ingest.load import watched_folders

    for name in ("docs", "docs/inner", "notes", "linked", "papers"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "one.md").write_text("x")

    def watched(*paths, **params):
        return [posixpath.relpath(p, tmp_path) for p in watched_folders(Params(paths=list(paths), **params),
                                                                            str(tmp_path))]

    assert watched("notes", "papers") == ["notes", "papers"]
    assert watched("notes", "docs", "docs/inner") == ["notes"]  # nested roots: listed in full
    assert watched("one.md", "papers/*.md", "notes") == ["notes"]  # a file and a glob: in full
    assert watched(".") == [] and watched(".", "notes") == []  # the project's folder (it holds notes too)
    assert watched("notes", {"path": "linked", "follow_links": True}) == ["notes"]
    assert watched("notes", follow_links=True) == []
    assert watched("notes", full_listing_hours=0) == []


def test_a_listing_streams_its_files_instead_of_collecting_them(tmp_path, monkeypatch):
    """A full listing of a large corpus must not hold a list of its files: the first file comes out
    of ``_discover`` before the walk has entered the other folders. Roots inside one another are
    collected first, so a file under both is listed once, under the outer root."""
    from ragline.tasks.ingest.load import roots as load_roots, walk

    for i in range(6):
        (tmp_path / "docs" / f"f{i}").mkdir(parents=True)
        (tmp_path / "docs" / f"f{i}" / "a.md").write_text(f"doc {i}")
    scanned = []
    real_scandir = os.scandir
    monkeypatch.setattr(walk.os, "scandir", lambda path: scanned.append(path) or real_scandir(path))
    params, ctx = Params(paths=[str(tmp_path / "docs")]), StepContext(pipeline="t", step_id="load")
    roots = load_roots._roots(params, ctx.base_dir)

    listing = walk._discover(params, ctx, roots)
    first = next(listing)
    assert first[0] == sid(tmp_path / "docs", "f0/a.md") and len(scanned) <= 3  # the root and f0, not f1..f5
    assert ctx.covered == []  # not before its walk ended
    assert [item for item, _, _ in listing] == [sid(tmp_path / "docs", f"f{i}/a.md") for i in range(1, 6)]
    assert ctx.covered == [Coverage(kind="folder", path=roots[0].covered)]

    nested = Params(paths=[str(tmp_path / "docs" / "f2"), str(tmp_path / "docs")])
    both = list(walk._discover(nested, ctx, load_roots._roots(nested, ctx.base_dir)))
    assert [item for item, _, _ in both] == [sid(tmp_path / "docs", f"f{i}/a.md") for i in range(6)]
