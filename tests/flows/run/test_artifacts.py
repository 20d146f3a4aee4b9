"""A run's report as dashboard markdown: counts, failures, tuning choices; data never becomes markup."""
from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ElementTree

from ragline.flows.contracts import AdaptReport, Failure, IndexReport, TuneReport
from ragline.flows.run import artifacts

HOSTILE = "[click](http://evil.example/x) <img src=x onerror=alert(1)> ![p](http://t.example/p.png)\n# heading | cell"


def _unescaped(markdown: str, char: str) -> int:
    return len(re.findall(r"(?<!\\)" + re.escape(char), markdown))


def test_a_hostile_document_name_and_reason_stay_text():
    report = IndexReport(added=3, failed=1, failures=[Failure(source_id=HOSTILE, stage="convert", reason=HOSTILE)])
    markdown = artifacts.ingestion_markdown("index", report)
    body = markdown.split("## Failed documents", 1)[1]
    assert "\\[click\\]\\(http://evil\\.example/x\\)" in body and "\\<img" in body
    for char in "[]()<>!#":  # no link, image, HTML tag or heading can come from the data
        assert _unescaped(body, char) == 0, char
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 and all(_unescaped(r, "|") == 5 for r in rows)  # the newline and the pipe stay in one cell


def test_counts_roots_and_an_incomplete_run_are_shown():
    report = IndexReport(added=2, updated=1, deleted=4, unchanged=7, chunks_written=9, chunks_deleted=5, seconds=1.25,
                         roots=["docs"], failures=[Failure(source_id="s3://b/docs", stage="load", reason="timeout",
                                                           root=True)])
    markdown = artifacts.ingestion_markdown("index", report)
    assert "| 2 | 1 | 4 | 7 | 0 | 9 | 5 | 1\\.2 |" in markdown or "| 2 | 1 | 4 | 7 | 0 | 9 | 5 | 1\\.3 |" in markdown
    assert "**incomplete**" in markdown and "root unreachable" in markdown and "| docs |" in markdown


def test_long_failure_lists_and_values_are_cut():
    failures = [Failure(source_id=f"doc{i}" + "x" * 500, stage="chunk", reason="no text") for i in range(80)]
    markdown = artifacts.ingestion_markdown("index", IndexReport(failed=80, failures=failures))
    assert len(re.findall(r"^\| doc\d", markdown, re.M)) == artifacts.MAX_ROWS and "30 more not shown" in markdown
    assert max(len(line) for line in markdown.splitlines() if not line.startswith("![")) < 400  # but the plot


def test_tuning_and_adaptation_reports_render():
    tune = TuneReport(metric="ndcg@10", pairs=40, chunks=100, reason="fusion wins", rule="significant gain",
                      gain_interval=[0.01, 0.05])
    markdown = artifacts.tuning_markdown("tune", tune)
    assert "ndcg@10" in markdown and "fusion wins" in markdown and "[+0.0100, +0.0500]" in markdown
    adapt = AdaptReport(model_path="/m", base_model="all-MiniLM-L6-v2", key="k", pairs=10, steps=3, loss=0.5)
    assert "trained" in artifacts.adaptation_markdown("adapt", adapt)


def test_keys_are_what_prefect_accepts():
    assert artifacts.artifact_key("Index_Docs v2") == "ragline-index-docs-v2"
    assert re.fullmatch(r"[a-z0-9-]+", artifacts.artifact_key("ü?!")) and artifacts.artifact_key("") == "ragline-pipeline"


def test_nothing_is_published_outside_a_flow_run_or_for_a_query():
    assert artifacts.publish("index", IndexReport(added=1)) is None
    assert artifacts.markdown_for("search", [{"text": "a passage"}]) is None


def test_tuning_shows_each_candidates_setting_and_score_and_plots_them():
    from ragline.flows.contracts import Candidate

    chosen = Candidate(name="rrf", setting={"fusion": "rrf", "bm25": {"k1": 1.2}}, scores={"ndcg@10": 0.61})
    other = Candidate(name=HOSTILE, setting={"fusion": "dbsf"}, scores={"ndcg@10": 0.4})
    markdown = artifacts.tuning_markdown("tune", TuneReport(metric="ndcg@10", pairs=4, chosen=chosen,
                                                            candidates=[chosen, other]))
    assert "| chosen | rrf: bm25\\.k1=1\\.2, fusion=rrf | 0\\.6100 |" in markdown
    assert "| 2 | \\[click\\]" in markdown and "fusion=dbsf | 0\\.4000 |" in markdown
    (plot,) = re.findall(r"^!\[[^\n]*\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)$", markdown, re.M)
    svg = ElementTree.fromstring(base64.b64decode(plot))
    assert len([r for r in svg.iter("{http://www.w3.org/2000/svg}rect")]) == 1 + 2  # background and two bars


def test_an_ingestion_plots_its_documents_by_outcome_before_its_failures():
    report = IndexReport(added=3, unchanged=5, failed=1, failures=[Failure(source_id="a", stage="load", reason="x")])
    markdown = artifacts.ingestion_markdown("index", report)
    assert markdown.index("![documents by outcome](data:image/svg+xml;base64,") < markdown.index("## Failed")
    labels = [t.text for t in ElementTree.fromstring(artifacts.bar_chart_svg(
        ["<script>alert(1)</script>", "b"], [1, 2], "t & <u>")).iter("{http://www.w3.org/2000/svg}text")]
    assert "t & <u>" in labels and "<script>alert(1)</" in labels  # text nodes, cut to 18 characters
