"""Bad documents (issue 9): each is reported by path with its reason, the rest of the batch is
indexed, and nothing indexed before is lost. Unit cases run the load and convert stages on real
files; the last part runs a real incremental index (Chroma embedded, BM25, the state record) over a
corpus in which every earlier document turns bad at once."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from pypdf import PdfReader, PdfWriter

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params, load
from tests.helpers.data import index_and_search_yaml
from tests.helpers.documents import make_pdf
from tests.helpers.harness import snapshot

HUGE = 100_000_000  # bytes: over the default max_bytes (50 MB), written as a sparse file


def run_load(paths: list[str | Path], **options) -> tuple[dict[str, str], dict[str, str], StepContext]:
    """({path: text}, {path: failure reason}, ctx) of the load stage."""
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=Params(paths=[str(p) for p in paths], **options), ctx=ctx)
    return {d.source_id: d.text for d in documents}, {f.source_id: f.reason for f in ctx.failures}, ctx


def posix(path: Path) -> str:
    """The source id load gives a file of a root outside the project: '<root folder>/<name>'."""
    return f"{path.parent.name}/{path.name}"


def truncated_pdf(text: str) -> bytes:
    whole = make_pdf([text])
    return whole[: len(whole) // 2]


def encrypted_pdf(text: str) -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(make_pdf([text]))))
    writer.encrypt(user_password="secret", algorithm="AES-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def deep_html(inner: str, levels: int = 10_000) -> str:
    return "<html><body>" + "<div>" * levels + inner + "</div>" * levels + "</body></html>"


def unreadable_file(path: Path) -> None:
    """A file that exists, is regular, and cannot be read, even by root (who ignores chmod 000):
    a link to /proc/self/mem, whose read at offset 0 fails with EIO."""
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("no /proc/self/mem on this system")
    path.symlink_to("/proc/self/mem")


def sparse_file(path: Path, size: int) -> None:
    with open(path, "wb") as handle:
        handle.truncate(size)


# ----------------------------------------------------------------------------- the load stage
def test_a_100_mb_file_is_refused_by_its_size_without_being_read(tmp_path):
    sparse_file(tmp_path / "huge.txt", HUGE)  # all NUL bytes: read, it would be "binary content"
    (tmp_path / "ok.txt").write_text("fine")

    texts, reasons, _ = run_load([tmp_path])

    assert list(texts.values()) == ["fine"]
    assert reasons == {posix(tmp_path / "huge.txt"): f"file is {HUGE} bytes, over the max_bytes limit of 50000000"}


@pytest.mark.parametrize("name, reason", [("nuls.txt", "binary content, not text"),
                                          ("nuls.md", "binary content, not text"),
                                          ("nuls.jsonl", "binary content, not text"),
                                          ("nuls.pdf", "unreadable PDF: ")],
                         ids=["text", "markdown", "jsonl", "pdf"])
def test_a_file_full_of_nul_bytes_is_reported_by_path(tmp_path, name, reason):
    (tmp_path / name).write_bytes(b"\x00" * 1_000_000)
    (tmp_path / "ok.txt").write_text("fine")

    texts, reasons, _ = run_load([tmp_path])

    assert list(texts.values()) == ["fine"]
    assert list(reasons) == [posix(tmp_path / name)] and reasons[posix(tmp_path / name)].startswith(reason)


def test_nul_bytes_past_the_sniffed_start_do_not_reach_the_index(tmp_path):
    """A text file whose first 8 KB look like text loads; convert drops the stray NULs."""
    (tmp_path / "log.txt").write_bytes(b"words " * 2000 + b"\x00" * 500 + b" more words")

    texts, reasons, _ = run_load([tmp_path])
    ctx = StepContext(pipeline="t", step_id="convert")
    [document] = convert.fn(documents=[Document(source_id="x", text=next(iter(texts.values())))],
                            params=ConvertParams(), ctx=ctx)

    assert reasons == {} and "\x00" not in document.text and document.text.endswith("words more words")


def test_a_truncated_pdf_is_reported_by_path(tmp_path):
    (tmp_path / "cut.pdf").write_bytes(truncated_pdf("half of a report"))
    (tmp_path / "whole.pdf").write_bytes(make_pdf(["a whole report"]))

    texts, reasons, _ = run_load([tmp_path])

    assert list(texts.values()) == ["a whole report"]
    assert reasons[posix(tmp_path / "cut.pdf")].startswith("unreadable PDF: ") and len(reasons) == 1


def test_an_aes_encrypted_pdf_is_reported_as_needing_a_password(tmp_path):
    (tmp_path / "locked.pdf").write_bytes(encrypted_pdf("secret plans"))

    texts, reasons, _ = run_load([tmp_path])

    assert texts == {} and reasons == {posix(tmp_path / "locked.pdf"): "encrypted PDF: a password is needed to read it"}


def test_symlink_loops_are_reported_and_a_folder_loop_is_walked_once(tmp_path):
    (tmp_path / "ok.md").write_text("fine")
    (tmp_path / "a.md").symlink_to(tmp_path / "b.md")
    (tmp_path / "b.md").symlink_to(tmp_path / "a.md")
    (tmp_path / "self.txt").symlink_to(tmp_path / "self.txt")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to(tmp_path)  # a folder that contains its own parent

    texts, reasons, _ = run_load([tmp_path])

    assert list(texts) == [posix(tmp_path / "ok.md")]
    loop = "cannot read file: Too many levels of symbolic links"
    assert reasons == {posix(tmp_path / n): loop for n in ("a.md", "b.md", "self.txt")}


def test_an_unreadable_file_is_reported_with_the_systems_reason(tmp_path):
    unreadable_file(tmp_path / "mem.txt")
    (tmp_path / "ok.txt").write_text("fine")

    texts, reasons, _ = run_load([tmp_path], follow_links=True)  # the fault is a link out of the root

    assert list(texts.values()) == ["fine"]
    assert reasons == {posix(tmp_path / "mem.txt"): "cannot read file: Input/output error"}


def test_a_folder_where_a_file_is_expected_is_walked_not_read(tmp_path):
    (tmp_path / "notes.md").mkdir()  # a folder named like a file
    (tmp_path / "notes.md" / "inside.txt").write_text("inside")

    texts, reasons, _ = run_load([tmp_path])

    assert list(texts.values()) == ["inside"] and reasons == {}


@pytest.mark.parametrize("given, reason", [
    ("gone", "no such file or directory"),
    ("x" * 300, "file name too long"),
    ("ok.txt/child.txt", "not a directory"),
], ids=["missing", "name-too-long", "under-a-file"])
def test_a_path_that_cannot_be_reached_fails_the_root_with_the_real_reason(tmp_path, given, reason):
    """Regression: a name too long or a path under a file were reported as 'no such file or directory'."""
    (tmp_path / "ok.txt").write_text("fine")

    texts, reasons, ctx = run_load([tmp_path / "ok.txt", tmp_path / given])

    assert list(texts.values()) == ["fine"]
    missing = (tmp_path / given).as_posix()
    assert reasons == {Path(missing).name: f"{reason} (listed as {missing!r})"}
    assert [f.root for f in ctx.failures] == [True]  # a root failure: the run deletes nothing


# ----------------------------------------------------------------------------- a real incremental index
GOOD = {
    "keep.md": "# Keep\n\nKeepsake notes about okapis in the Ituri forest.\n",
    "binary.txt": "Bioluminescent plankton glow in the wake of boats.",
    "undecodable.txt": "Undecodable notes on the cassowary, a large flightless bird.",
    "empty.md": "# Empty\n\nEmptiness notes on the vacuum of interstellar space.\n",
    "nuls.txt": "Nullarbor plain notes: a flat, treeless limestone expanse.",
    "huge.txt": "Humongous fungus notes: a honey fungus covers square kilometres.",
    "loop.md": "# Loop\n\nLooping notes on the Möbius strip and its single side.\n",
    "unreadable.txt": "Unreadable notes on the Voynich manuscript.",
    "textless.html": "<html><body><h1>Textless</h1><p>Tardigrades survive the vacuum of space.</p></body></html>",
    "page.html": "<html><body><p>Pangolins are scaly anteaters.</p></body></html>",
}
PDFS = {"report.pdf": "Reindeer herding report from Lapland", "locked.pdf": "Lockpicking primer for beginners"}
RECORDS = [{"_id": "r1", "title": "Axolotl", "text": "Axolotls regrow whole limbs."},
           {"_id": "r2", "title": "Quokka", "text": "Quokkas live on Rottnest Island."},
           {"_id": "r3", "title": "Narwhal", "text": "Narwhal tusks are elongated teeth."}]

# file -> the reason its failure must give, after the second run
BROKEN = {
    "binary.txt": "binary content, not text",
    "undecodable.txt": "not valid utf-8: cannot decode byte 0xe9 at offset 3",
    "empty.md": "empty document",
    "nuls.txt": "binary content, not text",
    "huge.txt": f"file is {HUGE} bytes, over the max_bytes limit of 50000000",
    "loop.md": "cannot read file: Too many levels of symbolic links",
    "loop2.md": "cannot read file: Too many levels of symbolic links",
    "unreadable.txt": "cannot read file: Input/output error",
    "textless.html": "no text after conversion",
    "report.pdf": "unreadable PDF: ",
    "locked.pdf": "encrypted PDF: a password is needed to read it",
    "corpus.jsonl:2": "invalid JSON: ",
    "pipe.txt": "not a regular file (named pipe)",
}


# a search for the word must still find the source, whatever became of its file
STILL_FOUND = [("okapis", "keep.md"), ("plankton", "binary.txt"), ("cassowary", "undecodable.txt"),
               ("emptiness interstellar", "empty.md"), ("nullarbor", "nuls.txt"), ("fungus", "huge.txt"),
               ("strip single side", "loop.md"), ("voynich", "unreadable.txt"), ("tardigrades", "textless.html"),
               ("reindeer", "report.pdf"), ("lockpicking", "locked.pdf"), ("quokkas", "corpus.jsonl#r2")]


def break_everything(docs: Path) -> None:
    """Every earlier document turns bad at once; one good file is added and one page changes."""
    (docs / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (docs / "undecodable.txt").write_bytes("café au lait".encode("latin-1"))
    (docs / "empty.md").write_bytes(b"")
    (docs / "nuls.txt").write_bytes(b"\x00" * 100_000)
    sparse_file(docs / "huge.txt", HUGE)
    (docs / "loop.md").unlink()
    (docs / "loop.md").symlink_to(docs / "loop2.md")
    (docs / "loop2.md").symlink_to(docs / "loop.md")
    (docs / "unreadable.txt").unlink()
    unreadable_file(docs / "unreadable.txt")
    (docs / "textless.html").write_text("<html><head><script>track()</script></head><body></body></html>")
    (docs / "report.pdf").write_bytes(truncated_pdf(PDFS["report.pdf"]))
    (docs / "locked.pdf").write_bytes(encrypted_pdf(PDFS["locked.pdf"]))
    lines = (docs / "corpus.jsonl").read_text().splitlines()
    lines[1] = lines[1][:-10]  # record r2 loses its end: invalid JSON
    (docs / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    os.mkfifo(docs / "pipe.txt")
    (docs / "page.html").write_text(deep_html("<p>Pangolins roll into a ball when threatened.</p>"))
    (docs / "new.md").write_text("# New\n\nNewts are amphibians that regenerate their hearts.\n")


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    """(project, docs, first snapshot, second report, second snapshot, hits of a search per word)."""
    folder = tmp_path_factory.mktemp("bad_documents")
    docs = folder / "docs"
    docs.mkdir()
    for name, text in GOOD.items():
        (docs / name).write_text(text)
    for name, text in PDFS.items():
        (docs / name).write_bytes(make_pdf([text]))
    (docs / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (folder / "prompts").mkdir()
    project = folder / "pipelines.yaml"
    # follow_links: the unreadable file is a link to /proc/self/mem, outside the root
    project.write_text(index_and_search_yaml(batch_size=4).replace("paths: [docs]", "paths: [docs], follow_links: true"))

    first = engine.run(load_project(project).pipeline("index"), orchestrate=False)
    assert (first.added, first.failed) == (len(GOOD) + len(PDFS) + len(RECORDS), 0), first.failures
    before = snapshot(project)
    break_everything(docs)
    second = engine.run(load_project(project).pipeline("index"), orchestrate=False)
    search = load_project(project).pipeline("search")
    words = ["newts", "pangolins ball"] + [word for word, _ in STILL_FOUND]
    hits = {word: [p.source_id for p in engine.run(search, {"query": word}, orchestrate=False)] for word in words}
    yield project, docs, before, second, snapshot(project), hits


def source(docs: Path, name: str) -> str:
    """The source id: the path below the project's folder (never the server's absolute path)."""
    return f"{docs.name}/{name}"


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_bad_document_is_named_with_its_reason(broken_run, name):
    _, docs, _, report, _, _ = broken_run
    reasons = {f.source_id: f.reason for f in report.failures}
    assert reasons[source(docs, name)].startswith(BROKEN[name]), reasons


def test_no_other_failure_and_no_root_failure(broken_run):
    _, docs, _, report, _, _ = broken_run
    assert {f.source_id for f in report.failures} == {source(docs, n) for n in BROKEN}
    assert report.failed == len(BROKEN) and report.incomplete == []


def test_the_rest_of_the_batch_is_indexed(broken_run):
    _, docs, _, report, after, hits = broken_run
    assert (report.added, report.updated, report.deleted) == (1, 1, 0)
    assert hits["newts"][0] == source(docs, "new.md")
    assert hits["pangolins ball"][0] == source(docs, "page.html")  # 10,000 levels deep, read in full
    [page] = [text for _, text, meta in after["chroma"] if f'"source": "{source(docs, "page.html")}"' in meta]
    assert page.endswith("Pangolins roll into a ball when threatened.")


def test_nothing_indexed_before_is_lost(broken_run):
    """Every earlier source keeps its chunks in Chroma, BM25 and the state, unchanged."""
    _, docs, before, _, after, _ = broken_run
    kept = [s for s in before["sources"] if not s.startswith(source(docs, "page.html"))]
    assert len(kept) == len(GOOD) + len(PDFS) + len(RECORDS) - 1
    assert {s: after["sources"][s] for s in kept} == {s: before["sources"][s] for s in kept}
    old_rows = {row for row in before["chroma"] if source(docs, "page.html") not in row[2]}
    assert old_rows <= set(after["chroma"])
    assert {row[0] for row in old_rows} <= set(after["bm25"]) and set(after["bm25"]) == set(after["state_chunks"])


@pytest.mark.parametrize("word, name", STILL_FOUND)
def test_search_still_finds_what_a_broken_document_held(broken_run, word, name):
    _, docs, _, _, _, hits = broken_run
    assert source(docs, name) in hits[word][:3], hits[word][:3]
