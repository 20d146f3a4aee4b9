"""The managed uploads folder: content-addressed, atomic, and listed only when whole."""
from __future__ import annotations

import io

import pytest
from ragline.flows.sources import ItemCache
from ragline.flows.sources.uploads import (
    TooLarge,
    UploadFolder,
    UploadsSource,
    UploadsSpec,
    safe_name,
)


def source(base) -> UploadsSource:
    found = UploadsSource(UploadsSpec(type="uploads"), max_bytes=1000)
    found.bind(str(base))
    return found


def test_a_folder_not_made_yet_is_a_complete_empty_listing(tmp_path):
    listing = source(tmp_path).list(ItemCache(tmp_path / "cache"), lambda key: True)
    assert listing.complete and listing.items == []


def test_the_same_bytes_are_one_upload_and_half_written_ones_are_never_listed(tmp_path):
    folder = UploadFolder(tmp_path / ".ragline" / "uploads" / "uploads")
    first, created = folder.put(io.BytesIO(b"hello"), "a.md", 1000)
    again, created_again = folder.put(io.BytesIO(b"hello"), "b.md", 1000)
    assert created and not created_again and again == first
    (folder.folder / ".staging-crashed").mkdir()
    (folder.folder / ".staging-crashed" / "half.md").write_bytes(b"hal")
    listing = source(tmp_path).list(ItemCache(tmp_path / "cache"), lambda key: True)
    assert [item.key for item in listing.items] == [f"{first.id}/a.md"]
    assert source(tmp_path).fetch(listing.items[0]).data == b"hello"
    with pytest.raises(TooLarge):
        folder.put(io.BytesIO(b"x" * 1001), "big.md", 1000)
    assert sorted(p.name for p in folder.folder.iterdir()) == [".staging-crashed", first.id]
    assert folder.remove(first.id) and not folder.remove(first.id) and folder.uploads() == []


@pytest.mark.parametrize("given, expected", [("../../x.md", "x.md"), ("C:\\a\\b.pdf", "b.pdf"), (".env", "env"),
                                             ("a\x00b.md", "ab.md"), ("x#1.md", "x_1.md"), ("é.md", "é.md")])
def test_safe_names(given, expected):
    assert safe_name(given) == expected


@pytest.mark.parametrize("given", ["", "..", "/", "\x00\x01", "../.."])
def test_names_with_nothing_usable_are_refused(given):
    with pytest.raises(ValueError):
        safe_name(given)


# ----------------------------------------------------------------------------- crash-left staging (issue 18)
KILLED_UPLOAD = """
import sys, time
from pathlib import Path
from ragline.flows.sources.uploads import UploadFolder

class Stalls:
    sent = False
    def read(self, size):
        if self.sent:
            print("writing", flush=True)
            time.sleep(600)
        self.sent = True
        return b"half of a document"

UploadFolder(Path(sys.argv[1])).put(Stalls(), "killed.md", 10_000)
"""


class Blocking(io.RawIOBase):
    """A request body that stops half-way until released (an upload in progress)."""

    def __init__(self, first: bytes):
        import threading

        self.first, self.reading, self.release = first, threading.Event(), threading.Event()

    def read(self, size=-1):
        if self.first:
            data, self.first = self.first, b""
            return data
        self.reading.set()
        self.release.wait(30)
        return b""


def staging(folder: UploadFolder) -> list[str]:
    return sorted(p.name for p in folder.folder.iterdir() if p.name.startswith((".staging-", ".deleted-")))


def test_staging_left_by_a_killed_upload_is_removed_and_one_in_use_never(tmp_path):
    import subprocess
    import sys
    import threading

    folder = UploadFolder(tmp_path / "uploads")
    folder.folder.mkdir()
    killed = subprocess.Popen([sys.executable, "-c", KILLED_UPLOAD, str(folder.folder)], stdout=subprocess.PIPE)
    assert killed.stdout.readline() == b"writing\n"
    killed.kill()
    killed.wait()
    (left,) = staging(folder)  # the killed upload's half-written staging folder
    body = Blocking(b"# In use\n\nstill being written\n")
    result = {}
    writer = threading.Thread(target=lambda: result.update(done=folder.put(body, "busy.md", 10_000)))
    writer.start()
    assert body.reading.wait(30)
    assert len(staging(folder)) == 2
    assert folder.sweep(grace_seconds=0) == 1  # the killed one; the one in use is locked
    (in_use,) = staging(folder)
    assert in_use != left
    body.release.set()
    writer.join(30)
    upload, created = result["done"]
    assert created and (folder.folder / upload.id / "busy.md").read_bytes() == b"# In use\n\nstill being written\n"
    assert staging(folder) == []


def test_each_upload_sweeps_staging_older_than_the_grace_period(tmp_path):
    import os
    import time

    folder = UploadFolder(tmp_path / "uploads")
    for name, age in ((".staging-old", 7200), (".deleted-old", 7200), (".staging-young", 10)):
        (folder.folder / name).mkdir(parents=True)
        (folder.folder / name / "part.md").write_bytes(b"part")
        then = time.time() - age
        os.utime(folder.folder / name / "part.md", (then, then))
        os.utime(folder.folder / name, (then, then))
    folder.put(io.BytesIO(b"new"), "new.md", 1000)
    assert staging(folder) == [".staging-young"]
