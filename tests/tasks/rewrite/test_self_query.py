"""Self-query filters (``self_query``): the rules' years and enum values over many phrasings and
the ones that must not become filters; the LLM's reply (through the scripted server and the
engine) validated so that undeclared fields, values out of range, operator injections and access
keys never reach a store; the client's filters and the server's access kept on the query."""
from __future__ import annotations

import json
import logging

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import MissingResource
from ragline.flows.spec.compile import load_project, validate_file
from ragline.tasks.rewrite.self_query import Params, rules_filter, self_query
from tests.helpers.llm_stages import project_for, run
from tests.helpers.reads_roles import BM25, LLM, TWO_BM25, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

FIELDS = {"year": {"type": "int", "min": 1900, "max": 2100},
          "source": {"type": "enum", "values": ["pubmed", "arxiv", "clinical_trial"]},
          "title": {"type": "str"}}
PARAMS = Params(fields=FIELDS)
Y = "year"


@pytest.mark.parametrize("text, where", [
    ("reports from 2023 about X", {Y: {"$eq": 2023}}),
    ("What did the 2022 report say on inflation?", {Y: {"$eq": 2022}}),
    ("studies published in 2012 on sleep", {Y: {"$eq": 2012}}),
    ("what happened in 2021?", {Y: {"$eq": 2021}}),
    ("COVID-19 vaccine trials in 2020", {Y: {"$eq": 2020}}),
    ("papers since 2019 on vitamin D", {Y: {"$gte": 2019}}),
    ("results from 2019 onwards", {Y: {"$gte": 2019}}),
    ("2016 or later guidance on statins", {Y: {"$gte": 2016}}),
    ("work after 2015 on CRISPR", {Y: {"$gt": 2015}}),
    ("trials before 2010", {Y: {"$lt": 2010}}),
    ("analyses prior to 1995 of smoking", {Y: {"$lt": 1995}}),
    ("reviews up to 2005", {Y: {"$lte": 2005}}),
    ("studies between 2015 and 2018 on sleep", {"$and": [{Y: {"$gte": 2015}}, {Y: {"$lte": 2018}}]}),
    ("from 2018 to 2015, what changed?", {"$and": [{Y: {"$gte": 2015}}, {Y: {"$lte": 2018}}]}),
    ("2015-2018 results on obesity", {"$and": [{Y: {"$gte": 2015}}, {Y: {"$lte": 2018}}]}),
    ("asthma research in the 1990s", {"$and": [{Y: {"$gte": 1990}}, {Y: {"$lte": 1999}}]}),
    ("papers in 2019 or 2020 about masks", {Y: {"$in": [2019, 2020]}}),
    ("arxiv papers about transformers", {"source": "arxiv"}),
    ("clinical trial data on aspirin", {"source": "clinical_trial"}),
    ("PubMed or arXiv studies on sepsis", {"source": {"$in": ["pubmed", "arxiv"]}}),
    ("pubmed articles from 2021 on long covid", {"$and": [{Y: {"$eq": 2021}}, {"source": "pubmed"}]}),
])
def test_rules_read_years_and_enum_values(text, where):
    assert rules_filter(text, PARAMS)[0] == where


@pytest.mark.parametrize("text", [
    "2023 people attended", "effects in 2000 mice", "top 2000 genes by expression", "ISO 9001 certification",
    "between 2000 and 3000 patients", "a cohort of 1500 patients", "clinical trials of aspirin",
    "papers not from pubmed about sepsis", "results excluding arxiv", "what is the 2020 census population?",
    "the effect of temperature on enzymes", "studies from 1850 on cholera",  # before the declared min
    "archival records", "pubmedical terms",  # an enum value inside another word
])
def test_rules_leave_other_numbers_and_words_alone(text):
    assert rules_filter(text, PARAMS)[0] is None


def test_strip_removes_only_the_words_the_filter_consumed():
    stripping = Params(fields=FIELDS, strip=True)
    assert rules_filter("reports from 2023 about X", stripping)[1] == "reports about X"
    assert rules_filter("the 2022 report on inflation", stripping)[1] == "report on inflation"
    ctx = StepContext(pipeline="p", step_id="s")
    kept = self_query.fn(query=Query(text="reports from 2023 about X"), params=PARAMS, ctx=ctx)
    assert kept.text == "reports from 2023 about X" and kept.original == ""  # strip is off by default
    stripped = self_query.fn(query=Query(text="reports from 2023 about X"), params=stripping, ctx=ctx)
    assert (stripped.text, stripped.original) == ("reports about X", "reports from 2023 about X")
    only_filter = self_query.fn(query=Query(text="from 2023"), params=stripping, ctx=ctx)
    assert only_filter.text == "from 2023" and only_filter.filters == {Y: {"$eq": 2023}}  # never an empty search


def test_the_filter_narrows_the_clients_and_keeps_access_and_every_other_field():
    client = {"source": "pubmed"}
    query = Query(text="papers from 2020 about masks", filters=client, access=frozenset({"hr"}),
                  instruction="as a table", variants=["papers from 2020 about masks", "masks 2020"])
    out = self_query.fn(query=query, params=PARAMS, ctx=StepContext(pipeline="p", step_id="s"))
    assert out.filters == {"$and": [client, {Y: {"$eq": 2020}}]}
    assert out.model_dump(exclude={"filters"}) == query.model_dump(exclude={"filters"})
    untouched = Query(text="masks", filters=client, access=frozenset())
    assert self_query.fn(query=untouched, params=PARAMS, ctx=StepContext(pipeline="p", step_id="s")) is untouched


@pytest.mark.parametrize("fields, message", [
    ({"ragline_acl.hr": {"type": "str"}}, "reserved for access control"),
    ({"$where": {"type": "str"}}, "cannot be filtered on"),
    ({"source": {"type": "enum"}}, "an enum field needs its `values`"),
    ({"year": {"type": "int", "min": 2100, "max": 1900}}, "min (2100) exceeds max (1900)"),
    ({"year": {"type": "str"}}, "year_field 'year' is declared as 'str'"),
])
def test_bad_field_declarations_are_located(make_project, fields, message):
    path = make_project(f"""
pipelines:
  p:
    kind: query
    steps:
      - {{id: sq, task: self_query, with: {{fields: {json.dumps(fields)}}}}}
""")
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.line) == ("p", "sq", 6) and error.field.startswith("with")
    assert message in error.message


def test_a_mode_without_its_resource_is_refused_clearly():
    with pytest.raises(MissingResource, match="mode 'llm' needs an openai_compatible resource"):
        self_query.fn(query=Query(text="x"), params=Params(fields=FIELDS, mode="llm"),
                      ctx=StepContext(pipeline="p", step_id="s"))
    with pytest.raises(ValueError, match="fallback 'unfiltered' counts matches in a bm25 resource"):
        self_query.fn(query=Query(text="x"), params=Params(fields=FIELDS, fallback="unfiltered"),
                      ctx=StepContext(pipeline="p", step_id="s"))


# ----------------------------------------------------------------------------- the LLM's reply
SELF_QUERY_STEP = ("      - {{id: sq, task: self_query, "
                   "with: {{mode: llm, on_invalid: {on_invalid}, fields: {fields}}}}}\n")


def llm_filter(make_project, reply: dict | str, on_invalid: str = "no_filter", **query):
    """The filter the stage hands on for a scripted LLM reply, and the request the server got."""
    text = reply if isinstance(reply, str) else json.dumps(reply)
    steps = SELF_QUERY_STEP.format(on_invalid=on_invalid, fields=json.dumps(FIELDS))
    with ScriptedLLM(lambda prompt: text) as llm:
        out = run(project_for(make_project, llm.base_url, steps, ["unused"]), "papers about masks", **query)
        return out.filters, llm.requests[-1]


def clause(field, op, value):
    return {"field": field, "op": op, "value": value}


def test_a_valid_reply_becomes_the_filter_and_the_request_asks_for_the_schema(make_project):
    reply = {"query": "masks", "filters": [clause("year", "$gte", 2019), clause("source", "$in", ["PubMed"])]}
    seen, request = llm_filter(make_project, reply)
    assert seen == {"$and": [{Y: {"$gte": 2019}}, {"source": {"$in": ["pubmed"]}}]}  # canonical enum value
    schema = request["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["filters"]["items"]["properties"]["field"]["enum"] == ["source", "title", "year"]
    assert "papers about masks" in request["messages"][-1]["content"]
    assert "one of: pubmed, arxiv, clinical_trial" in request["messages"][-1]["content"]


@pytest.mark.parametrize("bad, why", [
    (clause("year", "$eq", 1492), "outside the declared range of 'year' (1900 to 2100)"),
    (clause("year", "$gte", "twenty"), "is not an integer"),
    (clause("year", "$eq", 2020.5), "is not an integer"),
    (clause("author", "$eq", "Smith"), "is not declared"),
    (clause("$where", "$eq", "1 == 1"), "is not declared"),
    (clause("ragline_acl.admin", "$eq", True), "is not declared"),
    (clause("ragline_acl_public", "$eq", True), "is not declared"),
    (clause("year", "$ne", 2020), "operator '$ne' is not allowed"),
    (clause("year", "$where", "this.year > 0"), "operator '$where' is not allowed"),
    (clause("source", "$gte", "arxiv"), "operator '$gte' is not allowed on enum"),
    (clause("source", "$eq", "wikipedia"), "is not one of the values of 'source'"),
    (clause("source", "$eq", {"$ne": "x"}), "is not one of the values of 'source'"),
    (clause("title", "$eq", {"$or": [{"ragline_acl.admin": True}]}), "needs a string"),
    (clause("year", "$in", []), "$in needs a list"),
    ({"field": "year", "op": "$eq", "value": 2020, "$or": [{"ragline_acl.admin": True}]}, "not a {field, op"),
    ("$or", "not a {field, op"),
])
def test_invalid_clauses_give_no_filter_and_a_warning(make_project, caplog, bad, why):
    reply = {"query": "masks", "filters": [clause("year", "$eq", 2020), bad]}
    with caplog.at_level(logging.WARNING):
        seen, _ = llm_filter(make_project, reply, filters={"source": "pubmed"}, access=None)
    assert seen == {"source": "pubmed"}  # the client's own filter only: nothing of the reply
    assert why in caplog.text


def test_drop_clause_keeps_the_valid_clauses(make_project, caplog):
    reply = {"query": "", "filters": [clause("year", "$lte", 2018), clause("ragline_acl.admin", "$eq", True),
                                      clause("year", "$gt", 3000)]}
    with caplog.at_level(logging.WARNING):
        seen, _ = llm_filter(make_project, reply, on_invalid="drop_clause")
    assert seen == {Y: {"$lte": 2018}} and "ragline_acl" not in json.dumps(seen)
    assert caplog.text.count("dropped the LLM's clause") == 2


@pytest.mark.parametrize("reply", ["no filter, sorry", '{"filters": {"year": 2020}}', "[]",
                                   '{"filters": [{"field": "year", "op": "$eq", "value": 1e400}]}'])
def test_a_reply_that_is_not_the_json_asked_for_gives_no_filter(make_project, reply):
    seen, _ = llm_filter(make_project, reply)
    assert seen is None


def test_an_empty_list_of_filters_leaves_the_query_unfiltered(make_project):
    assert llm_filter(make_project, {"query": "papers about masks", "filters": []})[0] is None


# ----------------------------------------------------------------------------- resources read (validate)
SQ_READS_STEP = """      - id: sq
        task: self_query
        with:
          fields: {year: {type: int, min: 1900, max: 2100}}
          mode: llm
          fallback: unfiltered
"""


@pytest.mark.parametrize("resources, field, why", [
    (BM25, "with.mode", "mode 'llm' asks the LLM for the filter"),
    (LLM, "with.fallback", "fallback 'unfiltered' counts the filter's matches in the BM25 index's metadata")])
def test_self_query_says_at_validate_which_resource_its_mode_or_fallback_reads(make_project, resources, field, why):
    """Mode llm reads the LLM, fallback unfiltered the BM25 index: a file without one validated and
    failed only when a request came; now `ragline validate` names the line and the field."""
    error = error_at(make_project(pipelines_file(resources, SQ_READS_STEP)), "sq", field)
    assert why in error.message


def test_a_rules_self_query_without_fallback_binds_no_llm_and_no_bm25(make_project):
    """Two LLMs and two BM25 indexes: a step that reads neither needs no name (it was 'several
    resources: name one')."""
    rules = SQ_READS_STEP.replace("mode: llm", "mode: rules").replace("fallback: unfiltered", "fallback: none")
    path = make_project(pipelines_file(TWO_LLMS + TWO_BM25, rules))
    assert validate_file(path) == []
    assert load_project(path).pipeline("p").step("sq").resources == {}
    both = make_project(pipelines_file(LLM + BM25, SQ_READS_STEP), name="both.yaml")
    assert load_project(both).pipeline("p").step("sq").resources == {"llm": "llm", "sparse": "sparse"}
