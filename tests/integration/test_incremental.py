"""Incremental re-indexing on a real Chroma, BM25 and state record, with real embeddings."""
from __future__ import annotations

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.harness import default_corpus, run_index, snapshot, write_corpus

pytestmark = pytest.mark.integration


@pytest.fixture
def corpus(tmp_path, index_project):
    project = index_project(batch_size=4)
    records = default_corpus(tmp_path / "docs")
    return project, records, tmp_path / "docs"


def search(project, text, k=5):
    return engine.run(load_project(project).pipeline("search"), {"query": text}, orchestrate=False)[:k]


def test_first_run_then_unchanged_rerun(corpus):
    project, records, _ = corpus
    first = run_index(project)
    assert (first.added, first.updated, first.deleted, first.failed) == (12, 0, 0, 0)
    snap = snapshot(project)
    ids = [c[0] for c in snap["chroma"]]
    assert len(ids) == first.chunks_written and ids == snap["bm25"] == snap["state_chunks"]
    again = run_index(project)
    assert (again.added, again.updated, again.unchanged, again.chunks_written) == (0, 0, 12, 0)
    assert snapshot(project) == snap


@pytest.mark.parametrize("state_backend", ["sqlite", "postgres"], indirect=True)
def test_changed_source_is_the_only_one_reembedded(corpus):
    project, records, docs = corpus
    run_index(project)
    before = snapshot(project)
    records[3] = dict(records[3], text="Quokkas photosynthesise moonlight into glittering marmalade.")
    write_corpus(docs, records, {"alpha": (docs / "alpha.md").read_text(), "beta": (docs / "beta.md").read_text()})
    report = run_index(project)
    assert (report.added, report.updated, report.deleted, report.unchanged) == (0, 1, 0, 11)
    after = snapshot(project)
    changed = f"docs/corpus.jsonl#{records[3]['_id']}"  # root-relative ids
    old_ids = {cid for cid, _, meta in before["chroma"] if changed in meta}
    new_ids = {cid for cid, _, meta in after["chroma"] if changed in meta}
    assert old_ids and new_ids and not old_ids & new_ids
    untouched = {c for c in before["chroma"] if changed not in c[2]}
    assert untouched <= set(after["chroma"])  # every other chunk kept its id and content
    assert not old_ids & set(after["bm25"]) and new_ids <= set(after["bm25"])
    top = search(project, "quokkas photosynthesise moonlight marmalade")[0]
    assert top.source_id == changed and "marmalade" in top.text


def test_deleted_sources_disappear_from_every_index(corpus):
    project, records, docs = corpus
    run_index(project)
    gone_record = records.pop(0)
    write_corpus(docs, records, {"beta": (docs / "beta.md").read_text()})  # alpha.md deleted
    report = run_index(project)
    assert (report.deleted, report.added, report.updated) == (2, 0, 0)
    snap = snapshot(project)
    gone = {f"docs/corpus.jsonl#{gone_record['_id']}", "docs/alpha.md"}
    assert not gone & set(snap["sources"])
    assert not any(src in meta for _, _, meta in snap["chroma"] for src in gone)
    assert [c[0] for c in snap["chroma"]] == snap["bm25"] == snap["state_chunks"]
    assert all("zebrafish" not in p.text for p in search(project, "zebrafish regeneration alpha notes"))


def test_settings_change_reindexes_everything(corpus):
    project, _, _ = corpus
    run_index(project)
    before = {c[0] for c in snapshot(project)["chroma"]}
    report = run_index(project, chunk={"size": 64, "overlap": 8})
    assert (report.updated, report.unchanged) == (12, 0)
    after = snapshot(project)
    assert not before & {c[0] for c in after["chroma"]}
    assert [c[0] for c in after["chroma"]] == after["bm25"] == after["state_chunks"]


def test_unreadable_file_is_skipped_and_keeps_what_was_indexed(corpus):
    project, _, docs = corpus
    run_index(project)
    before = snapshot(project)
    (docs / "alpha.md").write_bytes(b"\xff\xfe\xfa not utf-8")
    (docs / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    report = run_index(project)
    assert report.failed == 2 and report.deleted == 0
    reasons = {f.source_id.rsplit("/", 1)[-1]: f.reason for f in report.failures}
    assert "utf-8" in reasons["alpha.md"] and "binary" in reasons["image.txt"]
    assert snapshot(project)["chroma"] == before["chroma"]  # alpha's old chunks are not lost


def test_empty_and_textless_documents_are_reported_not_fatal(corpus):
    project, _, docs = corpus
    (docs / "empty.md").write_text("   \n")
    (docs / "blank.html").write_text("<html><head><script>var x=1;</script></head><body><nav></nav></body></html>")
    report = run_index(project)
    assert report.added == 12 and report.failed == 2
    assert {f.source_id.rsplit("/", 1)[-1] for f in report.failures} == {"empty.md", "blank.html"}


def test_metadata_filter_applies_to_dense_and_sparse(corpus):
    project, _, _ = corpus
    run_index(project)
    passages = engine.run(load_project(project).pipeline("search"),
                          {"query": {"text": "notes", "filters": {"format": "markdown"}}}, orchestrate=False)
    assert passages and {p.metadata["format"] for p in passages} == {"markdown"}
    assert {p.retriever for p in passages} == {"fuse"}
