"""Unit tests for the Chroma-style metadata filters evaluated in Python (flows.resources.filters)."""
from __future__ import annotations

import pytest

from ragline.flows.resources.stores.filters import FilterError, matches, validate

META = {"year": 2020, "lang": "en", "score": 0.5, "draft": False, "tag": "a"}


@pytest.mark.parametrize("where, expected", [
    ({"year": {"$eq": 2020}}, True),
    ({"year": {"$eq": 2021}}, False),
    ({"year": {"$ne": 2021}}, True),
    ({"year": {"$ne": 2020}}, False),
    ({"year": {"$gt": 2019}}, True),
    ({"year": {"$gt": 2020}}, False),
    ({"year": {"$gte": 2020}}, True),
    ({"year": {"$gte": 2021}}, False),
    ({"year": {"$lt": 2021}}, True),
    ({"year": {"$lt": 2020}}, False),
    ({"year": {"$lte": 2020}}, True),
    ({"year": {"$lte": 2019}}, False),
    ({"score": {"$gt": 0.25}}, True),
    ({"score": {"$lt": 0.25}}, False),
    ({"lang": {"$in": ["en", "de"]}}, True),
    ({"lang": {"$in": ["fr", "de"]}}, False),
    ({"lang": {"$nin": ["fr", "de"]}}, True),
    ({"lang": {"$nin": ["en", "de"]}}, False),
    ({"draft": {"$eq": False}}, True),
    ({"draft": {"$eq": True}}, False),
])
def test_each_operator(where, expected):
    assert matches(META, where) is expected


def test_bare_value_means_equality():
    assert matches(META, {"lang": "en"}) is True
    assert matches(META, {"lang": "de"}) is False


def test_several_fields_are_anded():
    assert matches(META, {"lang": "en", "year": 2020}) is True
    assert matches(META, {"lang": "en", "year": 2019}) is False


def test_several_operators_on_one_field_are_anded():
    assert matches(META, {"year": {"$gte": 2019, "$lte": 2021}}) is True
    assert matches(META, {"year": {"$gte": 2019, "$lte": 2019}}) is False


def test_empty_filter_matches_everything():
    assert matches(META, {}) is True
    assert matches({}, {}) is True


def test_and_or():
    assert matches(META, {"$and": [{"lang": "en"}, {"year": {"$gt": 2000}}]}) is True
    assert matches(META, {"$and": [{"lang": "en"}, {"year": {"$gt": 2030}}]}) is False
    assert matches(META, {"$or": [{"lang": "de"}, {"year": 2020}]}) is True
    assert matches(META, {"$or": [{"lang": "de"}, {"year": 1999}]}) is False


def test_nested_and_or():
    where = {"$or": [
        {"$and": [{"lang": "de"}, {"year": 2020}]},
        {"$and": [{"tag": {"$in": ["a", "b"]}}, {"$or": [{"score": {"$gte": 0.5}}, {"draft": True}]}]},
    ]}
    assert matches(META, where) is True
    assert matches({**META, "score": 0.1}, where) is False
    assert matches({**META, "score": 0.1, "draft": True}, where) is True
    assert matches({**META, "tag": "c"}, where) is False
    assert matches({**META, "tag": "c", "lang": "de"}, where) is True


def test_missing_field():
    # A missing field never equals, and never compares as greater or smaller.
    assert matches({}, {"year": 2020}) is False
    assert matches({}, {"year": {"$eq": 2020}}) is False
    for op in ("$gt", "$gte", "$lt", "$lte"):
        assert matches({}, {"year": {op: 0}}) is False, op
    assert matches({}, {"lang": {"$in": ["en"]}}) is False
    # ...but it is "not equal" to a value and "not in" a list.
    assert matches({}, {"year": {"$ne": 2020}}) is True
    assert matches({}, {"lang": {"$nin": ["en"]}}) is True


def test_type_mismatch_is_no_match_not_an_error():
    for op in ("$gt", "$gte", "$lt", "$lte"):
        assert matches(META, {"lang": {op: 3}}) is False, op
        assert matches(META, {"year": {op: "2019"}}) is False, op
    assert matches(META, {"year": {"$eq": "2020"}}) is False
    assert matches(META, {"year": "2020"}) is False


def test_unknown_top_level_operator():
    with pytest.raises(FilterError, match=r"\$not"):
        matches(META, {"$not": [{"lang": "en"}]})


def test_unknown_field_operator():
    with pytest.raises(FilterError, match=r"\$contains.*lang"):
        matches(META, {"lang": {"$contains": "e"}})


def test_unknown_operator_nested_in_and_or():
    with pytest.raises(FilterError):
        matches(META, {"$and": [{"lang": "en"}, {"year": {"$between": [1, 2]}}]})
    with pytest.raises(FilterError):
        matches(META, {"$or": [{"lang": "de"}, {"$xor": []}]})


def test_filter_error_is_a_value_error():
    assert issubclass(FilterError, ValueError)


def test_validate():
    validate(None)
    validate({})
    validate({"lang": "en", "year": {"$gte": 2000}})
    validate({"$or": [{"lang": "en"}, {"$and": [{"year": {"$lt": 3}}, {"tag": {"$nin": ["x"]}}]}]})
    with pytest.raises(FilterError):
        validate({"year": {"$like": 1}})
    with pytest.raises(FilterError):
        validate({"$nor": []})


@pytest.mark.parametrize("where", [
    # Each bad operator sits behind a clause that already decides the result for empty metadata,
    # so evaluating the filter alone would never reach it.
    {"lang": "en", "year": {"$like": 1}},
    {"year": {"$gt": 1, "$like": 2}},
    {"$and": [{"lang": "en"}, {"year": {"$between": [1, 2]}}]},
    {"$or": [{"lang": {"$ne": "en"}}, {"$xor": []}]},
    {"$or": [{"lang": {"$nin": ["x"]}}, {"$and": [{"a": 1}, {"b": {"$regex": "x"}}]}]},
])
def test_validate_checks_every_branch(where):
    with pytest.raises(FilterError):
        validate(where)


@pytest.mark.parametrize("where", [
    {"$and": {"lang": "en"}},
    {"$or": "lang"},
    {"$and": [{"lang": "en"}, "year"]},
    {"lang": {"$in": "english"}},
    {"lang": {"$nin": "en"}},
    ["lang"],
])
def test_validate_rejects_malformed_structure(where):
    with pytest.raises(FilterError):
        validate(where)
