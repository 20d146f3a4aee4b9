"""The ragline command on real data: index, search, run, eval, quickstart."""
from __future__ import annotations

import csv
import json
from datetime import datetime, timezone

import pytest

from ragline.flows.cli import main
from tests.helpers.data import SCIFACT, scifact_records, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture
def mini_beir(tmp_path):
    """5 judged SciFact test queries, their gold abstracts and 25 other abstracts, in BEIR layout."""
    with open(SCIFACT / "qrels" / "test.tsv", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t"))[1:]
    judged: dict[str, set[str]] = {}
    for qid, doc, _ in rows:
        judged.setdefault(qid, set()).add(doc)
    chosen = dict(list(judged.items())[:5])
    gold = set().union(*chosen.values())
    records = [r for r in scifact_records(5183) if r["_id"] in gold] + scifact_records(25)
    folder = tmp_path / "mini"
    write_jsonl(folder / "corpus.jsonl", records)
    with open(SCIFACT / "queries.jsonl") as handle:
        queries = [json.loads(line) for line in handle if json.loads(line)["_id"] in chosen]
    write_jsonl(folder / "queries.jsonl", queries)
    (folder / "qrels").mkdir()
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, docs in chosen.items() for d in docs))
    return folder


def test_index_search_and_run(index_project, tmp_path, capsys):
    project = index_project()
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(8))
    assert main(["index", "-f", str(project), "--no-prefect"]) == 0
    assert "added 8, updated 0, deleted 0, unchanged 0, failed 0" in capsys.readouterr().out
    title = scifact_records(8)[2]["title"]
    assert main(["search", title, "-f", str(project), "--json", "-k", "3"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 3 and hits[0]["title"] == title and hits[0]["score"] > 0
    assert main(["search", title, "-f", str(project), "-k", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("1. [") and title in printed and "corpus.jsonl" in printed
    assert main(["run", "search", "-f", str(project), "--no-prefect", "--input", json.dumps({"query": title}),
                 "--set", "fuse.top_k=2"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


def test_index_reports_skipped_files(index_project, tmp_path, capsys):
    project = index_project()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("# Fine\n\nA readable note about ribosomes.\n")
    (tmp_path / "docs" / "bad.txt").write_bytes(b"\x00\x01\x02binary")
    assert main(["index", "-f", str(project), "--no-prefect"]) == 3  # completed, with documents skipped
    captured = capsys.readouterr()
    assert "added 1" in captured.out and "failed 1" in captured.out
    assert "bad.txt: binary content" in captured.err
    assert f"sources: {tmp_path / 'docs'}\n" in captured.err  # absolute: where to look on disk (issue 24)
    assert main(["index", "-f", str(project), "--no-prefect", "--allow-skipped"]) == 0


def test_bad_override_is_a_clear_error(index_project, capsys):
    project = index_project()
    assert main(["run", "search", "-f", str(project), "--set", "fuse.top_k=zero", "--input", '{"query": "x"}']) == 2
    assert "step 'fuse', field 'with.top_k'" in capsys.readouterr().err


def test_eval_json_on_a_small_beir_dataset(make_project, mini_beir, capsys):
    from tests.helpers.data import index_and_search_yaml

    project = make_project(index_and_search_yaml())
    assert main(["eval", "--dataset", str(mini_beir), "-f", str(project), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["queries"] == 5 and set(result) >= {"ndcg@10", "recall@100", "mrr@10", "map@10", "p@10"}
    assert result["ndcg@10"] > 0.5 and result["recall@100"] == 1.0  # the gold abstracts are in a 30-doc corpus




def _eval_runs_and_artifacts(since):
    """The eval flow runs created after ``since`` (other tests of the session make some too), with
    their artifacts."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowFilter,
                                                FlowFilterName)

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["ragline-eval"])))
            return [(run, await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))) for run in runs if run.created > since]

    return asyncio.run(read())


def test_an_eval_run_is_a_flow_run_with_its_report_beside_it(prefect_server, make_project, mini_beir, capsys):
    """Issue 20.5: with a Prefect API configured, `ragline eval` is one flow run whose markdown
    artifact has the metrics, the dataset and split, the counts and a plot; --no-prefect makes none."""
    from tests.helpers.data import index_and_search_yaml

    project = make_project(index_and_search_yaml())
    started = datetime.now(timezone.utc)
    assert main(["eval", "--dataset", str(mini_beir), "-f", str(project), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ((run, artifacts),) = _eval_runs_and_artifacts(started)
    assert run.name == "eval mini test search" and run.state_type.value == "COMPLETED"
    assert [a.key for a in artifacts] == ["ragline-eval-mini-search"] and artifacts[0].type == "markdown"
    markdown = artifacts[0].data
    assert markdown.startswith("# Evaluation mini \\(test\\): pipeline search") and "5 queries" in markdown
    for metric in ("ndcg@10", "recall@100", "mrr@10"):
        assert f"| {metric} | {result[metric]:.4f} |".replace(".", "\\.") in markdown
    assert "![queries by nDCG@10 \\(5 queries\\)](data:image/svg+xml;base64," in markdown
    before = datetime.now(timezone.utc)
    assert main(["eval", "--dataset", str(mini_beir), "-f", str(project), "--json", "--no-prefect"]) == 0
    assert _eval_runs_and_artifacts(before) == []


def test_the_console_script_ends_a_query_whole_and_cleans_up(index_project, tmp_path):
    """`ragline search` as installed (``run``: a query command exits without the interpreter's
    teardown): everything printed arrives, the status is the command's, and what atexit handlers
    clean up (the reading copy of the store) is gone; an error keeps its status and message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    project = index_project()
    records = scifact_records(6)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", records)
    assert main(["index", "-f", str(project), "--no-prefect"]) == 0
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "RAGLINE_START_LLM": "0"}
    env.pop("PREFECT_API_URL", None)
    script = str(Path(sys.executable).parent / "ragline")
    found = subprocess.run([script, "search", records[3]["title"], "-f", str(project), "--json", "-k", "6"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    hits = json.loads(found.stdout)  # the whole of it: nothing cut at the exit
    assert len(hits) == 6 and hits[0]["title"] == records[3]["title"]
    assert not list(temp.glob("ragline-read-*")), "the reading copy outlived the command"
    wrong = subprocess.run([script, "search", "x", "-p", "serch", "-f", str(project)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "no pipeline 'serch'" in wrong.stderr
