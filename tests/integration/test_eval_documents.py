"""`ragline eval` counts documents, not chunks, and names every judged query it did not evaluate
(issue 40.5), on a synthetic BEIR-style collection whose documents span several chunks each."""
from __future__ import annotations

import json

import pytest

from ragline.flows.cli import main
from tests.helpers import pipelines
from tests.helpers.data import BASE_RESOURCES, write_jsonl

pytestmark = pytest.mark.integration  # indexes with the real embedder, Chroma and BM25

RELEVANT, OTHERS = 120, 20  # documents about giraffes (all judged relevant to q1), and unrelated ones

PROJECT = BASE_RESOURCES + "pipelines:\n" + pipelines.index(chunk_size=16, overlap=0) + """  search_bm25:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 100}}
      - {id: fuse,   task: fuse, with: {top_k: 100}}
"""


def _sentence(topic: str, i: int, part: int) -> str:
    return f"{topic} record {i} part {part} walks slowly across the dry open plain at dawn."


@pytest.fixture
def multi_chunk_beir(tmp_path):
    """140 documents of three sentences (chunks of 16 tokens: several per document); q1 judges the 120 giraffe
    documents relevant. With ``unevaluable``, q3 has no query line and q4 an empty text."""

    def make(unevaluable: bool = False):
        return _write_beir(tmp_path / "beir", unevaluable)

    return make


def _write_beir(folder, unevaluable: bool):
    records = [{"_id": f"g{i}", "title": "", "text": " ".join(_sentence("giraffe", i, p) for p in range(3))}
               for i in range(RELEVANT)]
    records += [{"_id": f"o{i}", "title": "", "text": " ".join(_sentence("tortoise", i, p) for p in range(3))}
                for i in range(OTHERS)]
    write_jsonl(folder / "corpus.jsonl", records)
    queries = [{"_id": "q1", "text": "giraffe"}, {"_id": "q2", "text": "tortoise"}]
    write_jsonl(folder / "queries.jsonl", queries + ([{"_id": "q4", "text": ""}] if unevaluable else []))
    (folder / "qrels").mkdir()
    judged = [("q1", f"g{i}") for i in range(RELEVANT)] + [("q2", "o0")]
    judged += [("q3", "o1"), ("q4", "o2")] if unevaluable else []
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, d in judged))
    return folder


def test_recall_at_100_counts_100_distinct_documents(make_project, multi_chunk_beir, capsys):
    project = make_project(PROJECT)
    assert main(["eval", "--dataset", str(multi_chunk_beir()), "-f", str(project), "-p", "search_bm25",
                 "--no-prefect", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # q1: its top 100 chunks are 75 documents (recall 75/120 before); retrieved to 100 distinct
    # documents, all giraffes, its recall is 100/120. q2 finds its one document: recall 1.
    assert result["recall@100"] == pytest.approx((100 / RELEVANT + 1.0) / 2, abs=1e-4)
    depth = result["documents_per_query"]
    assert depth["target"] == 100 and depth["deepest_scale"] > 1
    assert depth["short_queries"] == ["q2"]  # tortoises: 20 documents in all, the index runs out


def test_judged_queries_not_evaluated_are_named(make_project, multi_chunk_beir, capsys):
    """Today an empty query text stops the whole evaluation (exit 2) and a judged id with no query
    line is dropped silently; each is named with its reason, and so are those past --limit."""
    project = make_project(PROJECT)
    dataset = str(multi_chunk_beir(unevaluable=True))
    assert main(["eval", "--dataset", dataset, "-f", str(project), "-p", "search_bm25",
                 "--no-prefect", "--json", "--limit", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["queries"] == 1 and result["judged_queries"] == 4
    skipped = result["not_evaluated"]
    assert set(skipped) == {"q2", "q3", "q4"}
    assert "no query with this _id" in skipped["q3"] and "queries.jsonl" in skipped["q3"]
    assert "has no text" in skipped["q4"] and skipped["q2"] == "past --limit 1"
    assert main(["eval", "--dataset", dataset, "-f", str(project), "-p", "search_bm25",
                 "--no-prefect"]) == 0
    printed = capsys.readouterr().out
    assert "2 queries" in printed and "metrics over distinct documents" in printed
    assert "not evaluated (1 judged queries, no query with this _id" in printed and ": q3" in printed
    assert "has no text): q4" in printed
