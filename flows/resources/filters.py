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
    """Raise FilterError for a malformed filter before it reaches a store."""
    if where:
        matches({}, where)
