"""kill -9 at every write boundary (and at random moments), then re-run: the index must equal a clean build."""
from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import textwrap

import pytest

from ragline.flows.resources import clear_cache
from ragline.flows.spec.compile import load_project
from tests.helpers.crash import FAILPOINTS
from tests.helpers.data import index_and_search_yaml
from tests.helpers.harness import default_corpus, kill_at_random, run_child, run_index, snapshot, write_corpus
from tests.helpers.postgres import new_schema

pytestmark = pytest.mark.integration



def change_corpus(docs, records):
    """Edits, deletions and additions, so a crashed run has every kind of work in flight."""
    records = records[1:]  # delete one record
    for i in range(2, 6):  # with batch_size 3, two batches of work: the crash can follow a committed batch
        records[i] = dict(records[i], text=records[i]["text"] + " An added closing sentence.")
    write_corpus(docs, records, {"beta": (docs / "beta.md").read_text(),  # alpha.md deleted
                                 "gamma": "# Gamma\n\nNew notes on CRISPR screens.\n"})


@pytest.fixture(scope="module")
def crash_site(tmp_path_factory):
    """One project (``site/``), indexed once and then changed, its folder copied aside (``before``),
    and the snapshot of a clean build of the changed corpus: every test restores ``before`` into the
    same folder (ids embed the paths) instead of indexing and clean-building again."""
    root = tmp_path_factory.mktemp("crash")
    site = root / "site"
    (site / "prompts").mkdir(parents=True)
    project = site / "pipelines.yaml"
    project.write_text(textwrap.dedent(index_and_search_yaml(batch_size=3)))
    records = default_corpus(site / "docs")
    run_index(project)
    change_corpus(site / "docs", records)
    clear_cache()
    shutil.copytree(site, root / "before")
    shutil.rmtree(site / "idx")
    run_index(project)
    clean = snapshot(project)
    return project, root / "before", clean


@pytest.fixture
def changed_project(crash_site):
    """The project as it was indexed once, with its corpus changed since."""
    project, before, _ = crash_site
    clear_cache()
    shutil.rmtree(project.parent)
    shutil.copytree(before, project.parent)
    return project


@pytest.fixture
def clean(crash_site):
    """What a clean run builds from the changed corpus in the same folder."""
    return crash_site[2]


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_killed_run_converges_to_clean_index(failpoint, changed_project, clean):
    crashed = run_child(changed_project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(changed_project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    after_recovery = snapshot(changed_project)
    assert [c[0] for c in after_recovery["chroma"]] == after_recovery["bm25"] == after_recovery["state_chunks"]
    assert after_recovery == clean


@pytest.fixture
def changed_project_on_postgres(changed_project, postgres):
    """``changed_project`` with its state moved into a PostgreSQL schema of its own, row for row
    (the generation and the chunk log included, so BM25's published version stays in step)."""
    schema = new_schema()
    text = changed_project.read_text()
    changed_project.write_text(text.replace("path: idx/state.sqlite}",
                                            f"path: idx/state.sqlite, url: '{postgres.url}', schema_name: {schema}}}"))
    file = changed_project.parent / "idx" / "state.sqlite"
    state = load_project(changed_project).resource("state")
    source = sqlite3.connect(file)
    with state.transaction() as tx:
        for table in ("meta", "sources", "chunks", "chunk_changes"):
            rows = source.execute(f"SELECT * FROM {table}").fetchall()
            tx.execute(f"DELETE FROM {table}")
            if rows:
                tx.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    source.close()
    file.unlink()
    clear_cache()
    return changed_project


@pytest.mark.parametrize("failpoint", ["index.after_forget:2", "bm25.before_pointer"])
def test_killed_run_on_a_postgres_state_converges_to_clean_index(failpoint, changed_project_on_postgres, clean):
    project = changed_project_on_postgres
    crashed = run_child(project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    assert snapshot(project) == clean
    assert not (project.parent / "idx" / "state.sqlite").exists()


def test_random_kills_converge(changed_project, clean):
    """Kill runs at random moments, several times in a row, then let one finish."""
    kill_at_random(changed_project, seed=7)
    assert run_child(changed_project).returncode == 0
    assert snapshot(changed_project) == clean


def test_a_record_added_to_a_file_is_indexed_after_a_kill_before_its_batch(tmp_path):
    """A JSONL file gains a record: its other records are unchanged, read this run with the file's
    new signal. Killed before the new record's batch is recorded, the next run must still read the
    file: the unchanged records' new signal is recorded only at finalize (``hold_signals``), never
    at plan, where it would make every recorded source of the file vouch for bytes whose new
    record was never indexed (the file would be skipped until it changed again)."""
    from tests.helpers.notes_corpus import HASH_EMBED, age, note_text

    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
    project = tmp_path / "pipelines.yaml"
    project.write_text(HASH_EMBED)
    corpus = tmp_path / "docs" / "records.jsonl"
    corpus.parent.mkdir()
    rows = [{"_id": f"r{i}", "text": note_text(i)} for i in range(3)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    age(corpus, 3600)
    assert run_child(project).returncode == 0
    rows.append({"_id": "added", "text": "A record added later, about okapis."})
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    age(corpus, 1800)
    crashed = run_child(project, failpoints="index.after_forget")  # the added record's batch
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    recovered = run_child(project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    clear_cache()
    loaded = load_project(project)
    state = loaded.resource(loaded.pipeline("index").step("write").resources["state"])
    assert sorted(state.sources()) == [f"docs/records.jsonl#{i}" for i in ("added", "r0", "r1", "r2")]
    again = run_index(project)
    assert (again.added, again.updated, again.unchanged) == (0, 0, 4)
