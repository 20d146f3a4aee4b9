"""The filter validator's bounds (issue 16 item 10), without a server: sizes are refused before the
filter is walked, values a store cannot compare are named, and filters at the limits pass."""
from __future__ import annotations

import time

import pytest

from ragline.flows.resources.stores.filters import MAX_CLAUSES, MAX_DEPTH, MAX_LIST_VALUES, FilterError, validate


def nested(depth: int) -> dict:
    where: dict = {"a": 1}
    for _ in range(depth):
        where = {"$or": [where, {"b": 2}]}
    return where


def test_the_limits_are_what_the_docs_say():
    assert (MAX_CLAUSES, MAX_DEPTH, MAX_LIST_VALUES) == (100, 8, 1_000)


def test_at_the_limits_passes_one_over_fails():
    validate(nested(MAX_DEPTH))
    with pytest.raises(FilterError, match="nested more than 8 deep"):
        validate(nested(MAX_DEPTH + 1))
    validate({f"f{i}": i for i in range(MAX_CLAUSES)})
    with pytest.raises(FilterError, match="more than 100 clauses"):
        validate({f"f{i}": i for i in range(MAX_CLAUSES + 1)})
    validate({"a": {"$in": list(range(MAX_LIST_VALUES))}})
    with pytest.raises(FilterError, match="more than 1,000 values"):
        validate({"a": {"$in": list(range(MAX_LIST_VALUES + 1))}})


def test_a_huge_filter_is_refused_without_walking_it():
    bomb = {"$or": [{"a": i} for i in range(1_000_000)]}
    started = time.process_time()  # CPU time: a loaded machine does not inflate it
    with pytest.raises(FilterError, match="more than 100"):
        validate(bomb)
    assert time.process_time() - started < 0.1
    deep = nested(100_000)  # deeper than Python's recursion limit: refused at level 9
    with pytest.raises(FilterError, match="nested more than"):
        validate(deep)


@pytest.mark.parametrize("where, said", [
    ({"a": float("nan")}, "not a number a filter can compare"),
    ({"a": {"$gt": float("inf")}}, "not a number a filter can compare"),
    ({"a": {"$in": [1, float("-inf")]}}, "not a number a filter can compare"),
    ({"a": 2**63}, "fit in 64 bits"),
    ({"a": {"$eq": None}}, "needs a string, number or boolean"),
    ({"a": {"$eq": {"b": 1}}}, "needs a string, number or boolean"),
    ({"a": {"$nin": [[1]]}}, "needs a string, number or boolean"),
])
def test_values_a_store_cannot_compare_are_named(where, said):
    with pytest.raises(FilterError, match=said):
        validate(where)


def test_valid_values_pass():
    validate({"a": -2**63, "b": 2**63 - 1, "c": 1.5e300, "d": True, "e": "x", "f": {"$nin": ["a", 1, 2.5, False]}})
