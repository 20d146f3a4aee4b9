"""The query log's files (rotation by size and age, retention, ids-only mode, never blocking) and
the feedback request's validation, without a server."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from ragline.flows.contracts import Answer, Passage, Query, Source
from ragline.flows.serve.routers.feedback import FeedbackRequest, FeedbackStore
from ragline.flows.serve.query_log import BACKUPS, BoundedJsonl, QueryLog, describe_run, files_of, read_lines

ANSWER_ID = "0123456789abcdef0123456789abcdef"


def _entry(n: int, **extra) -> dict:
    return {"answer_id": f"{n:032x}", "time": "2026-01-01T00:00:00.000Z", "status": "answered", **extra}


def test_the_log_rotates_by_size_and_keeps_every_file_under_its_share(tmp_path):
    log = QueryLog(tmp_path, max_bytes=(BACKUPS + 1) * 2000, retention_days=30, text=True)
    for n in range(400):
        log.record(_entry(n, question="x" * 200))
    log.flush()
    files = files_of(log.path)
    assert len(files) > 3, "the active file should have rolled over"
    assert all(f.stat().st_size <= 2000 + 400 for f in files)  # one line beyond the share at most
    kept = [e["answer_id"] for e in read_lines(log.path)]
    assert kept == sorted(kept) and kept[-1] == f"{399:032x}"  # oldest file first, newest line last
    log.close()


def test_the_total_stays_bounded_the_oldest_lines_go(tmp_path):
    log = QueryLog(tmp_path, max_bytes=(BACKUPS + 1) * 1000, retention_days=30, text=True)
    for n in range(3000):
        log.record(_entry(n, question="y" * 100))
    log.flush(timeout_seconds=120)  # ~375 rolls: seconds on a loaded machine (it checks bounds, not speed)
    total = sum(f.stat().st_size for f in files_of(log.path))
    assert total <= (BACKUPS + 1) * (1000 + 200)
    ids = [e["answer_id"] for e in read_lines(log.path)]
    assert f"{0:032x}" not in ids and f"{2999:032x}" in ids
    log.close()


def test_rolled_files_older_than_the_retention_are_deleted(tmp_path):
    path = tmp_path / "queries.jsonl"
    old, recent = path.with_name("queries.jsonl.2"), path.with_name("queries.jsonl.1")
    for file in (old, recent):
        file.write_text(json.dumps(_entry(1)) + "\n")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    BoundedJsonl(path, max_bytes=10_000, backups=BACKUPS, retention_seconds=2 * 86400).close()
    assert not old.exists() and recent.exists()


def test_the_active_file_rolls_once_its_first_line_is_too_old(tmp_path):
    path = tmp_path / "queries.jsonl"
    path.write_text(json.dumps({**_entry(1), "time": "2020-01-01T00:00:00.000Z"}) + "\n")
    os.utime(path, (time.time() - 10 * 86400,) * 2)
    handler = BoundedJsonl(path, max_bytes=10**6, backups=BACKUPS, retention_seconds=5 * 86400,
                           roll_seconds=86400)
    handler.write(json.dumps(_entry(2)))
    handler.close()
    assert [json.loads(line)["answer_id"] for line in path.read_text().splitlines()] == [f"{2:032x}"]
    assert not path.with_name("queries.jsonl.1").exists(), "rolled, then deleted: its only line was 10 days old"


def _run_outputs() -> tuple[Answer, dict]:
    passages = [Passage(chunk_id=f"c{i}", source_id=f"docs/corpus.jsonl#{i}", text="secret passage", score=1 / (i + 1),
                        metadata={"doc_id": str(i)}) for i in range(3)]
    query = Query(text="what is secret?", variants=["what is secret?", "secret meaning"])
    answer = Answer(question="what is secret?", text="It is secret [1].", citations=[1], verdict="supported",
                    sources=[Source(number=1, chunk_id="c1", source_id="docs/corpus.jsonl#1", passage="secret passage")])
    return answer, {"rewrite": query, "fuse": passages, "answer": answer}


def test_an_entry_records_rewrites_retrieved_ids_scores_and_citations():
    answer, outputs = _run_outputs()
    entry: dict = {}
    describe_run(entry, answer, outputs, "what is secret?", text=True)
    assert entry["rewritten"] == ["secret meaning"]
    assert [(r["chunk_id"], r["doc_id"]) for r in entry["retrieved"]] == [("c0", "0"), ("c1", "1"), ("c2", "2")]
    assert entry["retrieved"][1]["score"] == 0.5
    assert entry["answer"]["sources"] == [{"number": 1, "chunk_id": "c1", "source_id": "docs/corpus.jsonl#1",
                                           "doc_id": "1"}]
    assert entry["answer"]["text"] == "It is secret [1]." and entry["answer"]["verdict"] == "supported"


def test_ids_only_mode_keeps_no_text(tmp_path):
    answer, outputs = _run_outputs()
    entry = _entry(7)
    describe_run(entry, answer, outputs, "what is secret?", text=False)
    log = QueryLog(tmp_path, max_bytes=10**6, retention_days=30, text=False)
    log.record(entry)
    log.close()
    line = log.path.read_text()
    assert "secret" not in line, line
    assert '"chunk_id":"c1"' in line and '"citations":[1]' in line


def test_recording_never_waits_for_the_disk(tmp_path):
    log = QueryLog(tmp_path, max_bytes=10**6, retention_days=30, text=True)
    stuck = threading.Event()
    log._writer.submit(stuck.wait)  # the writer thread is busy (a slow disk) until the end
    recording = threading.Thread(target=lambda: [log.record(_entry(n)) for n in range(1000)], daemon=True)
    recording.start()
    recording.join(60)  # not a timing: a record that waited for the disk would wait forever
    assert not recording.is_alive() and not stuck.is_set()
    stuck.set()
    log.flush()
    assert len(list(read_lines(log.path))) == 1000
    log.close()


def test_feedback_knows_logged_answers_also_after_a_restart(tmp_path):
    log = QueryLog(tmp_path, max_bytes=10**6, retention_days=30, text=True)
    log.record(_entry(5))
    assert log.knows(f"{5:032x}") and not log.knows(ANSWER_ID)
    log.close()
    again = QueryLog(tmp_path, max_bytes=10**6, retention_days=30, text=True)
    assert again.knows(f"{5:032x}")
    again.close()


@pytest.mark.parametrize("body, field", [
    ({"rating": "up"}, "answer_id"),
    ({"answer_id": "not-an-id", "rating": "up"}, "answer_id"),
    ({"answer_id": ANSWER_ID, "rating": "sideways"}, "rating"),
    ({"answer_id": ANSWER_ID, "rating": True}, "rating"),
    ({"answer_id": ANSWER_ID, "rating": 2}, "rating"),
    ({"answer_id": ANSWER_ID, "rating": "up", "comment": "x" * 2001}, "comment"),
    ({"answer_id": ANSWER_ID, "rating": "up", "corrected_passage_ids": ["c"] * 21}, "corrected_passage_ids"),
    ({"answer_id": ANSWER_ID, "rating": "up", "corrected_passage_ids": [""]}, "corrected_passage_ids"),
    ({"answer_id": ANSWER_ID, "rating": "up", "stars": 5}, "stars"),
])
def test_feedback_validation_names_the_field(body, field):
    with pytest.raises(ValidationError) as caught:
        FeedbackRequest.model_validate(body)
    assert caught.value.errors()[0]["loc"][0] == field


def test_feedback_accepts_words_and_numbers():
    for rating in ("up", "down", 1, -1):
        FeedbackRequest.model_validate({"answer_id": ANSWER_ID, "rating": rating, "corrected_passage_ids": ["c1"]})


def test_feedback_per_answer_and_rate_limits(tmp_path):
    from ragline.flows.serve.query_service import ApiError

    store = FeedbackStore(tmp_path, 10**6, text=True)
    for _ in range(10):
        store.admit(ANSWER_ID)
    with pytest.raises(ApiError) as caught:
        store.admit(ANSWER_ID)
    assert caught.value.status == 429 and caught.value.param == "answer_id"
    with pytest.raises(ApiError) as caught:
        for n in range(200):
            store.admit(f"{n:032x}")
    assert caught.value.status == 429 and caught.value.headers["Retry-After"] == "1"


def test_a_failed_feedback_write_is_an_error_not_a_silent_loss(tmp_path):
    store = FeedbackStore(tmp_path, 10**6, text=True)
    store.path.mkdir()  # the file cannot be opened (as root too)
    with pytest.raises(OSError):
        store.append({"x": 1})
