"""A reading process works on a private copy of an embedded Chroma folder and never writes the
folder itself; its first write switches it to the folder (issue 40.3)."""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ragline.flows.resources.stores import read_snapshot
from ragline.flows.resources.stores.state import IndexBusy
from tests.helpers.chroma_vectors import DIM, basis, chunk, make


def fingerprint(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The temporary folder the copies go to, to see that none is left."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_reader_never_writes_the_folder_and_its_first_write_does(tmp_path, private_tmp):
    writer = make(tmp_path)
    writer.upsert([chunk(f"e{i}", basis(i), source=f"s{i}") for i in range(DIM)])
    writer.close()
    before = fingerprint(writer.path)

    reader = make(tmp_path)  # a new process's store: it has not written
    assert reader.count() == DIM
    assert reader.query(np.asarray([basis(3)]), k=1)[0][0].chunk_id == "e3"
    assert fingerprint(writer.path) == before  # (was: chroma.sqlite3 at open, length.bin at the first read)
    assert len(list(private_tmp.iterdir())) == 1  # its copy

    reader.upsert([chunk("new", (np.asarray(basis(0)) + np.asarray(basis(1))).tolist(), source="s-new")])  # a writer from now on
    assert not list(private_tmp.iterdir())  # the copy removed with its client
    assert reader.count() == DIM + 1
    reader.close()
    assert make(tmp_path).all_ids() == {f"e{i}" for i in range(DIM)} | {"new"}


def test_a_copy_that_a_write_interrupted_is_taken_again(tmp_path, private_tmp, monkeypatch):
    source = tmp_path / "store"
    source.mkdir()
    (source / "data.bin").write_bytes(b"old")
    copy, copies = read_snapshot._copy, []

    def copy_while_written(src: Path, dst: Path) -> None:  # a writer changes the file during the first copy
        copy(src, dst)
        copies.append(dst)
        if len(copies) == 1:
            (source / "data.bin").write_bytes(b"new contents")

    monkeypatch.setattr(read_snapshot, "_copy", copy_while_written)
    snapshot = read_snapshot.take(source, "a store")
    assert len(copies) == 2 and (snapshot / "data.bin").read_bytes() == b"new contents"
    assert not copies[0].exists()  # the torn copy is gone
    read_snapshot.discard(snapshot)
    assert not list(private_tmp.iterdir())


def test_a_folder_that_never_stops_changing_is_named(tmp_path, private_tmp, monkeypatch):
    source = tmp_path / "store"
    source.mkdir()
    (source / "data.bin").write_bytes(b"0")
    copy = read_snapshot._copy

    def always_written(src: Path, dst: Path) -> None:
        copy(src, dst)
        (source / "data.bin").write_bytes((source / "data.bin").read_bytes() + b"1")

    monkeypatch.setattr(read_snapshot, "_copy", always_written)
    monkeypatch.setattr(read_snapshot, "ATTEMPTS", 3)
    with pytest.raises(IndexBusy, match=f"{source} kept changing while it was copied for reading"):
        read_snapshot.take(source, "a store")
    assert not list(private_tmp.iterdir())


def test_sqlites_shared_memory_file_is_neither_copied_nor_watched(tmp_path, private_tmp, monkeypatch):
    """A writer's own reads change ``chroma.sqlite3-shm``; SQLite rebuilds it in the copy."""
    source = tmp_path / "store"
    source.mkdir()
    (source / "chroma.sqlite3").write_bytes(b"db")
    (source / "chroma.sqlite3-shm").write_bytes(b"0")
    copy, copies = read_snapshot._copy, []

    def copy_while_read(src: Path, dst: Path) -> None:
        copy(src, dst)
        copies.append(dst)
        (source / "chroma.sqlite3-shm").write_bytes(b"01")

    monkeypatch.setattr(read_snapshot, "_copy", copy_while_read)
    snapshot = read_snapshot.take(source, "a store")
    assert len(copies) == 1 and sorted(p.name for p in snapshot.iterdir()) == ["chroma.sqlite3"]
    read_snapshot.discard(snapshot)


def test_a_long_lived_reader_sees_what_another_process_wrote_and_removes_its_stale_copy(tmp_path, private_tmp):
    """A served API or a test process reading for a long time: a write by another process (here another
    store object on the same folder) shows on its next read, and its earlier copy is gone."""
    writer = make(tmp_path)
    writer.upsert([chunk(f"e{i}", basis(i), source=f"s{i}") for i in range(3)])
    writer.close()
    reader = make(tmp_path)
    assert reader.count() == 3
    first = list(private_tmp.iterdir())

    other = make(tmp_path)
    other.upsert([chunk("late", basis(5), source="s-late")])
    other.close()
    assert reader.count() == 4 and reader.query(np.asarray([basis(5)]), k=1)[0][0].chunk_id == "late"
    assert len(list(private_tmp.iterdir())) == 1 and list(private_tmp.iterdir()) != first
    reader.close()
    assert not list(private_tmp.iterdir())


def test_a_read_in_flight_keeps_its_copy_until_it_ends(tmp_path, private_tmp):
    """A copy a write made stale is closed by the last read that uses it, not under it."""
    writer = make(tmp_path)
    writer.upsert([chunk("a", basis(0), source="s0")])
    writer.close()
    reader = make(tmp_path)
    seen: list[int] = []

    def read_while_another_process_writes(collection):
        other = make(tmp_path)
        other.upsert([chunk("b", basis(1), source="s1")])
        other.close()
        seen.append(reader.count())  # a nested read: takes a new copy, the first one stays open
        return collection.count()

    assert reader._call("count", read_while_another_process_writes, create=False) == 1
    assert seen == [2]
    assert len(list(private_tmp.iterdir())) == 1  # the stale copy went with its last read
    reader.close()


def test_a_metadata_update_by_a_process_that_only_read_reaches_the_folder(tmp_path, private_tmp):
    """Re-granting access changes metadata only: written through a reading copy it was lost with it."""
    writer = make(tmp_path)
    writer.upsert([chunk("a", basis(0), source="s0")])
    writer.close()
    process = make(tmp_path)
    assert process.metadatas(["a"])["a"].get("group") is None  # it has read (as re-granting does first): a private copy
    process.update_metadata({"a": {"group": "eng"}})
    process.close()
    assert make(tmp_path).metadatas(["a"])["a"]["group"] == "eng"
