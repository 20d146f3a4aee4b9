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
