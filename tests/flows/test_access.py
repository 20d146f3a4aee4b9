"""Document-level access (issue 19 item 3): rules, group names, the metadata keys and the query
clause (flows/access.py); where a document's groups come from (tasks/ingest/load/); a client can never
name the reserved keys (flows/resources/stores/filters.py) nor set a query's access (the API's models)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ragline.flows import access
from ragline.flows.access import AccessRule, acl_metadata, clause, parse_groups, readable, restrict, rule_groups
from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources.stores.filters import FilterError, matches, validate
from ragline.flows.spec.compile import validate_file
from ragline.tasks.ingest.load import Params, load
from tests.helpers.access_site import site_yaml

HR_RULES = [AccessRule(prefix="hr/", groups=["hr"]), AccessRule(prefix="hr/public/", groups=[]),
            AccessRule(prefix="", groups=["everyone", "eng"])]


def test_the_first_matching_rule_decides():
    assert rule_groups(HR_RULES, "hr/pay.md") == ("hr",)
    assert rule_groups(HR_RULES, "hr/public/holidays.md") == ("hr",)  # first match wins, not the longest
    assert rule_groups(HR_RULES, "eng/design.md") == ("eng", "everyone")
    assert rule_groups(HR_RULES[:1], "eng/design.md") is None  # no rule: the loader makes it public
    assert rule_groups([AccessRule(prefix="hr/", groups=[])], "hr/x") == ()


@pytest.mark.parametrize("value, expected", [
    (["hr", "eng", "hr"], ("eng", "hr")), ("hr, eng", ("eng", "hr")), ("", ()), ([], ()),
    (["team:a.b-c_1"], ("team:a.b-c_1",)),
])
def test_groups_from_a_list_or_a_comma_separated_string(value, expected):
    assert parse_groups(value, "doc") == expected


@pytest.mark.parametrize("value, words", [
    (["hr team"], "group name 'hr team'"), ("a" * 65, "1-64 characters"), (["ok", 3], "list of names"),
    ({"hr": True}, "got dict"), (7, "got int"), (["é"], "group name 'é'"),
])
def test_bad_groups_are_refused_naming_the_document(value, words):
    with pytest.raises(ValueError, match="^document 'x.md'") as caught:
        parse_groups(value, "document 'x.md'")
    assert words in str(caught.value)


def test_metadata_keys_and_the_clause_agree_in_python():
    hr, public = acl_metadata(["hr"]), acl_metadata([])
    assert hr == {"ragline_acl.hr": True} and public == {"ragline_acl_public": True}
    assert clause(None) is None and clause(frozenset()) == {"ragline_acl_public": True}
    eng = frozenset({"eng"})
    assert clause(eng) == {"$or": [{"ragline_acl_public": True}, {"ragline_acl.eng": True}]}
    for meta in (hr, public, {**acl_metadata(["eng", "hr"])}, {}):
        assert matches(meta, clause(eng)) == readable(meta, eng)
    assert not readable(hr, eng) and readable(public, eng) and readable(hr, None)
    assert not readable({}, frozenset({"hr"}))  # a chunk without access keys is never shown to a restricted query


def test_a_clients_filter_only_narrows_the_access_clause():
    assert restrict(None, None) is None and restrict({"a": 1}, None) == {"a": 1}
    narrowed = restrict({"lang": "en"}, frozenset({"eng"}))
    assert narrowed == {"$and": [{"lang": "en"}, clause(frozenset({"eng"}))]}
    assert not matches({"lang": "en", **acl_metadata(["hr"])}, narrowed)
    # an $or in the client's filter cannot widen it: it stays inside the $and
    widened = restrict({"$or": [{"lang": "en"}, {"lang": "de"}]}, frozenset())
    assert not matches({"lang": "en", **acl_metadata(["hr"])}, widened)


@pytest.mark.parametrize("where", [
    {"ragline_acl.hr": True}, {"ragline_acl_public": {"$eq": True}},
    {"$or": [{"lang": "en"}, {"ragline_acl.hr": True}]}, {"$and": [{"ragline_acl_x": {"$in": [True]}}]},
])
def test_a_clients_filter_may_not_name_the_reserved_keys(where):
    with pytest.raises(FilterError, match="reserved for access control"):
        validate(where)


def test_no_http_surface_lets_a_client_set_the_access():
    from ragline.flows.run.entrypoints import DeployedInputs
    from ragline.flows.serve.routers.openai_api import ChatRequest
    from ragline.flows.serve.query_service import QueryRequest

    with pytest.raises(ValidationError):
        DeployedInputs.model_validate({"query": {"text": "q", "access": None}})
    for model in (QueryRequest, ChatRequest):
        assert "access" not in model.model_fields
    assert Query(text="q", access=["hr"]).access == frozenset({"hr"})  # only the server builds a Query


# --- where a document's groups come from (load) ------------------------------------------

def load_docs(params: dict) -> tuple[dict, StepContext]:
    ctx = StepContext(pipeline="t", step_id="load")
    documents = load.fn(params=Params(**params), ctx=ctx)
    return {d.source_id: d for d in documents}, ctx


def test_root_rules_give_documents_their_groups(tmp_path):
    for path in ("hr/pay.md", "hr/public/holidays.md", "eng/design.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"# {path}\n\ntext of {path}\n")
    rules = [{"prefix": "hr/public/", "groups": []}, {"prefix": "hr/", "groups": ["hr"]}]
    docs, ctx = load_docs({"paths": [{"path": str(tmp_path), "name": "kb", "access": rules}]})
    assert not ctx.failures
    assert docs["kb/hr/pay.md"].groups == ["hr"] and docs["kb/hr/pay.md"].metadata["ragline_acl.hr"] is True
    assert "ragline_acl_public" not in docs["kb/hr/pay.md"].metadata
    assert docs["kb/hr/public/holidays.md"].groups == [] and docs["kb/eng/design.md"].groups == []
    assert docs["kb/eng/design.md"].metadata["ragline_acl_public"] is True


def test_a_jsonl_field_names_the_groups_and_is_not_content(tmp_path):
    records = [{"_id": "a", "text": "alpha", "groups": ["hr", "eng"]}, {"_id": "b", "text": "beta", "groups": "hr"},
               {"_id": "c", "text": "gamma", "metadata": {"groups": "eng", "lang": "en"}},
               {"_id": "d", "text": "delta"}, {"_id": "e", "text": "eps", "groups": ["bad name"]},
               {"_id": "f", "text": "phi", "metadata": {"ragline_acl.hr": True, "ragline_acl_public": True}}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rules = [{"prefix": "", "groups": ["staff"]}]
    docs, ctx = load_docs({"paths": [{"path": str(tmp_path), "name": "kb", "access": rules}], "acl_field": "groups"})
    groups = {sid.split("#")[1]: d.groups for sid, d in docs.items()}
    assert groups == {"a": ["eng", "hr"], "b": ["hr"], "c": ["eng"], "d": ["staff"], "f": ["staff"]}
    assert "groups" not in docs["kb/c.jsonl#a"].metadata and docs["kb/c.jsonl#c"].metadata["lang"] == "en"
    assert access.groups_of(docs["kb/c.jsonl#f"].metadata) == ("staff",)  # a record cannot grant itself access
    assert "ragline_acl_public" not in docs["kb/c.jsonl#f"].metadata
    [failure] = ctx.failures
    assert failure.source_id == "kb/c.jsonl:5" and "record 'e' field 'groups'" in failure.reason
    # the access field is not content: changing it keeps the hash (re-granted, not re-embedded)
    records[0]["groups"] = ["eng"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    again, _ = load_docs({"paths": [{"path": str(tmp_path), "name": "kb", "access": rules}], "acl_field": "groups"})
    assert again["kb/c.jsonl#a"].content_hash == docs["kb/c.jsonl#a"].content_hash
    assert again["kb/c.jsonl#a"].groups == ["eng"]


@pytest.mark.parametrize("group, words", [("bad group", "group name 'bad group' must be 1-64 characters"),
                                          ("", "group name '' must be")])
def test_a_bad_rule_in_pipelines_yaml_is_located(make_project, group, words):
    rules = f'[{{prefix: "hr/", groups: [hr]}}, {{prefix: "", groups: [{group!r}]}}]'
    [error] = validate_file(make_project(site_yaml(rules, "").replace("LLM_URL", '"http://127.0.0.1:9/v1"')))
    assert (error.pipeline, error.step) == ("index", "load") and "access" in error.field
    assert error.line and words in error.message


def test_the_index_sink_gives_every_chunk_exactly_its_documents_groups():
    """Whatever a loader or chunker in between did (a plugin that forgot the keys, or set its own),
    the stores get the document's groups."""
    from ragline.flows.contracts import Chunk, Document
    from ragline.tasks.ingest.index import granted

    documents = [Document(source_id="a", text="x", groups=["hr"]), Document(source_id="b", text="y")]
    chunks = [Chunk(chunk_id="1", source_id="a", ordinal=0, text="x", metadata={"ragline_acl_public": True}),
              Chunk(chunk_id="2", source_id="b", ordinal=0, text="y", metadata={"ragline_acl.hr": True, "k": 1})]
    granted(chunks, documents)
    assert chunks[0].metadata == {"ragline_acl.hr": True}
    assert chunks[1].metadata == {"k": 1, "ragline_acl_public": True}
