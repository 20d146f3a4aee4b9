"""The change journal (flows/sources/journal.py): what a watcher records and when a run may trust it."""
from __future__ import annotations

import time

import pytest

from ragline.flows.sources import journal as journal_module
from ragline.flows.sources.journal import FolderWatcher, Journal, folder_identity, journal_file


def test_a_path_leaves_the_journal_only_if_no_event_came_since_it_was_read(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    epoch = journal.begin("/root", "1:2")
    journal.record(epoch, ["/root/a", "/root/b"], ready=True)
    read = journal.changes()
    journal.record(epoch, ["/root/b"])  # b changed again after the run read the journal
    assert journal.settle(read) == 1
    assert list(journal.changes()) == ["/root/b"]


def test_a_journal_is_live_while_its_watcher_beats_on_its_folder_and_until_it_stops(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    assert journal.watch() is None  # never watched
    root = tmp_path / "docs"
    root.mkdir()
    epoch = journal.begin(str(root), folder_identity(str(root)))
    assert not journal.watch().live()  # its watches are not in place yet
    journal.record(epoch, [], ready=True)
    watch = journal.watch()
    assert watch.live() and watch.ready is not None and watch.epoch == epoch
    assert not watch.live(now=watch.beat + journal_module.LIVE_SECONDS + 1)  # a killed watcher's
    root.rename(tmp_path / "aside")
    root.mkdir()  # the root replaced: the watches are on the old folder
    assert not journal.watch().live()
    root.rmdir()
    (tmp_path / "aside").rename(root)
    assert journal.watch().live()
    journal.fail(epoch, "stopped")
    assert journal.watch().error == "stopped" and not journal.watch().live()


def test_a_new_epoch_drops_the_old_paths_and_ignores_the_old_watcher(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    old = journal.begin("/root", "1:2")
    journal.record(old, ["/root/a"], ready=True)
    new = journal.begin("/root", "1:2")
    journal.record(old, ["/root/late"])  # the old watcher, still running: not recorded
    assert journal.changes() == {} and journal.watch().epoch == new


def test_each_pipeline_has_its_own_journal_of_a_folder(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "link").symlink_to(docs)
    one = journal_file(tmp_path, "index", str(docs))
    assert one == journal_file(tmp_path, "index", str(tmp_path / "link"))  # the same folder
    assert one != journal_file(tmp_path, "other", str(docs))


def wait_for(journal: Journal, path: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while path not in journal.changes():
        assert time.monotonic() < deadline, f"{path} never recorded: {sorted(journal.changes())}"
        time.sleep(0.05)


def wait_for_beats(journal: Journal, count: int, timeout: float = 20) -> None:
    """Until the watcher wrote ``count`` more heartbeats. Looked at less often than it beats: a read of
    a journal below the root is an event there, and the watcher beats after ``HEARTBEAT_MS`` without one."""
    deadline, seen = time.monotonic() + timeout, {journal.watch().beat}
    while len(seen) <= count:
        assert time.monotonic() < deadline, f"{len(seen) - 1} heartbeats in {timeout} s"
        time.sleep(1.5 * journal_module.HEARTBEAT_MS / 1000)
        seen.add(journal.watch().beat)


@pytest.mark.timeout(120)
def test_a_watcher_records_files_and_folders_that_change_below_its_root(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "sub" / "old.md").write_text("old")
    journals = [Journal(tmp_path / "a.sqlite"), Journal(tmp_path / "b.sqlite")]
    watcher = FolderWatcher(str(docs), journals).start()
    try:
        assert watcher.ready.wait(30)
        assert all(j.watch().live() for j in journals)
        (docs / "sub" / "new.md").write_text("new")
        (docs / "sub" / "old.md").unlink()
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "inner.md").write_text("inner")
        outside.rename(docs / "moved")  # one event: the folder, not its files
        for journal in journals:
            for path in ("sub/new.md", "sub/old.md", "moved"):
                wait_for(journal, str(docs / path))
    finally:
        watcher.stop()
    assert all(j.watch().error == "stopped" for j in journals)


@pytest.mark.timeout(120)
def test_a_watcher_whose_folder_is_replaced_starts_over_on_the_new_one(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "RESTART_SECONDS", 0.2)
    monkeypatch.setattr(journal_module, "HEARTBEAT_MS", 200)  # a quiet watcher looks at its folder this often
    docs = tmp_path / "docs"
    docs.mkdir()
    journal = Journal(tmp_path / "j.sqlite")
    watcher = FolderWatcher(str(docs), [journal]).start()
    try:
        assert watcher.ready.wait(30)
        first = journal.watch().epoch
        docs.rename(tmp_path / "aside")  # the watched folder replaced: its watches see the old one
        docs.mkdir()
        deadline = time.monotonic() + 60
        while journal.watch().epoch == first or not journal.watch().live():
            assert time.monotonic() < deadline, journal.watch()
            time.sleep(0.1)
        (docs / "new.md").write_text("in the new folder")
        wait_for(journal, str(docs / "new.md"))
    finally:
        watcher.stop()


@pytest.mark.timeout(120)
def test_a_journal_below_its_root_does_not_record_its_own_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "HEARTBEAT_MS", 200)
    docs = tmp_path / "docs"
    docs.mkdir()
    journal = Journal(journal_file(docs / "data", "index", str(docs)))  # the data folder inside the root
    watcher = FolderWatcher(str(docs), [journal]).start()
    try:
        assert watcher.ready.wait(30)
        (docs / "note.md").write_text("a note")
        wait_for(journal, str(docs / "note.md"))
        wait_for_beats(journal, 3)  # the journal written three times more below the watched root
        assert list(journal.changes()) == [str(docs / "note.md")]
    finally:
        watcher.stop()
