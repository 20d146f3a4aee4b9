"""Chroma-style metadata filters evaluated in Python, so sparse retrieval filters like dense.

``validate`` bounds a filter before any store sees it (issue 16): Chroma's native code answers
500 from 1,000 ``$or`` clauses and kills the process (segfault) at 8,500, a ``$and`` nested 100
deep took 20 s, and it rejects NaN. The limits are far above what a person writes and far below
what Chroma tolerates (measured with chromadb 1.5: 500 ``$or`` clauses in 0.05 s, 10,000 ``$in``
values in 0.03 s, nesting 32 deep; 100,000 ``$in`` values fail with "too many SQL variables").
"""
from __future__ import annotations

import math
from typing import Any

from ragline.flows.access import reserved
from ragline.flows.errors import InputError

MAX_CLAUSES = 100  # comparisons in one filter, all levels together (and as many $and/$or branches)
MAX_DEPTH = 8  # $and/$or nested in one another
MAX_LIST_VALUES = 1_000  # values of all $in/$nin lists together
INT64 = 2**63  # Chroma stores integers as 64-bit

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


class FilterError(InputError):
    """A filter that Chroma would reject too."""

    error_code = "invalid_filter"
    field = "filters"

    def client_message(self) -> str:
        return f"field '{self.field}': {self}"


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
    """Raise FilterError for a malformed or oversized filter before it reaches a store.

    Walks every branch: evaluating the filter (``matches``) stops at the first clause that
    decides the result, so it would miss a bad operator in a later clause. The size is counted
    before any branch is descended into, so a bomb is refused without walking it.
    """
    if where is not None:
        _check(where, _Budget(), 0)


class _Budget:
    """What a filter has used of the limits so far."""

    def __init__(self) -> None:
        self.clauses = self.branches = self.values = 0

    def spend(self, clauses: int = 0, branches: int = 0, values: int = 0) -> None:
        self.clauses += clauses
        self.branches += branches
        self.values += values
        if self.clauses > MAX_CLAUSES:
            raise FilterError(f"the filter has more than {MAX_CLAUSES} clauses (comparisons; the limit)")
        if self.branches > MAX_CLAUSES:
            raise FilterError(f"the filter has more than {MAX_CLAUSES} $and/$or branches (the limit)")
        if self.values > MAX_LIST_VALUES:
            raise FilterError(f"the filter's $in/$nin lists hold more than {MAX_LIST_VALUES:,} values (the limit)")


def _check(where: Any, budget: _Budget, depth: int) -> None:
    if not isinstance(where, dict):
        raise FilterError(f"a filter must be a mapping, got {_short(where)}")
    for key, cond in where.items():
        if key in ("$and", "$or"):
            if not isinstance(cond, list):
                raise FilterError(f"{key} needs a list of filters, got {_short(cond)}")
            if depth + 1 > MAX_DEPTH:
                raise FilterError(f"$and/$or nested more than {MAX_DEPTH} deep (the limit)")
            budget.spend(branches=len(cond))
            for clause in cond:
                _check(clause, budget, depth + 1)
        elif key.startswith("$"):
            raise FilterError(f"unknown filter operator {_short(key)}")
        elif reserved(key):
            raise FilterError(f"field {_short(key)} is reserved for access control: the server filters on it "
                              f"from who asks; a filter may not name it")
        elif isinstance(cond, dict):
            budget.spend(clauses=len(cond))
            for op, value in cond.items():
                if op not in _COMPARE:
                    raise FilterError(f"unknown filter operator {_short(op)} on field {_short(key)}")
                if op in ("$in", "$nin"):
                    if not isinstance(value, list):
                        raise FilterError(f"{op} on field {_short(key)} needs a list, got {_short(value)}")
                    budget.spend(values=len(value))
                    for item in value:
                        _check_value(item, key, op)
                else:
                    _check_value(value, key, op)
        else:
            budget.spend(clauses=1)
            _check_value(cond, key, "$eq")


def _check_value(value: Any, key: str, op: str) -> None:
    """A value Chroma can compare: a string, a boolean, a 64-bit integer or a finite number."""
    if isinstance(value, bool | str):
        return
    if isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise FilterError(f"{op} on field {_short(key)}: the integer has {len(str(abs(value))):,} digits; "
                              f"filter values must fit in 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FilterError(f"{op} on field {_short(key)}: {value} is not a number a filter can compare "
                              f"(send a finite number)")
        return
    raise FilterError(f"{op} on field {_short(key)} needs a string, number or boolean, got {_short(value)}")


def _short(value: Any, limit: int = 80) -> str:
    """A value for a message: repr (control characters escaped), clipped."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


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
