"""Ordinary mistakes never delete indexed documents (issue 10): each test failed on 8d4ef3a."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.data import REPO, index_and_search_yaml, milvus_yaml, scifact_records, write_jsonl
from tests.helpers.harness import snapshot

pytestmark = pytest.mark.integration

OKAPI = "Okapi BM25 ranks documents by term frequency saturation and document length normalisation."


@pytest.fixture
def project(make_project, tmp_path, request):
    """The standard project; parametrized ``milvus``: the same with one milvus resource (both roles)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text(OKAPI)
    text = index_and_search_yaml()
    if getattr(request, "param", "chroma") == "milvus":
        pytest.importorskip("milvus_lite")
        text = milvus_yaml(batch_size=256)
    path = make_project(text)
    yield path
    clear_cache()


# The mistakes a store could turn into deletions, on both index backends.
BOTH_BACKENDS = pytest.mark.parametrize("project", ["chroma", "milvus"], indirect=True)


def index(project: Path, *extra: str) -> int:
    return main(["index", "-f", str(project), "--no-prefect", *extra])


def hits(project: Path, capsys, text: str = "okapi") -> list[str]:
    capsys.readouterr()
    assert main(["search", text, "-f", str(project), "--json"]) == 0
    return [h["source_id"] for h in json.loads(capsys.readouterr().out)]


def test_query_commands_refuse_an_ingestion_pipeline(project, tmp_path, capsys):
    assert index(project) == 0
    (tmp_path / "docs" / "b.txt").unlink()  # an ingestion run now would delete it

    assert main(["search", "okapi", "-p", "index", "-f", str(project)]) == 2
    assert "pipeline 'index' is an ingestion pipeline; this needs a query pipeline" in capsys.readouterr().err
    assert main(["ask", "okapi", "-p", "index", "-f", str(project)]) == 2
    assert main(["eval", "--dataset", str(tmp_path), "-p", "index", "-f", str(project)]) == 2
    assert main(["index", "-p", "search", "-f", str(project)]) == 2
    (tmp_path / "docs" / "b.txt").write_text(OKAPI)
    assert hits(project, capsys) == ["docs/b.txt"]


def test_run_says_what_an_ingestion_pipeline_will_do(project, tmp_path, capsys):
    assert main(["run", "index", "-f", str(project), "--no-prefect"]) == 0
    err = capsys.readouterr().err
    assert f"running ingestion pipeline 'index': indexes docs (relative to {tmp_path})" in err
    assert "removes documents no longer found there" in err


@BOTH_BACKENDS
def test_a_moved_folder_deletes_nothing_and_fails(project, tmp_path, capsys):
    docs = tmp_path / "docs"
    assert main(["index", str(docs), "-f", str(project), "--no-prefect"]) == 0
    docs.rename(tmp_path / "docs_moved")

    assert main(["index", str(docs), "-f", str(project), "--no-prefect"]) == 1
    captured = capsys.readouterr()
    assert "deleted 0" in captured.out
    assert "could not be reached (docs): nothing was deleted" in captured.err  # the root, by its name
    assert hits(project, capsys) == ["docs/b.txt"]


@BOTH_BACKENDS
def test_another_roots_documents_survive_a_run_on_the_pipelines_own_paths(project, tmp_path, capsys):
    """`ragline quickstart` (the pipeline's own paths) after indexing a folder of one's own."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("# Notes\n\nOkapi weighting notes of my own.\n")
    assert main(["index", str(mine), "-f", str(project), "--no-prefect"]) == 0

    assert index(project) == 0

    assert "deleted 0" in capsys.readouterr().out
    assert sorted(hits(project, capsys)) == sorted(["docs/b.txt", "mine/notes.md"])


@BOTH_BACKENDS
def test_a_deleted_file_under_a_listed_root_is_still_removed(project, tmp_path, capsys):
    (tmp_path / "docs" / "c.txt").write_text("Okapi is also an animal related to the giraffe.")
    assert index(project) == 0
    (tmp_path / "docs" / "c.txt").unlink()

    assert index(project) == 0

    assert "deleted 1" in capsys.readouterr().out
    assert hits(project, capsys) == ["docs/b.txt"]


@BOTH_BACKENDS
def test_jsonl_records_survive_a_bad_byte_and_a_broken_line(project, tmp_path, capsys):
    records = scifact_records(3)
    corpus = write_jsonl(tmp_path / "docs" / "corpus.jsonl", records)
    assert index(project) == 0
    before = snapshot(project)

    lines = corpus.read_bytes().split(b"\n")
    corpus.write_bytes(b"\n".join([lines[0], lines[1][:-5] + b"\xff\"}", lines[2], b""]))  # undecodable
    assert index(project) == 3
    assert snapshot(project) == before

    lines[1] = b'{"_id": "broken", "text": '  # one line turns invalid JSON
    corpus.write_bytes(b"\n".join(lines))
    assert index(project) == 3
    assert "deleted 0" in capsys.readouterr().out
    assert snapshot(project) == before


@contextmanager
def lease_held_elsewhere(project: Path, holder: str = "a scheduled run") -> Iterator[threading.Event]:
    """Another writer holds the index's lease until the yielded event is set."""
    state = load_project(project).resource("state")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with state.lease(holder):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        yield release
    finally:
        release.set()
        thread.join()


@pytest.mark.parametrize("state_backend", ["sqlite", "postgres"], indirect=True)
def test_a_second_run_fails_clearly_with_no_wait(project, capsys):
    with lease_held_elsewhere(project):
        assert index(project, "--no-wait") == 75
    assert "is being written by a scheduled run (pid" in capsys.readouterr().err
    assert index(project, "--no-wait") == 0


def test_a_second_run_waits_visibly_for_the_first(project, caplog):
    with lease_held_elsewhere(project) as release:
        threading.Timer(1.5, release.set).start()
        assert index(project) == 0
    assert "waiting: the index is being written by a scheduled run (pid" in caplog.text


def test_a_lease_left_by_a_killed_run_is_taken_over(project):
    state = load_project(project).resource("state")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with state.transaction() as tx:
        tx.execute("INSERT INTO lease VALUES ('writer', 'killed run', ?, ?, 't', ?, ?)",
                   (int(dead.stdout), __import__("socket").gethostname(), time.time(), time.time()))
    assert index(project, "--no-wait") == 0


def test_two_runs_started_together_wait_for_each_other_and_count_truly(project, tmp_path):
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(30))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
    command = [sys.executable, "-m", "ragline.flows.cli", "index", "-f", str(project), "--no-prefect", "--allow-skipped"]
    runs = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]

    assert [run.returncode for run in runs] == [0, 0], outputs
    summaries = sorted(out.strip().splitlines()[-1].split(": ", 1)[1].split(" in ")[0] for out, _ in outputs)
    assert summaries[0].startswith("added 0, updated 0, deleted 0, unchanged 31")  # the one that waited
    assert summaries[1].startswith("added 31, updated 0, deleted 0, unchanged 0")
    together = snapshot(project)
    clean = project.parent / "clean"
    clean.mkdir()
    (clean / "pipelines.yaml").write_text(project.read_text().replace("[docs]", f"[{tmp_path / 'docs'}]"))
    (clean / "prompts").mkdir()
    assert index(clean / "pipelines.yaml") == 0
    assert snapshot(clean / "pipelines.yaml") == together


def test_eval_never_writes_the_configured_index_even_with_absolute_paths(make_project, tmp_path, capsys):
    idx = tmp_path / "abs-index"
    yaml_text = index_and_search_yaml().replace("path: idx/", f"path: {idx}/")
    project = make_project(yaml_text)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text(OKAPI)
    assert index(project) == 0
    before = snapshot(project)
    beir = tmp_path / "beir"
    records = scifact_records(20)
    write_jsonl(beir / "corpus.jsonl", records)
    write_jsonl(beir / "queries.jsonl", [{"_id": "q1", "text": records[0]["title"]}])
    (beir / "qrels").mkdir()
    (beir / "qrels" / "test.tsv").write_text(f"query-id\tcorpus-id\tscore\nq1\t{records[0]['_id']}\t1\n")
    capsys.readouterr()

    assert main(["eval", "--dataset", str(beir), "-f", str(project), "--json"]) == 0

    assert json.loads(capsys.readouterr().out)["recall@100"] == 1.0
    assert snapshot(project) == before


def test_data_dir_points_every_command_at_another_index(project, tmp_path, capsys):
    other = tmp_path / "elsewhere"
    assert index(project, "--data-dir", str(other)) == 0
    assert (other / "idx" / "state.sqlite").is_file() and not (tmp_path / "idx").exists()
    capsys.readouterr()
    assert main(["search", "okapi", "-f", str(project), "--data-dir", str(other), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1
