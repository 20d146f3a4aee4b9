"""Metrics against hand computation, BEIR loading, and chunk-to-document mapping."""
from __future__ import annotations

import math

import pytest

from ragline.flows.contracts import Passage
from ragline.flows.evaluation.retrieval import load_beir, score, to_run


def test_metrics_match_hand_computation():
    qrels = {"q1": {"d1": 1, "d2": 1}, "q2": {"d9": 1}}
    run = {"q1": {"d3": 4.0, "d1": 3.0, "d4": 2.0, "d2": 1.0}, "q2": {"d5": 2.0, "d6": 1.0}}
    got = score(run, qrels)
    ndcg_q1 = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert got["ndcg@10"] == pytest.approx(ndcg_q1 / 2, abs=1e-5)
    assert got["mrr@10"] == pytest.approx(0.5 / 2, abs=1e-5)
    assert got["p@10"] == pytest.approx(0.2 / 2, abs=1e-5)
    assert got["recall@100"] == pytest.approx(1.0 / 2, abs=1e-5)
    assert got["map@10"] == pytest.approx(((1 / 2 + 2 / 4) / 2) / 2, abs=1e-5)


def test_mrr_is_cut_at_10():
    qrels = {"q": {"hit": 1}}
    run = {"q": {f"miss{i}": 100.0 - i for i in range(10)} | {"hit": 1.0}}
    assert score(run, qrels)["mrr@10"] == 0.0


def test_queries_without_results_count_as_zero():
    assert score({}, {"q": {"d": 1}})["ndcg@10"] == 0.0


def test_to_run_keeps_order_and_best_chunk_per_document():
    passages = [Passage(chunk_id=f"c{i}", source_id=f"s#{d}", text="", metadata={"doc_id": d})
                for i, d in enumerate(["a", "b", "a", "c"])]
    run = to_run(passages)
    assert sorted(run, key=run.get, reverse=True) == ["a", "b", "c"]


def test_load_beir(tmp_path):
    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n')
    (tmp_path / "queries.jsonl").write_text('{"_id": "1", "text": "judged"}\n{"_id": "2", "text": "not judged"}\n')
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n")
    data = load_beir(tmp_path)
    assert data.queries == {"1": "judged"} and data.qrels == {"1": {"d1": 1}}


def test_load_beir_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="queries.jsonl"):
        (tmp_path / "corpus.jsonl").write_text("")
        load_beir(tmp_path)


def test_load_beir_names_bad_qrels_line(tmp_path):
    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text("")
    (tmp_path / "queries.jsonl").write_text("")
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\n")
    with pytest.raises(ValueError, match=r"test.tsv:2"):
        load_beir(tmp_path)
