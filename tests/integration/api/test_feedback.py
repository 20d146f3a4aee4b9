"""Issue 20 item 3 end to end, on real uvicorn with the scripted LLM: with RAGLINE_QUERY_LOG=1 every
served answer (/v1/query, streamed or not, and the OpenAI route) is logged under its answer id;
POST /v1/feedback rates it; `ragline feedback export` joins the two and writes a BEIR-style folder
that `ragline eval` scores the project's own index on. With the log off nothing is logged."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, events, running

pytestmark = pytest.mark.integration

SECOND = "What does diffusion tensor imaging show in preterm infants?"


@pytest.fixture(scope="module")
def logged(api_project, tmp_path_factory) -> Iterator[tuple[str, Path, object]]:
    """A copy of the indexed project (its own data dir), served with the query log on."""
    from ragline.flows.serve.app import create_app

    folder = tmp_path_factory.mktemp("logged") / "project"
    shutil.copytree(api_project.parent, folder, ignore=shutil.ignore_patterns("feedback", "query-log", "down.yaml"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAGLINE_QUERY_LOG", "1")
        app = create_app(str(folder / "pipelines.yaml"), token=TOKEN)
    with running(app) as url:
        yield url, folder, app.state.service


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cli(*argv: str, capsys) -> str:
    from ragline.flows.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_ask_rate_export_and_evaluate_on_the_export(logged, fresh_script, capsys, tmp_path):
    url, folder, service = logged
    fresh_script.answer = "Diffusion tensor imaging measures it [1]."
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        plain = client.post("/v1/query", json={"question": QUESTION})
        assert plain.status_code == 200 and plain.json()["answer_id"] == plain.headers["x-answer-id"]
        streamed = client.post("/v1/query", json={"question": SECOND, "stream": True})
        final = dict(events(streamed))["answer"]
        assert final["answer_id"] == streamed.headers["x-answer-id"] != plain.json()["answer_id"]
        chat = client.post("/v1/chat/completions", json={"model": "ask", "messages": [
            {"role": "user", "content": QUESTION}]})
        assert chat.json()["answer_id"] == chat.headers["x-answer-id"]
        service.query_log.flush()
        log = {e["answer_id"]: e for e in _lines(folder / ".ragline" / "query-log" / "queries.jsonl")}
        entry = log[plain.json()["answer_id"]]
        assert entry["question"] == QUESTION and entry["pipeline"] == "ask" and entry["status"] == "answered"
        assert entry["answer"]["text"] == "Diffusion tensor imaging measures it [1]."
        assert entry["answer"]["citations"] == [1] and entry["answer"]["verdict"]
        assert len(entry["retrieved"]) == 3 and all(r["score"] and r["doc_id"] for r in entry["retrieved"])
        generation = service.project.resource("state").generation
        assert generation > 0 and entry["index"] == {"state": generation}
        assert entry["latency_ms"] > 0 and entry["timings"]["answer"] > 0
        assert log[final["answer_id"]]["stream"] is True and log[chat.json()["answer_id"]]["surface"] == "chat"

        up = client.post("/v1/feedback", json={"answer_id": plain.json()["answer_id"], "rating": "up",
                                               "comment": "right on"})
        assert up.status_code == 201 and up.json()["known_answer"] is True and len(up.json()["feedback_id"]) == 32
        corrected = log[final["answer_id"]]["retrieved"][-1]["chunk_id"]
        down = client.post("/v1/feedback", json={"answer_id": final["answer_id"], "rating": -1,
                                                 "corrected_passage_ids": [corrected]})
        assert down.status_code == 201 and down.json()["rating"] == "down"
        unknown = client.post("/v1/feedback", json={"answer_id": "f" * 32, "rating": "up"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "answer_id"
        bad = client.post("/v1/feedback", json={"answer_id": plain.json()["answer_id"], "rating": "meh"})
        assert bad.status_code == 422 and bad.json()["error"]["message"].startswith("field 'rating'")
        huge = client.post("/v1/feedback", json={"answer_id": plain.json()["answer_id"], "rating": "up",
                                                 "comment": "x" * 20_000})
        assert huge.status_code == 413

    pipelines = str(folder / "pipelines.yaml")
    out = tmp_path / "feedback.jsonl"
    _cli("feedback", "export", "-f", pipelines, "--out", str(out), capsys=capsys)
    joined = _lines(out)
    assert [(r["answer_id"], r["rating"]) for r in joined] == [(plain.json()["answer_id"], "up"),
                                                              (final["answer_id"], "down")]
    assert joined[0]["comment"] == "right on" and joined[0]["query"]["question"] == QUESTION
    assert joined[1]["query"]["retrieved"] and joined[1]["corrected_passage_ids"] == [corrected]

    qrels = tmp_path / "qrels"
    _cli("feedback", "export", "-f", pipelines, "--qrels", str(qrels), "--test-share", "1", capsys=capsys)
    test_rows = (qrels / "qrels" / "test.tsv").read_text().splitlines()[1:]
    assert (qrels / "qrels" / "train.tsv").read_text().splitlines()[1:] == []
    cited = log[plain.json()["answer_id"]]["answer"]["sources"][0]["doc_id"]
    assert {row.split("\t")[1] for row in test_rows if row.endswith("\t1")} >= {cited}
    assert len(_lines(qrels / "queries.jsonl")) == 2

    result = json.loads(_cli("eval", "-f", pipelines, "--dataset", str(qrels), "-p", "search", "--json",
                             capsys=capsys))
    assert result["queries"] == 2 and result["workspace"] is None
    assert result["recall@100"] > 0 and 0 < result["ndcg@10"] <= 1


def test_the_export_splits_by_question_and_keeps_splits_apart(logged, capsys, tmp_path):
    """Train (for tune) and test (for eval) never share a question."""
    _, folder, _ = logged
    qrels = tmp_path / "qrels"
    _cli("feedback", "export", "-f", str(folder / "pipelines.yaml"), "--qrels", str(qrels), "--test-share", "0.5",
         capsys=capsys)
    train = {r.split("\t")[0] for r in (qrels / "qrels" / "train.tsv").read_text().splitlines()[1:]}
    test = {r.split("\t")[0] for r in (qrels / "qrels" / "test.tsv").read_text().splitlines()[1:]}
    assert not train & test and train | test


def test_the_train_split_is_what_tune_trains_on(logged, capsys, tmp_path):
    """`ragline tune --set pairs.labelled=DIR`: the rated questions come first, with their sources."""
    from ragline.flows.context import StepContext
    from ragline.tasks.ingest.pseudo_queries import Params, pseudo_queries

    _, folder, service = logged
    export = tmp_path / "export"
    _cli("feedback", "export", "-f", str(folder / "pipelines.yaml"), "--qrels", str(export), "--test-share", "0",
         capsys=capsys)
    assert (export / "qrels" / "test.tsv").read_text().splitlines()[1:] == []
    ctx = StepContext(pipeline="tune", step_id="pairs", base_dir=str(folder))
    pairs = pseudo_queries.fn(params=Params(n=6, labelled=str(export)), ctx=ctx,
                              state=service.project.resource("state"))
    labelled = [p for p in pairs if p.strategy == "feedback"]
    assert labelled and pairs[:len(labelled)] == labelled and len(pairs) == 6
    assert {p.text for p in labelled} == {QUESTION, SECOND}


def test_with_the_log_off_nothing_is_logged(served, api_project):
    with httpx.Client(base_url=served, headers=AUTH, timeout=120) as client:
        response = client.post("/v1/query", json={"question": QUESTION})
        assert response.status_code == 200 and len(response.json()["answer_id"]) == 32
    assert not (api_project.parent / ".ragline" / "query-log").exists()


def test_a_failed_query_is_logged_as_failed_and_cannot_be_rated(logged, scripted_llm):
    url, folder, service = logged
    scripted_llm.status = 500
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            failed = client.post("/v1/query", json={"question": "a question the LLM cannot answer now"})
    finally:
        scripted_llm.status = 200
    assert failed.status_code >= 500 and "x-answer-id" not in failed.headers
    service.query_log.flush()
    entry = _lines(folder / ".ragline" / "query-log" / "queries.jsonl")[-1]
    assert entry["question"] == "a question the LLM cannot answer now"
    assert entry["status"] == "failed" and entry["error"] and "answer" not in entry
