"""Unit tests for the ``fuse`` stage: reciprocal rank fusion and min-max score combination."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragline.flows.contracts import Passage, Ranking
from ragline.tasks.retrieve.fuse import Params, fuse


def ranking(retriever: str, ids_scores, query: str = "q") -> Ranking:
    return Ranking(retriever=retriever, query=query, passages=[
        Passage(chunk_id=cid, source_id=f"src-{cid}", text=f"text {cid}", title=f"T{cid}", score=score,
                retriever=retriever, metadata={"from": retriever})
        for cid, score in ids_scores])


def run(rankings, **params):
    return fuse.fn(rankings=rankings, params=Params(**params))


def scores(passages) -> dict[str, float]:
    return {p.chunk_id: p.score for p in passages}


DENSE = ranking("dense", [("a", 0.9), ("b", 0.8), ("c", 0.7)])
SPARSE = ranking("sparse", [("c", 12.0), ("a", 7.0), ("d", 3.0)])


def test_rrf_by_hand():
    out = run([DENSE, SPARSE])
    expected = {
        "a": 1 / 61 + 1 / 62,
        "b": 1 / 62,
        "c": 1 / 63 + 1 / 61,
        "d": 1 / 63,
    }
    assert scores(out) == pytest.approx(expected, rel=1e-12)
    assert [p.chunk_id for p in out] == ["a", "c", "b", "d"]


def test_rrf_constant_k():
    out = run([DENSE, SPARSE], k=0)
    assert scores(out) == pytest.approx({"a": 1 + 1 / 2, "b": 1 / 2, "c": 1 / 3 + 1, "d": 1 / 3})
    assert [p.chunk_id for p in out] == ["a", "c", "b", "d"]


def test_rrf_weights_per_retriever():
    out = run([DENSE, SPARSE], weights={"sparse": 3.0})
    expected = {"a": 1 / 61 + 3 / 62, "b": 1 / 62, "c": 1 / 63 + 3 / 61, "d": 3 / 63}
    assert scores(out) == pytest.approx(expected)
    assert [p.chunk_id for p in out] == ["c", "a", "d", "b"]
    # a zero weight switches a retriever off: its passages are not added (as if it had not run)
    off = run([DENSE, SPARSE], weights={"dense": 0.0})
    assert scores(off) == pytest.approx({"c": 1 / 61, "a": 1 / 62, "d": 1 / 63})
    assert [p.chunk_id for p in off] == ["c", "a", "d"]


def test_rankings_of_several_queries_sum():
    # RAG-fusion: the same retriever answers each rewritten query; every list contributes
    q1 = ranking("dense", [("a", 0.9), ("b", 0.5)], query="q1")
    q2 = ranking("dense", [("b", 0.9), ("c", 0.5)], query="q2")
    q3 = ranking("dense", [("b", 0.9), ("a", 0.5)], query="q3")
    out = run([q1, q2, q3])
    assert scores(out) == pytest.approx({"a": 1 / 61 + 1 / 62, "b": 1 / 62 + 1 / 61 + 1 / 61, "c": 1 / 62})
    assert [p.chunk_id for p in out] == ["b", "a", "c"]


def test_score_method_min_max_normalisation():
    out = run([DENSE, SPARSE], method="score")
    # dense: (s - 0.7) / 0.2 ; sparse: (s - 3) / 9
    expected = {"a": 1.0 + 4 / 9, "b": 0.5, "c": 0.0 + 1.0, "d": 0.0}
    assert scores(out) == pytest.approx(expected)
    assert [p.chunk_id for p in out] == ["a", "c", "b", "d"]


def test_score_method_is_scale_free_and_weighted():
    scaled = ranking("sparse", [(cid, s * 1000 - 50) for cid, s in [("c", 12.0), ("a", 7.0), ("d", 3.0)]])
    assert scores(run([DENSE, scaled], method="score")) == pytest.approx(scores(run([DENSE, SPARSE], method="score")))
    weighted = run([DENSE, SPARSE], method="score", weights={"dense": 2.0, "sparse": 0.5})
    assert scores(weighted) == pytest.approx({"a": 2.0 + 0.5 * 4 / 9, "b": 1.0, "c": 0.5, "d": 0.0})


def test_score_method_equal_scores_count_fully():
    flat = ranking("dense", [("a", 0.3), ("b", 0.3)])
    assert scores(run([flat], method="score")) == {"a": 1.0, "b": 1.0}


def test_top_k():
    out = run([DENSE, SPARSE], top_k=2)
    assert [p.chunk_id for p in out] == ["a", "c"]
    assert len(run([DENSE, SPARSE], top_k=100)) == 4


def test_ties_are_broken_by_chunk_id():
    # mirrored rankings give every passage the same fused score
    one = ranking("dense", [("z", 1.0), ("m", 0.5), ("a", 0.1)])
    two = ranking("sparse", [("a", 9.0), ("m", 5.0), ("z", 1.0)])
    out = run([one, two])
    assert len(set(round(p.score, 12) for p in out)) == 2  # z and a tie; m is in the middle
    assert [p.chunk_id for p in out] == ["a", "z", "m"]
    assert [p.chunk_id for p in run([two, one])] == ["a", "z", "m"]  # input order does not matter


def test_output_passages_keep_provenance():
    out = run([DENSE, SPARSE])
    first = out[0]
    assert first.retriever == "fuse"
    assert first.source_id == "src-a" and first.text == "text a" and first.title == "Ta"
    assert first.metadata == {"from": "dense"}  # the first ranking that listed it
    # the inputs are not modified
    assert DENSE.passages[0].score == 0.9 and DENSE.passages[0].retriever == "dense"


def test_empty_input():
    assert run([]) == []
    assert run([ranking("dense", [])]) == []
    assert run([ranking("dense", [])], method="score") == []
    assert [p.chunk_id for p in run([ranking("dense", []), DENSE])] == ["a", "b", "c"]


def test_params_validation():
    with pytest.raises(ValidationError):
        Params(method="borda")
    with pytest.raises(ValidationError):
        Params(top_k=0)
    with pytest.raises(ValidationError):
        Params(k=-1)
    with pytest.raises(ValidationError):
        Params(weigths={"dense": 1.0})


def test_idle_retrievers_are_those_every_fuse_step_weighs_zero(make_project):
    from ragline.flows.spec.compile import load_project
    from ragline.flows.run.query_runner import idle_steps as idle_retrievers
    from tests.helpers.data import index_and_search_yaml

    project = load_project(make_project(index_and_search_yaml()), tuned=False)
    search = project.pipeline("search")
    assert idle_retrievers(search) == set()
    assert idle_retrievers(search.with_overrides({"fuse": {"weights": {"dense": 0.0, "sparse": 1.0}}})) == {"dense"}
    assert idle_retrievers(search.with_overrides({"fuse": {"weights": {"dense": 1.0, "sparse": 0}}})) == {"sparse"}
    assert idle_retrievers(search.with_overrides({"fuse": {"weights": {"dense": 0.01}}})) == set()


def test_many_settings_at_once_rank_as_the_stage_does_each():
    """The tuner scores hundreds of settings with ``fused_scores`` (one call per query): each row must
    be exactly what the stage gives for that setting, so tuned figures are what ``fuse`` serves."""
    import random

    import numpy as np

    from ragline.tasks.retrieve.fuse import fused_order, fused_scores

    rng = random.Random(4)
    for _ in range(50):
        dense = ranking("dense", [(f"c{i:03d}", round(1 - n / 50, 3)) for n, i in enumerate(rng.sample(range(80), 30))])
        sparse = ranking("sparse", [(f"c{i:03d}", round(20 - n / 3, 1)) for n, i in enumerate(rng.sample(range(80), 40))])
        rows = [(m, k, a) for m in ("rrf", "score") for k in (5, 60) for a in (0.0, 0.3, 1.0)]
        keys, fused, kept = fused_scores([[(p.chunk_id, p.score) for p in r.passages] for r in (dense, sparse)],
                                         np.array([[a, 1 - a] for _, _, a in rows]),
                                         np.array([[k] for _, k, _ in rows], dtype=float),
                                         np.array([[m == "rrf"] for m, _, _ in rows]))
        for row, (method, k, alpha) in enumerate(rows):
            stage = run([dense, sparse], method=method, k=k, top_k=25, weights={"dense": alpha, "sparse": 1 - alpha})
            order = fused_order(fused[row], kept[row], 25)
            assert [(keys[i], float(fused[row, i])) for i in order] == [(p.chunk_id, p.score) for p in stage]
