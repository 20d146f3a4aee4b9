"""Self-query: a metadata filter read out of the request ("papers from 2020 about X" searches the
2020 documents for X), by rules or by the LLM (the book's "metadata filters chosen by the LLM").

The fields it may filter on are declared in the pipelines file, with their type and range or
values; nothing else can come out. The filter is ANDed with the client's own ``filters`` (it can
only narrow them) and the server's access clause stays: retrievers AND ``Query.access`` in
themselves, and the query is copied, never rebuilt. A filter that cannot be trusted (an LLM reply
naming an undeclared field, a value out of range, an operator outside the six allowed) becomes
no filter and a warning, never a failed query. A request with nothing to read is left as it is.
"""
from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.access import reserved, restrict
from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import InputError, MissingResource
from ragline.flows.resources.stores import filters
from ragline.flows.resources.stores.bm25 import BM25Index
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, parse_json
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.collection_index import by_collection

OPERATORS = ("$eq", "$in", "$gte", "$lte", "$gt", "$lt")
EQUALITY = ("$eq", "$in")
MAX_IN_VALUES = 50
MAX_STR_CHARS = 200


class FieldSpec(BaseModel):
    """A metadata field the stage may filter on."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["int", "float", "enum", "str"] = Field(..., description="int/float: ranges; enum: one of "
                                                                          "`values`; str: equality (llm mode)")
    min: float | None = Field(None, description="int/float: lowest value a filter may name")
    max: float | None = Field(None, description="int/float: highest value a filter may name")
    values: list[str | int] = Field(default_factory=list, description="enum: the allowed values")
    description: str = Field("", description="llm mode: what the field holds, shown to the LLM")

    @model_validator(mode="after")
    def _consistent(self) -> "FieldSpec":
        if self.type == "enum" and not self.values:
            raise ValueError("an enum field needs its `values`")
        if self.type != "enum" and self.values:
            raise ValueError(f"`values` belong to enum fields; this one is {self.type!r}")
        if self.type in ("enum", "str") and (self.min is not None or self.max is not None):
            raise ValueError(f"`min`/`max` belong to int and float fields; this one is {self.type!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min:g}) exceeds max ({self.max:g})")
        return self

    def operators(self) -> tuple[str, ...]:
        return OPERATORS if self.type in ("int", "float") else EQUALITY


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fields: dict[str, FieldSpec] = Field(..., min_length=1, description="metadata fields a filter may name")
    mode: Literal["rules", "llm"] = Field("rules", description="rules: years and enum values named in the "
                                                               "request; llm: the LLM chooses (needs an LLM)")
    year_field: str = Field("year", description="rules: the int field that 'from 2023', 'since 2019', "
                                                "'between 2015 and 2018' fill (when declared)")
    strip: bool = Field(False, description="search without the words the filter consumed ('reports from 2023 "
                                           "about X' searches 'reports about X')")
    on_invalid: Literal["no_filter", "drop_clause"] = Field(
        "no_filter", description="llm: a reply with an invalid clause gives no filter at all (no_filter), or "
                                 "only its valid clauses (drop_clause)")
    fallback: Literal["none", "unfiltered"] = Field(
        "none", description="unfiltered: when no indexed chunk the query may read satisfies the filter (counted "
                            "in the BM25 index's metadata), search without it (logged); none: keep it")
    max_tokens: int = Field(256, ge=16, le=2048, description="llm: length of the reply")
    max_request_chars: int = Field(2000, ge=100, description="llm: longer requests are clipped in the prompt")

    @model_validator(mode="after")
    def _names(self) -> "Params":
        for name in self.fields:
            if not name.strip() or name.startswith("$") or reserved(name):
                raise ValueError(f"fields: {name!r} cannot be filtered on (empty, an operator, or reserved for "
                                 f"access control)")
        year = self.fields.get(self.year_field)
        if year is not None and year.type != "int":
            raise ValueError(f"year_field {self.year_field!r} is declared as {year.type!r}; it must be 'int'")
        return self


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM in mode llm; the BM25 index (its metadata counts) for ``fallback: unfiltered``."""
    reads = {}
    if params.mode == "llm":
        reads["llm"] = ("mode", "mode 'llm' asks the LLM for the filter")
    if params.fallback == "unfiltered":
        reads["sparse"] = ("fallback", "fallback 'unfiltered' counts the filter's matches in the BM25 index's "
                                       "metadata")
    return reads


@stage("self_query", params=Params, produces="query", kind="query",
       uses={"llm": ("openai_compatible",), "sparse": ("bm25", "milvus")}, reads_roles=reads_roles,
       prompt=lambda p: "self_query" if p is not None and p.mode == "llm" else None,
       prompt_variables=("question", "fields"))
def self_query(query: Query, params: Params, ctx: StepContext, llm: LLMClient | None = None,
               sparse: SparseIndex | None = None) -> Query:
    """Read a metadata filter out of the request and AND it with the query's own filters."""
    if params.fallback == "unfiltered" and sparse is None:
        raise MissingResource("fallback 'unfiltered' counts matches in a bm25 resource: add one and name it in `uses`")
    if params.mode == "llm":
        if llm is None:
            raise MissingResource("mode 'llm' needs an openai_compatible resource: add one and name it in `uses`")
        where, text = llm_filter(query.text, params, ctx, llm)
    else:
        where, text = rules_filter(query.text, params)
    if where is None:
        return query
    combined = narrowed(query.filters, where)
    searched = list(by_collection(ctx, "sparse", sparse, query.collections).values()) if sparse is not None else []
    if params.fallback == "unfiltered" and not _matches_any(combined, query, searched):
        ctx.logger.warning("self-query filter %s matches no document this query may read; searching without it",
                           where)
        return query
    ctx.logger.info("self-query filter %s", where)
    update: dict[str, Any] = {"filters": combined}
    if params.strip and text.strip() and text != query.text:
        update.update(text=text, original=query.original or query.text)
    return query.model_copy(update=update)


def narrowed(client: dict[str, Any] | None, where: dict[str, Any]) -> dict[str, Any]:
    """The client's filter AND ours: never wider than what the client asked (its filter is kept
    as sent, so the retrievers still validate it and refuse a bad one)."""
    return {"$and": [client, where]} if client else where


def _matches_any(where: dict[str, Any], query: Query, indexes: list[BM25Index]) -> bool:
    """Whether a chunk within the query's access satisfies ``where`` in one of ``indexes`` (the
    collections the query searches; a client filter that is itself invalid counts as matching:
    the retrievers refuse it with their own error)."""
    try:
        filters.validate(query.filters)
        normalized = filters.normalize(restrict(where, query.access))
        return any(index.count(normalized) > 0 for index in indexes)
    except filters.FilterError:
        return True


# ----------------------------------------------------------------------------- rules
YEAR = r"(1\d{3}|2\d{3})"
DOC_NOUNS = ("papers?|reports?|stud(?:y|ies)|articles?|documents?|publications?|guidelines?|reviews?|trials?|"
             "surveys?|results|findings|data|editions?|versions?|releases?|filings?|statements?|minutes|"
             "memos?|policies|policy|updates?|issues?|volumes?|analys[ie]s")
# what may follow a year that names a date (not "in 2000 mice", "2023 people")
FOLLOWER = (rf"(?=\s*(?:$|[,.;:?!)\]]|(?:about|on|regarding|concerning|for|that|which|where|with|in|of|at|by|"
            rf"the|a|an|describing|discussing|showing|covering|mentioning|related|what|how|why|who|when|is|are|"
            rf"was|were|did|does|do|has|have|had|{DOC_NOUNS})\b))")
NEGATION = re.compile(r"\b(?:not|except|excluding|without|other\s+than)\s+(?:\w+\s+)?$", re.I)

YEAR_PATTERNS: list[tuple[re.Pattern[str], str]] = [(re.compile(p, re.I), how) for p, how in [
    (rf"\b(?:between|from)\s+(?:the\s+years?\s+)?{YEAR}\s*(?:and|to|until|through|till|-|–)\s*{YEAR}\b{FOLLOWER}",
     "range"),
    (rf"\b{YEAR}\s*(?:-|–|to)\s*{YEAR}\b{FOLLOWER}", "range"),
    (r"\b(?:(?:in|from|during)\s+)?the\s+(1\d|20)(\d)0'?s\b", "decade"),
    (rf"\b(?:since|from)\s+{YEAR}\s+(?:onwards?\b|on(?=\s*(?:$|[,.;:?!])))", "$gte"),
    (rf"\b(?:since|starting\s+(?:in|from))\s+{YEAR}\b{FOLLOWER}", "$gte"),
    (rf"\b{YEAR}\s+(?:or|and)\s+(?:later|after|newer|since)\b|\b{YEAR}\s+onwards?\b", "$gte"),
    (rf"\b(?:after|later\s+than|newer\s+than)\s+{YEAR}\b{FOLLOWER}", "$gt"),
    (rf"\b(?:before|prior\s+to|earlier\s+than|older\s+than)\s+{YEAR}\b{FOLLOWER}", "$lt"),
    (rf"\b(?:until|till|up\s+to|through|no\s+later\s+than)\s+{YEAR}\b{FOLLOWER}|\b{YEAR}\s+or\s+(?:earlier|before)\b",
     "$lte"),
    (rf"\b(?:in|from|of|during)\s+{YEAR}((?:\s*,\s*{YEAR})*\s*,?\s*(?:or|and)\s+{YEAR})\b{FOLLOWER}", "list"),
    (rf"\b(?:in|from|of|during|dated|published\s+in|in\s+the\s+year|year)\s+{YEAR}\b{FOLLOWER}", "$eq"),
    (rf"\b(?:the\s+)?{YEAR}(?=\s+(?:{DOC_NOUNS})\b)", "$eq"),
]]


def rules_filter(text: str, params: Params) -> tuple[dict[str, Any] | None, str]:
    """The filter the request names in words (years, enum values) and the request without them."""
    taken: list[tuple[int, int]] = []
    clauses: list[dict[str, Any]] = []
    year = params.fields.get(params.year_field)
    if year is not None:
        clauses += _year_clauses(text, params.year_field, year, taken)
    for name, spec in params.fields.items():
        if spec.type == "enum":
            clauses += _enum_clauses(text, name, spec, taken)
    where = filters.normalize({"$and": clauses}) if clauses else None
    return where, _without(text, taken)


def _year_clauses(text: str, name: str, spec: FieldSpec, taken: list[tuple[int, int]]) -> list[dict[str, Any]]:
    clauses = []
    for pattern, how in YEAR_PATTERNS:
        for match in pattern.finditer(text):
            if _overlaps(match.span(), taken) or NEGATION.search(text[:match.start()]):
                continue
            condition = _year_condition(match, how)
            if condition is None or not all(_in_range(v, spec) for v in _values(condition)):
                continue
            taken.append(match.span())
            clauses.append({name: condition})
    return clauses


def _year_condition(match: re.Match[str], how: str) -> dict[str, Any] | None:
    years = [int(g) for g in re.findall(YEAR, match.group(0))]
    if how == "range":
        low, high = sorted(years[:2])
        return {"$gte": low, "$lte": high}
    if how == "decade":
        start = int(match.group(1) + match.group(2) + "0")
        return {"$gte": start, "$lte": start + 9}
    if how == "list":
        return {"$in": sorted(set(years))}
    return {how: years[0]}


def _values(condition: dict[str, Any]) -> list[Any]:
    return [v for value in condition.values() for v in (value if isinstance(value, list) else [value])]


def _in_range(value: Any, spec: FieldSpec) -> bool:
    return (spec.min is None or value >= spec.min) and (spec.max is None or value <= spec.max)


def _enum_clauses(text: str, name: str, spec: FieldSpec, taken: list[tuple[int, int]]) -> list[dict[str, Any]]:
    found = []
    for value in spec.values:
        words = r"[\s_-]+".join(re.escape(w) for w in re.split(r"[\s_-]+", str(value).strip()) if w)
        pattern = re.compile(rf"(?:\b(?:from|in|on|by)\s+)?(?<!\w){words}(?!\w)", re.I)
        for match in pattern.finditer(text):
            if _overlaps(match.span(), taken) or NEGATION.search(text[:match.start()]):
                continue
            taken.append(match.span())
            if value not in found:
                found.append(value)
    if not found:
        return []
    return [{name: found[0]} if len(found) == 1 else {name: {"$in": found}}]


def _overlaps(span: tuple[int, int], taken: list[tuple[int, int]]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in taken)


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + " " + text[end:]
    return re.sub(r"\s+([,.;:?!])", r"\1", re.sub(r"\s{2,}", " ", text)).strip()


# ----------------------------------------------------------------------------- llm
def llm_filter(text: str, params: Params, ctx: StepContext, llm: LLMClient) -> tuple[dict[str, Any] | None, str]:
    """Ask the LLM for (field, op, value) clauses under a JSON schema; keep what validates."""
    fields = [{"name": n, "type": s.type, "min": s.min, "max": s.max, "values": s.values,
               "description": s.description} for n, s in params.fields.items()]
    prompt = ctx.prompt(question=clip(text, params.max_request_chars), fields=fields)
    reply = llm.chat(prompt, max_tokens=params.max_tokens, temperature=0.0, json_schema=reply_schema(params)).text
    parsed = parse_json(reply, None)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("filters", []), list):
        ctx.logger.warning("self-query: the LLM's reply is not the JSON asked for (%r); no filter", reply[:200])
        return None, text
    where = validated(parsed.get("filters", []), params, ctx)
    search = parsed.get("query")
    return where, search if isinstance(search, str) and search.strip() else text


def reply_schema(params: Params) -> dict[str, Any]:
    """The JSON schema vLLM's guided decoding holds the reply to (validated again after)."""
    scalar = [{"type": "string"}, {"type": "number"}]
    clause = {"type": "object", "additionalProperties": False, "required": ["field", "op", "value"],
              "properties": {"field": {"enum": sorted(params.fields)}, "op": {"enum": list(OPERATORS)},
                             "value": {"anyOf": [*scalar, {"type": "array", "items": {"anyOf": scalar}}]}}}
    return {"type": "object", "additionalProperties": False, "required": ["query", "filters"],
            "properties": {"query": {"type": "string"},
                           "filters": {"type": "array", "maxItems": 2 * len(params.fields), "items": clause}}}


class InvalidClause(InputError):
    """One clause of the LLM's reply that may not become a filter."""


def validated(clauses: list[Any], params: Params, ctx: StepContext) -> dict[str, Any] | None:
    """The filter the clauses make when every one is declared and in range (``on_invalid``:
    or only the valid ones); None otherwise, with a warning that says which and why."""
    kept = []
    for clause in clauses:
        try:
            kept.append(_clause(clause, params))
        except InvalidClause as exc:
            ctx.logger.warning("self-query: dropped the LLM's clause %s: %s", filters._short(clause), exc)
            if params.on_invalid == "no_filter":
                return None
    where = filters.normalize({"$and": kept}) if kept else None
    try:
        filters.validate(where)
    except filters.FilterError as exc:
        ctx.logger.warning("self-query: the LLM's filter is invalid (%s); no filter", exc)
        return None
    return where


def _clause(clause: Any, params: Params) -> dict[str, Any]:
    if not isinstance(clause, dict) or set(clause) != {"field", "op", "value"}:
        raise InvalidClause("not a {field, op, value} object")
    name, op, value = clause["field"], clause["op"], clause["value"]
    spec = params.fields.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidClause(f"field {filters._short(name)} is not declared")
    if op not in spec.operators():
        raise InvalidClause(f"operator {filters._short(op)} is not allowed on {spec.type} field {name!r}")
    if op == "$in":
        if not isinstance(value, list) or not 0 < len(value) <= MAX_IN_VALUES:
            raise InvalidClause(f"$in needs a list of 1 to {MAX_IN_VALUES} values")
        return {name: {"$in": [_value(v, name, spec) for v in value]}}
    return {name: {op: _value(value, name, spec)}}


def _value(value: Any, name: str, spec: FieldSpec) -> Any:
    """The value as the field stores it, or InvalidClause."""
    if spec.type == "enum":
        match = next((v for v in spec.values if str(v).lower() == str(value).lower()), None) \
            if isinstance(value, str | int) and not isinstance(value, bool) else None
        if match is None:
            raise InvalidClause(f"{filters._short(value)} is not one of the values of {name!r}")
        return match
    if spec.type == "str":
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_STR_CHARS:
            raise InvalidClause(f"{name!r} needs a string of 1 to {MAX_STR_CHARS} characters")
        return value
    number = _number(value, integer=spec.type == "int")
    if number is None:
        raise InvalidClause(f"{filters._short(value)} is not a{'n integer' if spec.type == 'int' else ' number'}")
    if not _in_range(number, spec):
        raise InvalidClause(f"{number} is outside the declared range of {name!r} ({_bound(spec.min)} to "
                            f"{_bound(spec.max)})")
    return number


def _bound(value: float | None) -> str:
    return "any" if value is None else f"{value:g}"


def _number(value: Any, integer: bool) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    if integer:
        return int(number) if number.is_integer() else None
    return number
