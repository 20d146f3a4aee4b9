"""Which named collections a request searches (issue 19 item 1): what it names, within what its
principal may query; by default all of those; a step that reads one fixed index (FLARE's store) needs
the scope on that index whatever the request names."""
from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from ragline.flows.serve.principals import Principal, may_query, query_collections
from ragline.flows.serve.query_service import ApiError
from ragline.flows.spec.compile import load_project
from tests.flows.spec.test_collections import PIPELINES, RESOURCES

LLM = "  llm: {type: openai_compatible, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
FLARE = """
  active:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense}
      - {id: fuse,   task: fuse}
      - {id: insert, task: insert}
      - {id: answer, task: generate_flare}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    path = tmp_path_factory.mktemp("scopes") / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + LLM + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
""" + PIPELINES + FLARE))
    return load_project(path, tuned=False)


def request_of(collections: set[str]):
    principal = Principal(id="key:1", kind="key", scopes=frozenset({"query"}), collections=frozenset(collections))
    return SimpleNamespace(state=SimpleNamespace(principal=principal))


def test_a_request_searches_what_it_names_within_what_it_may_query(project):
    search = project.pipeline("search")
    assert query_collections(request_of({"handbook"}), search, None)[1] == ["handbook"]
    assert query_collections(request_of({"*"}), search, None)[1] == ["handbook", "papers"]
    assert query_collections(request_of({"*"}), search, ["papers", "papers"])[1] == ["papers"]
    with pytest.raises(ApiError) as refused:
        query_collections(request_of({"handbook"}), search, ["papers"])
    assert refused.value.status == 403 and "'papers'" in refused.value.message
    with pytest.raises(ApiError) as unknown:
        query_collections(request_of({"*"}), search, ["memos"])
    assert unknown.value.status == 400 and unknown.value.param == "collections"
    with pytest.raises(ApiError) as none:
        query_collections(request_of({"other"}), search, None)
    assert none.value.status == 403


def test_a_step_over_one_fixed_index_needs_the_scope_on_it(project):
    active = project.pipeline("active")  # FLARE re-retrieves from the template's store ('test')
    assert active.collections == ["handbook", "papers"]
    with pytest.raises(ApiError) as refused:
        query_collections(request_of({"handbook"}), active, ["handbook"])
    assert refused.value.status == 403 and "'test'" in refused.value.message
    assert not may_query(request_of({"handbook"}).state.principal, active)
    assert query_collections(request_of({"handbook", "test"}), active, None)[1] == ["handbook"]
