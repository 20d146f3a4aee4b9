"""Unit tests of flows/serve.py that need no Prefect server (tests/integration/test_serve.py has one)."""
from __future__ import annotations

import os
import time

import pytest

from ragline.flows.cli import main
from ragline.flows.serve import prune_results


def test_old_results_are_pruned_and_recent_ones_kept(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    now = time.time()
    for name, age_days in (("old.json", 31), ("older.json", 400), ("recent.json", 29), ("new.json", 0)):
        path = folder / name
        path.write_text("{}")
        os.utime(path, (now - age_days * 86400, now - age_days * 86400))
    (folder / "sub").mkdir()  # not a result file: left alone
    assert prune_results(folder, 30, now=now) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["new.json", "recent.json", "sub"]
    assert prune_results(folder, None, now=now + 1e9) == 0  # keep all
    assert prune_results(tmp_path / "absent", 30) == 0


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_keep_results_days_must_be_a_number_of_days(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--keep-results-days", value])
    assert exited.value.code == 2 and "--keep-results-days" in capsys.readouterr().err
