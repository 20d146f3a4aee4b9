"""The shared-data guard: without ../shared/data a SciFact test skips, except where CI requires the data."""
from __future__ import annotations

import pytest

from tests.helpers import data


def test_missing_scifact_skips_and_fails_where_the_data_is_required(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SCIFACT", tmp_path / "absent")
    monkeypatch.delenv("RAGLINE_REQUIRE_DATA", raising=False)
    with pytest.raises(pytest.skip.Exception, match="SciFact data not found"):
        data.require_scifact()
    monkeypatch.setenv("RAGLINE_REQUIRE_DATA", "1")
    with pytest.raises(pytest.fail.Exception, match="set RAGLINE_DATA_DIR"):
        data.scifact_records(1)
    monkeypatch.setattr(data, "SCIFACT", tmp_path)
    data.require_scifact()  # present: neither
