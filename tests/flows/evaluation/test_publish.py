"""An evaluation's report as dashboard markdown: metrics, counts, a plot; data never becomes markup."""
from __future__ import annotations

import base64
import math
import re
import xml.etree.ElementTree as ElementTree

import pytest

from ragline.flows.evaluation import publish
from ragline.flows.evaluation.retrieval import ndcg_per_query
from ragline.flows.run.artifacts import cell

HOSTILE = "[x](http://evil.example) <img src=x onerror=alert(1)> ![p](http://t.example/p.png)\n# h | c"


def _images(markdown: str) -> list[ElementTree.Element]:
    """Every embedded plot, parsed (a plot that is not well-formed SVG fails here)."""
    found = re.findall(r"^!\[[^\n]*?\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)$", markdown, re.M)
    return [ElementTree.fromstring(base64.b64decode(data)) for data in found]


def _unescaped(text: str, char: str) -> int:
    return len(re.findall(r"(?<!\\)" + re.escape(char), text))


BEIR = {"dataset": "scifact", "pipeline": "search", "queries": 4, "ndcg@10": 0.61234, "recall@100": 0.9,
        "mrr@10": 0.5, "map@10": 0.45, "p@10": 0.1, "overlay": None, "overlay_changes": [], "query_ms_mean": 12.5,
        "index_summary": "added 30, updated 0", "index_seconds": 3.2,
        "per_query": {"ndcg@10": [0.0, 0.35, 1.0, 0.95]}}


def test_a_beir_run_shows_its_metrics_dataset_split_counts_and_the_spread_of_ndcg():
    markdown = publish.evaluation_markdown(BEIR, "beir", "test")
    assert markdown.startswith("# Evaluation scifact \\(test\\): pipeline search")
    for row in ("| ndcg@10 | 0\\.6123 |", "| recall@100 | 0\\.9000 |", "| mrr@10 | 0\\.5000 |", "| p@10 | 0\\.1000 |"):
        assert row in markdown
    assert "4 queries, 12\\.5 ms per query" in markdown and "added 30, updated 0 in 3\\.2 s" in markdown
    (plot,) = _images(markdown)
    bars = [float(r.get("height")) for r in plot.iter("{http://www.w3.org/2000/svg}rect")][1:]  # the background first
    assert len(bars) == 10 and [i for i, h in enumerate(bars) if h > 0] == [0, 3, 9]  # 0.0 | 0.35 | 0.95 and 1.0
    assert bars[9] == pytest.approx(2 * bars[0])


def test_a_judged_test_set_shows_the_judge_scores_and_two_plots():
    result = {"dataset": "generated", "kind": "generated", "pipeline": "search", "queries": 3, "hit@10": 0.6667,
              "mrr@10": 0.5, "query_ms_mean": 8.0, "per_query": {"rank": [1, 4, None]}, "answer_pipeline": "ask",
              "judge_model": "qwen", "faithfulness": 0.8, "answer_relevance": 0.7, "context_relevance": None,
              "context_relevance_cosine": 0.4,
              "judge": {"items": 3, "claims": 5, "refused": 1, "unreadable": 2, "llm_calls": 12, "seconds": 1.5,
                        "supported_claims": 0.6},
              "items": [{"faithfulness": 0.9}, {"faithfulness": 0.1}, {"faithfulness": None}]}
    markdown = publish.evaluation_markdown(result, "generated", "generated")
    for row in ("| hit@10 | 0\\.6667 |", "| faithfulness | 0\\.8000 |", "| context\\_relevance | \\- |",
                "| supported\\_claims | 0\\.6000 |"):
        assert row in markdown
    assert "Judged by qwen" in markdown and "1 refusals, 2 unreadable verdicts, 12 LLM calls" in markdown
    ranks, faithfulness = _images(markdown)
    assert "source document" in "".join(ranks.itertext()) and "faithfulness" in "".join(faithfulness.itertext())


def test_an_rgb_run_shows_the_answer_metrics_per_corpus_and_the_fact_check():
    result = {"dataset": "en.json", "pipeline": "ask", "questions": 2, "model": "qwen",
              "positive": {"accuracy": 0.5, "refusal_rate": 0.0}, "negative": {"accuracy": 0.0, "refusal_rate": 1.0},
              "positive_wrong": {"accuracy": 0.5, "refusal_rate": 0.5, "fake_answer_rate": 0.5},
              "fact_check": {"claims": 2, "as_configured": {"balanced_accuracy": 0.75}}}
    markdown = publish.evaluation_markdown(result, "answers")
    assert "| positive | 0\\.5000 | 0\\.0000 | \\- |" in markdown and "| positive\\_wrong | 0\\.5000 | 0\\.5000 | 0\\.5000 |" \
        in markdown
    assert "## Fact check (2 claims)" in markdown and "| as\\_configured | 0\\.7500 |" in markdown
    assert len(_images(markdown)) == 1


def test_names_from_the_data_stay_text_in_the_markdown_and_the_plot():
    result = {**BEIR, "dataset": HOSTILE, "pipeline": HOSTILE, "overlay": HOSTILE, "overlay_changes": ["a"]}
    markdown = publish.evaluation_markdown(result, "beir", HOSTILE)
    text = "\n".join(line for line in markdown.splitlines() if not line.startswith("!["))
    assert text.count(cell(HOSTILE)) >= 2 and "\\<img" in text  # the pipeline, the overlay (the title is cut)
    for raw in ("](http", "![p]", "[x]", "\n# h"):  # no link, image or heading from the data
        assert raw not in text, raw
    assert _unescaped(text, "<") == _unescaped(text, ">") == 0  # nor a tag
    assert all(_unescaped(line, "|") == 0 for line in text.splitlines() if not line.startswith("|"))
    (plot,) = _images(markdown)  # well-formed: no element came from the data
    assert {e.tag.split("}")[1] for e in plot.iter()} <= {"svg", "rect", "line", "text"}


def test_ndcg_per_query_matches_the_mean_and_counts_empty_runs_as_zero():
    qrels = {"q1": {"d1": 1, "d2": 1}, "q2": {"d9": 1}, "q3": {"d1": 1}}
    run = {"q1": {"d3": 4.0, "d1": 3.0, "d4": 2.0, "d2": 1.0}, "q2": {"d9": 2.0}}
    ndcg_q1 = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert ndcg_per_query(run, qrels) == [pytest.approx(ndcg_q1, abs=1e-4), 1.0, 0.0]


def test_nothing_is_published_outside_a_flow_run():
    assert publish.publish(BEIR, "beir", "test") is None


@pytest.fixture
def unreachable_prefect(monkeypatch):
    """A configured Prefect API on a loopback port nothing listens on, and no retries of it."""
    import socket

    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with socket.socket() as sock:  # bound, never listening: refused, and no other server takes the port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api",
                                         PREFECT_CLIENT_MAX_RETRIES: 0}):
            yield


def test_an_unreachable_configured_api_leaves_the_evaluation_in_process_with_a_warning(unreachable_prefect, caplog):
    calls: list[int] = []
    result = publish.run(lambda: calls.append(1) or {"ndcg@10": 0.5}, kind="beir",
                         settings={"dataset": "d", "pipeline": "search"}, as_flow=True, required=False)
    assert result == {"ndcg@10": 0.5} and calls == [1]  # the evaluation ran once, without a flow run
    assert "evaluation runs without a flow run" in caplog.text


def test_an_unreachable_api_the_user_asked_for_is_an_error(unreachable_prefect):
    calls: list[int] = []
    with pytest.raises(Exception):
        publish.run(lambda: calls.append(1) or {}, kind="beir", settings={}, as_flow=True, required=True)
    assert calls == []
