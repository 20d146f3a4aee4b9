"""Issue 22: a folder root that ``ragline serve`` watches is listed from its change journal, so a
scheduled run stats what changed, not the corpus (flows/sources/journal.py, tasks/ingest/load/journal.py).

A real watcher thread (watchfiles: inotify) keeps the journal while real runs index a real corpus
(the loader, chunker, Chroma, BM25 and state; the hash stand-in embedder). Each test checks what
the runs did (the report) and how many files the loader stat-ed, and that a full listing afterwards
finds the index exactly as the files are."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from ragline.flows.resources import clear_cache
from ragline.flows.sources import journal as journal_module
from ragline.flows.sources.journal import FolderWatcher, Journal, journal_file
from ragline.flows.sources.local import RACY_SECONDS
from ragline.flows.spec.compile import load_project
from ragline.tasks.ingest import load as load_module
from tests.helpers.harness import run_child, run_index, snapshot
from tests.helpers.notes_corpus import HASH_EMBED, age, note_text, write_corpus

pytestmark = pytest.mark.integration

N = 30  # files in the corpus (+ one JSONL file of five records)


@pytest.fixture(autouse=True)
def patient_liveness(monkeypatch):
    """A starved CI machine may hold the watcher's heartbeat back for seconds: these tests are about
    what a live journal lists (liveness itself: tests/flows/sources/test_journal.py)."""
    monkeypatch.setattr(journal_module, "LIVE_SECONDS", 300.0)


@pytest.fixture
def project(tmp_path, make_project):
    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
    path = make_project(HASH_EMBED)
    write_corpus(path.parent / "docs", N)
    return path


@pytest.fixture
def watcher(project):
    """A watcher of the project's ``docs`` root (as ``ragline serve`` starts it), ready."""
    started = FolderWatcher(str(project.parent / "docs"), [journal_of(project)]).start()
    assert started.ready.wait(30), "the watcher did not become ready"
    yield started
    started.stop()


@pytest.fixture
def stats(monkeypatch):
    """How many files the loader stat-ed (one per file a listing looks at)."""
    seen: list[str] = []
    real = load_module.stat_signal

    def spy(path):
        seen.append(path)
        return real(path)

    monkeypatch.setattr(load_module, "stat_signal", spy)
    return seen


def journal_of(project) -> Journal:
    return Journal(journal_file(project.parent, "index", str(project.parent / "docs")))


def wait_for(journal: Journal, *names: str, timeout: float = 30) -> None:
    """Until the journal holds a path ending with each name (events arrive after a debounce)."""
    deadline = time.monotonic() + timeout
    while not all(any(p.endswith(n) for p in journal.changes()) for n in names):
        assert time.monotonic() < deadline, f"no journal entry for {names}: {sorted(journal.changes())}"
        time.sleep(0.1)


def run(project, stats, **overrides):
    clear_cache()
    stats.clear()
    return run_index(project, **overrides)


def settle(project, stats, journal, runs: int = 4):
    """Run until the journal is empty (a path leaves it once a run finds the index agreeing; a file
    written in the last two seconds has no trusted signal yet: ``RACY_SECONDS``)."""
    time.sleep(RACY_SECONDS + 0.1)
    for _ in range(runs):
        report = run(project, stats)
        assert (report.added, report.deleted, report.failed) == (0, 0, 0)
        if not journal.changes():
            return
    raise AssertionError(f"the journal kept {sorted(journal.changes())}")


def full_listing_agrees(project, stats, documents: int) -> None:
    report = run(project, stats, load={"full_listing_hours": 0})
    assert (report.added, report.updated, report.deleted, report.unchanged) == (0, 0, 0, documents)
    assert len(stats) >= documents - 5  # a full listing: every file (the JSONL file's five records: one)


def test_runs_list_what_changed_from_the_journal(project, watcher, stats):
    docs = project.parent / "docs"
    journal = journal_of(project)
    first = run(project, stats)  # a full listing, after the watcher was ready: it vouches for the journal
    assert first.added == N + 5 and len(stats) == N + 1
    quiet = run(project, stats)
    assert (quiet.added, quiet.updated, quiet.deleted, quiet.unchanged) == (0, 0, 0, N + 5)
    assert stats == []  # nothing changed: no file looked at

    (docs / "000" / "note00003.md").write_text(note_text(3) + "An added closing line.\n")
    (docs / "000" / "note00004.md").unlink()
    (docs / "new").mkdir()
    (docs / "new" / "fresh.md").write_text("# Fresh\n\nA note written after the full listing.\n")
    moved = project.parent / "elsewhere"
    moved.mkdir()
    for i in (7, 8):
        (docs / "000" / f"note0000{i}.md").rename(moved / f"note0000{i}.md")
    shutil.move(str(moved), str(docs / "moved"))  # a folder moved in: one event for the folder
    # a folder made and written at once: its file may come before the folder is watched, so only the
    # folder's own event is sure (a run walks a changed folder)
    wait_for(journal, "note00003.md", "note00004.md", "/new", "note00008.md", "/moved")
    changed = run(project, stats)
    assert (changed.updated, changed.deleted) == (1, 3), changed  # note04, and note07/08's old ids
    assert changed.added == 3  # fresh.md and the moved notes under their new ids
    assert changed.unchanged == N + 5 - 4
    assert len(stats) <= 8, stats  # the changed paths' files, not the corpus

    settle(project, stats, journal)
    full_listing_agrees(project, stats, N + 5)  # one deleted, one added, two moved


def test_a_stopped_or_restarted_watcher_means_a_full_listing(project, watcher, stats):
    journal = journal_of(project)
    run(project, stats)
    assert run(project, stats).unchanged == N + 5 and stats == []
    watcher.stop()  # nothing records changes now: the journal says so
    assert journal.watch().error == "stopped"
    (project.parent / "docs" / "000" / "note00001.md").write_text(note_text(1) + "Changed unwatched.\n")
    unwatched = run(project, stats)
    assert unwatched.updated == 1 and len(stats) == N + 1
    again = FolderWatcher(str(project.parent / "docs"), [journal]).start()  # a new epoch
    try:
        assert again.ready.wait(30)
        assert run(project, stats).unchanged == N + 5 and len(stats) == N + 1  # its first run: in full
        assert run(project, stats).unchanged == N + 5 and stats == []  # then from the journal
    finally:
        again.stop()


def test_settings_that_change_the_listing_mean_a_full_listing(project, watcher, stats):
    run(project, stats)
    assert run(project, stats).unchanged == N + 5 and stats == []
    excluding = run(project, stats, load={"exclude": ["**/001/**"]})  # the step's settings changed
    assert len(stats) > 0 and excluding.deleted == 0  # 001/ does not exist: nothing excluded yet
    assert run(project, stats).unchanged == N + 5 and len(stats) == N + 1  # back: its own digest again


@pytest.mark.parametrize("failpoint", ["load.after_mark", "index.after_upsert", "finalize.after_publish"])
def test_a_run_killed_under_the_journal_loses_nothing(project, watcher, stats, failpoint):
    docs = project.parent / "docs"
    journal = journal_of(project)
    run(project, stats)  # the full listing that vouches for the journal
    (docs / "000" / "note00002.md").write_text(note_text(2) + "Edited before a crash.\n")
    (docs / "000" / "note00005.md").unlink()
    (docs / "000" / "added.md").write_text("# Added\n\nA note added before a crash.\n")
    wait_for(journal, "note00002.md", "note00005.md", "added.md")
    clear_cache()
    crashed = run_child(project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    settle(project, stats, journal)
    full_listing_agrees(project, stats, N + 5)
    got = snapshot(project)
    assert [c[0] for c in got["chroma"]] == got["bm25"] == got["state_chunks"]


def test_a_crash_before_the_vouching_run_ends_keeps_the_full_listing(project, watcher, stats):
    """The full listing vouches for the journal only once its run finished: a run killed after its
    listing leaves no record, so the next run lists in full again (it would miss a file the killed
    run found changed but never indexed)."""
    crashed = run_child(project, failpoints="index.after_upsert")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    report = run(project, stats)
    assert report.added == N + 5 and len(stats) == N + 1
    assert run(project, stats).unchanged == N + 5 and stats == []


def test_the_journal_is_not_trusted_past_full_listing_hours(project, watcher, stats):
    run(project, stats)
    assert run(project, stats).unchanged == N + 5 and stats == []
    clear_cache()
    state = load_project(project).resource("state")
    key = "journal:index:docs"  # the full listing that vouches for the journal: its epoch, digest and time
    vouched = json.loads(state.get_meta(key))
    state.set_meta(key, json.dumps({**vouched, "at": vouched["at"] - 25 * 3600}))  # a day and an hour ago
    assert run(project, stats).unchanged == N + 5 and len(stats) == N + 1  # past 24 hours: in full
    assert run(project, stats).unchanged == N + 5 and stats == []  # vouched for again


def test_last_runs_failures_are_read_again_from_the_journal(project, watcher, stats):
    """A file that failed is read again every run, although no event names it: its failure stays
    reported (and protects what it had indexed), as a full listing would report it."""
    docs = project.parent / "docs"
    (docs / "bad.md").write_bytes(b"# Bad\n\n\xff\xfe not UTF-8\n")
    (docs / "lines.jsonl").write_text('{"_id": "ok", "text": "A fine record."}\n{not json\n')
    for path in ("bad.md", "lines.jsonl"):
        age(docs / path)
    first = run(project, stats)
    assert first.failed == 2 and first.added == N + 5 + 1
    time.sleep(RACY_SECONDS)
    for _ in range(3):  # until the journal holds nothing (the files' writes above were events)
        again = run(project, stats)
        assert again.failed == 2 and again.unchanged == N + 5 + 1
        if not journal_of(project).changes():
            break
    again = run(project, stats)
    assert again.failed == 2 and again.unchanged == N + 5 + 1
    assert sorted(p.rsplit("/", 1)[1] for p in stats) == ["bad.md", "lines.jsonl"]  # only the failed files
    (docs / "lines.jsonl").write_text('{"_id": "ok", "text": "A fine record."}\n{"_id": "two", "text": "B."}\n')
    wait_for(journal_of(project), "lines.jsonl")
    fixed = run(project, stats)
    assert fixed.failed == 1 and fixed.added == 1


def test_a_hard_link_listed_from_the_journal_is_skipped_with_its_reason(project, watcher, stats):
    """Issue 39 item 4: the journal's listing refuses what a full listing refuses (``ln /srv/x docs/x``)."""
    docs = project.parent / "docs"
    outside = project.parent / "srv"
    outside.mkdir()
    (outside / "secret.md").write_text("# Secret\n\nThe salaries of everyone.\n")
    first = run(project, stats)  # the full listing that vouches for the journal
    assert first.added == N + 5
    os.link(outside / "secret.md", docs / "hard.md")
    wait_for(journal_of(project), "hard.md")
    listed = run(project, stats)
    assert len(stats) <= 2, stats  # listed from the journal, not walked
    assert (listed.added, listed.failed) == (0, 1)
    failure = listed.failures[0]
    assert failure.source_id == "docs/hard.md" and failure.skipped and "2 hard links" in failure.reason
