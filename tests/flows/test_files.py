"""write_atomic: the old content or the new, never a part, and no temporary file left behind."""
from __future__ import annotations

import pytest

from ragline.flows.files import write_atomic


def test_it_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "sub" / "record.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_text() == "new" and [p.name for p in target.parent.iterdir()] == ["record.json"]


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary_file(tmp_path):
    target = tmp_path / "record.json"
    write_atomic(target, "old")
    with pytest.raises(TypeError):
        write_atomic(target, 42)  # type: ignore[arg-type]  (not bytes: the write fails midway)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
