"""bench/onnx_default.py's verdict: onnx_int8 holds only with every nDCG@10 within 0.005 of torch's and
the same right / wrong / refused outcome for every question; a reason names what moved."""
from __future__ import annotations

import pytest

from tests.helpers.bench import bench_module


@pytest.fixture(scope="module")
def onnx_default():
    with bench_module("onnx_default") as module:
        yield module


def figures(dense: float, outcomes: dict[str, str]) -> dict:
    tally = {k: sum(v == k for v in outcomes.values()) for k in ("right", "wrong", "refused")}
    return {"scifact": {"search_dense": {"ndcg@10": dense}},
            "answers": {"own": {**tally, "questions": len(outcomes), "outcomes": outcomes}}}


def test_the_same_outcomes_and_a_small_ndcg_move_hold(onnx_default):
    same = {"q1": "right", "q2": "refused"}
    assert onnx_default.verdict({"torch": figures(0.657, same), "onnx_int8": figures(0.653, same)}) == (True, [])


def test_an_ndcg_move_over_the_margin_does_not_hold(onnx_default):
    same = {"q1": "right"}
    holds, reasons = onnx_default.verdict({"torch": figures(0.657, same), "onnx_int8": figures(0.651, same)})
    assert not holds and reasons == ["SciFact search_dense nDCG@10 moved -0.0060"]


def test_one_answer_turning_wrong_does_not_hold_and_is_named(onnx_default):
    holds, reasons = onnx_default.verdict({"torch": figures(0.657, {"q1": "right", "q2": "refused"}),
                                           "onnx_int8": figures(0.657, {"q1": "wrong", "q2": "refused"})})
    assert not holds and reasons == ["own: right 1 -> 0, wrong 0 -> 1 ('q1' right -> wrong)"]
