"""Regression (issue 10, item 4): a batch that convert empties must not break later runs.

An HTML page with no text fails in convert on every run (it is never recorded, so it is always
"new"); once the other files are unchanged it is a batch of its own, which reached the tokenizer
empty and crashed every later run with IndexError.
"""
from __future__ import annotations

import pytest

from tests.helpers.harness import run_index, snapshot

pytestmark = pytest.mark.integration

SCRIPT_ONLY = "<html><head><script>var x=1;</script></head><body></body></html>"


@pytest.fixture
def project(tmp_path, index_project):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("Quokkas are small marsupials that live on Rottnest Island.\n")
    (docs / "script.html").write_text(SCRIPT_ONLY)
    return index_project(), docs


def failed_sources(report) -> dict[str, str]:
    return {f.source_id: f.reason for f in report.failures}


def test_page_without_text_does_not_break_later_runs(project):
    project_path, docs = project
    page, ok = "docs/script.html", "docs/ok.txt"  # ids below the root, never server paths

    first = run_index(project_path)
    assert (first.added, first.failed) == (1, 1)
    assert failed_sources(first) == {page: "no text after conversion"}

    second = run_index(project_path)  # the page is a batch of its own now: it used to crash here
    assert (second.added, second.updated, second.unchanged, second.deleted, second.failed) == (0, 0, 1, 0, 1)
    assert failed_sources(second) == {page: "no text after conversion"}
    snap = snapshot(project_path)
    assert set(snap["sources"]) == {ok}
    assert [c[0] for c in snap["chroma"]] == snap["bm25"] == snap["state_chunks"] != []

    (docs / "ok.txt").unlink()
    third = run_index(project_path)
    assert (third.deleted, third.failed) == (1, 1)
    snap = snapshot(project_path)
    assert snap["sources"] == {} and snap["chroma"] == [] and snap["bm25"] == [] and snap["state_chunks"] == []
