"""kill -9 at every write boundary (and at random moments), then re-run: the index must equal a clean build."""
from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ragline.flows.resources import clear_cache
from tests.helpers.data import REPO
from tests.helpers.harness import default_corpus, run_child, run_index, snapshot, write_corpus

pytestmark = pytest.mark.integration

FAILPOINTS = ["index.after_forget:2", "index.after_delete:2", "index.after_upsert:2", "index.after_record:2",
              "finalize.after_forget", "finalize.after_delete", "bm25.before_pointer", "finalize.after_publish"]


def change_corpus(docs, records):
    """Edits, deletions and additions, so a crashed run has every kind of work in flight."""
    records = records[1:]  # delete one record
    for i in range(2, 6):  # with batch_size 3, two batches of work: the crash can follow a committed batch
        records[i] = dict(records[i], text=records[i]["text"] + " An added closing sentence.")
    write_corpus(docs, records, {"beta": (docs / "beta.md").read_text(),  # alpha.md deleted
                                 "gamma": "# Gamma\n\nNew notes on CRISPR screens.\n"})


@pytest.fixture
def changed_project(index_project, tmp_path):
    """A project indexed once, whose corpus has then changed."""
    project = index_project(batch_size=3)
    records = default_corpus(tmp_path / "docs")
    run_index(project)
    change_corpus(tmp_path / "docs", records)
    return project


def clean_build(project, tmp_path):
    """What a clean run builds from the same corpus, in the same folder (ids embed the paths)."""
    clear_cache()
    shutil.rmtree(tmp_path / "idx")
    run_index(project)
    return snapshot(project)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_killed_run_converges_to_clean_index(failpoint, changed_project, tmp_path):
    crashed = run_child(changed_project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(changed_project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    after_recovery = snapshot(changed_project)
    assert [c[0] for c in after_recovery["chroma"]] == after_recovery["bm25"] == after_recovery["state_chunks"]
    assert after_recovery == clean_build(changed_project, tmp_path)


def test_random_kills_converge(changed_project, tmp_path):
    """Kill runs at random moments, several times in a row, then let one finish."""
    rng = random.Random(7)
    code = ("import sys; from tests.helpers.harness import run_index; from pathlib import Path; "
            "run_index(Path(sys.argv[1]))")
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", code, str(changed_project)], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(4, 12))
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert run_child(changed_project).returncode == 0
    assert snapshot(changed_project) == clean_build(changed_project, tmp_path)
