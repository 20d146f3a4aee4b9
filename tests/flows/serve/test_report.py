"""`ragline report`'s aggregation (counts, rates, histograms, buckets, the period) and its page:
every value from data escaped, nothing loaded from outside, an empty log saying what to turn on."""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from html.parser import HTMLParser

import pytest

from ragline.flows.evaluation.retrieval import EVAL_RUNS, record_run
from ragline.flows.serve.report import (BIN_EDGES_MS, build, histogram, parse_since, percentile, read_eval_runs,
                                        render, summarize)

NOW = datetime(2026, 3, 10, 12, 30, tzinfo=timezone.utc).timestamp()
HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)">'


def _iso(seconds_ago: float) -> str:
    return datetime.fromtimestamp(NOW - seconds_ago, timezone.utc).isoformat().replace("+00:00", "Z")


def _entry(ago: float, status: str = "answered", latency: float = 120.0, **extra) -> dict:
    return {"answer_id": "a" * 32, "time": _iso(ago), "pipeline": "ask", "status": status, "latency_ms": latency,
            "timings": {"retrieve": latency / 4, "answer": latency / 2}, "principal": "key-1", **extra}


def test_counts_rates_latencies_and_buckets_of_the_period():
    entries = [_entry(600), _entry(4000, "refused", 900.0), _entry(4100, "failed", 30.0, pipeline="search"),
               _entry(9 * 86400), {"time": "not a time", "status": "answered"}, "foreign"]
    feedback = [{"time": _iso(500), "rating": "up"}, {"time": _iso(3700), "rating": "down"},
                {"time": _iso(8 * 86400), "rating": "up"}]
    s = summarize([e for e in entries if isinstance(e, dict)], feedback, [], parse_since("1d"), now=NOW)
    assert s.queries == 3 and s.statuses == {"answered": 1, "refused": 1, "failed": 1}  # 9 days ago: out
    assert s.pipelines == {"ask": 2, "search": 1} and s.principals == {"key-1": 3}
    assert sorted(s.latency["overall"]) == [30.0, 120.0, 900.0] and s.latency["answer"] == [60.0, 450.0, 15.0]
    assert s.bucket_seconds == 3600 and len(s.buckets) == 25  # whole hours from a day ago to now
    assert sum(s.status_over_time["refused"]) == 1 and s.status_over_time["answered"][-1] == 1
    assert s.status_over_time["refused"][-2] == 1  # 4000 s before 12:30 is 11:23: the 11:00 bucket
    assert s.feedback_over_time["up"][-1] == 1 and sum(s.feedback_over_time["down"]) == 1
    assert sum(s.feedback_over_time["up"]) == 1
    assert s.slowest[0]["latency_ms"] == 900.0 and [e["status"] for e in s.refusals] == ["refused", "failed"]


def test_all_time_uses_days_and_an_unknown_status_counts_as_failed():
    s = summarize([_entry(30 * 86400), _entry(60, status="weird")], [], [], None, now=NOW)
    assert s.bucket_seconds == 86400 and len(s.buckets) == 31
    assert s.statuses == {"answered": 1, "failed": 1}


def test_histogram_bins_from_their_lower_edge_and_the_last_takes_the_rest():
    counts = histogram([0, 4.9, 5, 99, 100, 70_000])
    assert len(counts) == len(BIN_EDGES_MS) and sum(counts) == 6
    assert counts[0] == 2 and counts[1] == 1 and counts[4] == 1 and counts[5] == 1 and counts[-1] == 1
    assert percentile([1, 2, 3, 4], 0.5) == 3 and percentile([], 0.95) == 0


@pytest.mark.parametrize("bad", ["7", "d", "-1d", "0d", "7y", ""])
def test_since_names_its_flag_when_wrong(bad):
    with pytest.raises(ValueError, match="--since"):
        parse_since(bad)
    assert parse_since("12h") == 43200 and parse_since("all") is None and parse_since("2w") == 14 * 86400


class _Parsed(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)


def test_every_value_from_data_is_escaped():
    hostile = [_entry(60, "refused", question=HOSTILE, pipeline=HOSTILE, principal=HOSTILE,
                      answer={"reason": HOSTILE}, timings={HOSTILE: 3.0}),
               _entry(120, "failed", question="x", error=HOSTILE)]
    runs = [{"time": _iso(100), "dataset": HOSTILE, "pipeline": HOSTILE, "queries": 3, "ndcg@10": 0.5}]
    page = render(summarize(hostile, [{"time": _iso(5), "rating": "up"}], runs, None, now=NOW), HOSTILE)
    parsed = _Parsed()
    parsed.feed(page)
    assert "script" not in parsed.tags and "img" not in parsed.tags
    assert not [name for name, _ in parsed.attrs if name.startswith("on")]
    assert "<script" not in page.lower() and "&lt;script&gt;" in page and "onerror=&quot;" in page
    assert page.count("&lt;img src=x") >= 5  # question, pipeline, principal, reason, error, step, dataset...


def test_the_page_loads_nothing_and_allows_only_its_own_style():
    page = render(summarize([_entry(60)], [], [], None, now=NOW), "/data")
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)[1]
    assert policy.startswith("default-src 'none'; style-src 'sha256-") and "unsafe" not in policy
    assert not re.search(r"(src|href)=|url\(|@import|<script", page, re.I)
    assert page.count("<svg class=\"plot\"") >= 5


def test_an_empty_log_says_what_to_turn_on(tmp_path):
    page = build(tmp_path, parse_since("7d"), now=NOW)
    assert 'id="empty"' in page and "RAGLINE_QUERY_LOG=1" in page and "ragline eval" in page


def test_eval_runs_are_recorded_and_read_back_oldest_first(tmp_path):
    result = {"dataset": "scifact", "pipeline": "search", "queries": 300, "ndcg@10": 0.66, "workspace": "/x"}
    first = record_run(tmp_path, result, "test")
    second = record_run(tmp_path, {**result, "ndcg@10": 0.7}, "test")
    assert first.parent == tmp_path / EVAL_RUNS and first != second
    (tmp_path / EVAL_RUNS / "torn.json").write_text("{")
    runs = read_eval_runs(tmp_path)
    assert [r["ndcg@10"] for r in runs] == [0.66, 0.7] and runs[0]["split"] == "test" and "workspace" not in runs[0]
    assert json.loads(first.read_text())["time"].endswith("Z")


def test_a_judged_run_on_a_generated_test_set_shows_its_scores_beside_retrieval_runs(tmp_path):
    record_run(tmp_path, {"dataset": "scifact", "pipeline": "search", "queries": 300, "ndcg@10": 0.66}, "test")
    record_run(tmp_path, {"dataset": "generated", "kind": "generated", "pipeline": "search", "queries": 20,
                          "hit@10": 0.85, "mrr@10": 0.7, "faithfulness": 0.4321, "answer_relevance": 0.61,
                          "context_relevance": 0.55, "context_relevance_cosine": 0.42}, "generated")
    page = build(tmp_path, parse_since("all"), now=datetime.now(timezone.utc).timestamp())
    table = page.split('id="evaluation"', 1)[1]
    for column in ("hit@10", "faithfulness", "answer_relevance", "context_relevance"):
        assert f"<th>{column}</th>" in table
    assert ">0.4321<" in table and ">0.66<" in table
    plain = tmp_path / "plain"
    record_run(plain, {"dataset": "scifact", "pipeline": "search", "queries": 300, "ndcg@10": 0.66}, "test")
    assert "faithfulness" not in build(plain, parse_since("all"), now=datetime.now(timezone.utc).timestamp())
