"""Which named collections a request searches (issue 19 item 1): what it names, within what its
principal may query; by default all of those; a step that reads one fixed index (FLARE's store) needs
the scope on that index whatever the request names."""
from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from ragline.flows.serve.auth.principals import Principal, may_query, query_collections
from ragline.flows.serve.query_service import ApiError
from ragline.flows.spec.compile import load_project
from tests.helpers.collection_specs import PIPELINES, RESOURCES

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
ARCHIVED = RESOURCES + LLM + """  archive: {type: chroma, path: idx/chroma, collection: archive}
collections:
  handbook: {paths: [handbook]}
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,  task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed}
      - {id: write, task: index, uses: [store, sparse, state]}
  archived:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, uses: [store, embedder]}
      - {id: fuse,   task: fuse}
      - {id: insert, task: insert}
      - {id: answer, task: generate_flare, uses: [llm, archive, embedder]}
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


def test_a_step_over_one_fixed_index_needs_the_scope_on_it(tmp_path):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(ARCHIVED))
    archived = load_project(path, tuned=False).pipeline("archived")  # FLARE re-retrieves from 'archive'
    assert archived.collections == ["handbook"]
    with pytest.raises(ApiError) as refused:
        query_collections(request_of({"handbook"}), archived, ["handbook"])
    assert refused.value.status == 403 and "'archive'" in refused.value.message
    assert not may_query(request_of({"handbook"}).state.principal, archived)
    assert query_collections(request_of({"handbook", "archive"}), archived, None)[1] == ["handbook"]


def test_a_step_over_the_templates_index_needs_only_the_collections_searched(project):
    active = project.pipeline("active")  # FLARE's store is the template's: it searches the query's collections
    assert query_collections(request_of({"handbook"}), active, None)[1] == ["handbook"]
    assert may_query(request_of({"handbook"}).state.principal, active)
