"""Chroma-style metadata filters evaluated in Python, so sparse retrieval filters like dense."""
from __future__ import annotations

from typing import Any

_COMPARE = {
    "$eq": lambda a, b: a == b,
    "$ne": lambda a, b: a != b,
    "$gt": lambda a, b: a is not None and a > b,
    "$gte": lambda a, b: a is not None and a >= b,
    "$lt": lambda a, b: a is not None and a < b,
    "$lte": lambda a, b: a is not None and a <= b,
    "$in": lambda a, b: a in b,
    "$nin": lambda a, b: a not in b,
}


class FilterError(ValueError):
    """A filter that Chroma would reject too."""


def matches(meta: dict[str, Any], where: dict[str, Any]) -> bool:
    """True when ``meta`` satisfies the Chroma ``where`` expression."""
    for key, cond in where.items():
        if key == "$and":
            if not all(matches(meta, c) for c in cond):
                return False
        elif key == "$or":
            if not any(matches(meta, c) for c in cond):
                return False
        elif key.startswith("$"):
            raise FilterError(f"unknown filter operator {key!r}")
        elif isinstance(cond, dict):
            for op, value in cond.items():
                if op not in _COMPARE:
                    raise FilterError(f"unknown filter operator {op!r} on field {key!r}")
                try:
                    if not _COMPARE[op](meta.get(key), value):
                        return False
                except TypeError:
                    return False
        elif meta.get(key) != cond:
            return False
    return True


def validate(where: dict[str, Any] | None) -> None:
    """Raise FilterError for a malformed filter before it reaches a store.

    Walks every branch: evaluating the filter (``matches``) stops at the first clause that
    decides the result, so it would miss a bad operator in a later clause.
    """
    if where is not None:
        _check(where)


def _check(where: Any) -> None:
    if not isinstance(where, dict):
        raise FilterError(f"a filter must be a mapping, got {where!r}")
    for key, cond in where.items():
        if key in ("$and", "$or"):
            if not isinstance(cond, list):
                raise FilterError(f"{key} needs a list of filters, got {cond!r}")
            for clause in cond:
                _check(clause)
        elif key.startswith("$"):
            raise FilterError(f"unknown filter operator {key!r}")
        elif isinstance(cond, dict):
            for op, value in cond.items():
                if op not in _COMPARE:
                    raise FilterError(f"unknown filter operator {op!r} on field {key!r}")
                if op in ("$in", "$nin") and not isinstance(value, list):
                    raise FilterError(f"{op} on field {key!r} needs a list, got {value!r}")


def normalize(where: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chroma's form of a filter: one key per dict ({"a": 1, "b": 2} becomes an $and of both),
    one operator per field, and no single-clause $and/$or. Matching semantics are unchanged."""
    if not where:
        return None
    clauses: list[dict[str, Any]] = []
    for key, cond in where.items():
        if key in ("$and", "$or"):
            parts = [p for p in (normalize(c) for c in cond) if p]
            if len(parts) == 1:
                clauses.append(parts[0])
            elif parts:
                clauses.append({key: parts})
        elif isinstance(cond, dict) and len(cond) > 1:
            clauses.extend({key: {op: value}} for op, value in cond.items())
        else:
            clauses.append({key: cond})
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}
