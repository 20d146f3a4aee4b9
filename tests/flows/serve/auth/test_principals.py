"""Principals and the collections a pipeline touches (issue 19 item 2)."""
from __future__ import annotations

import pytest

from ragline.flows.serve.auth.keys import KeyStore, keys_file
from ragline.flows.serve.auth.principals import LOCAL, Authenticator, Principal, collections_of
from ragline.flows.spec.compile import load_project

TWO_COLLECTIONS = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store_a:  {type: chroma, path: a/chroma, collection: alpha}
  sparse_a: {type: bm25, path: a/bm25}
  state_a:  {type: index_state, path: a/state.sqlite}
  store_b:  {type: chroma, path: b/chroma, collection: beta}
  sparse_b: {type: bm25, path: b/bm25}
  state_b:  {type: index_state, path: b/state.sqlite}
pipelines:
  index_a:
    kind: ingestion
    steps:
      - {id: load, task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed, uses: [embedder]}
      - {id: write, task: index, uses: [store_a, sparse_a, state_a]}
  index_b:
    kind: ingestion
    steps:
      - {id: load, task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed, uses: [embedder]}
      - {id: write, task: index, uses: [store_b, sparse_b, state_b]}
  search_a:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, uses: [store_a, embedder]}
      - {id: fuse, task: fuse}
  bm25_b:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, uses: [sparse_b, state_b]}
      - {id: fuse, task: fuse}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("principals")
    (folder / "pipelines.yaml").write_text(TWO_COLLECTIONS)
    return load_project(folder / "pipelines.yaml")


def test_a_pipeline_touches_the_collections_of_its_stores_and_of_the_indexes_its_bm25_belongs_to(project):
    assert collections_of(project.pipeline("index_a")) == {"alpha"}
    assert collections_of(project.pipeline("search_a")) == {"alpha"}
    assert collections_of(project.pipeline("bm25_b")) == {"beta"}  # no Chroma of its own: its index's


def test_missing_names_the_scope_or_the_collections_and_admin_implies_every_scope():
    reader = Principal("key:1", "key", frozenset({"query"}), frozenset({"alpha"}), frozenset({"hr"}))
    assert reader.may("query", {"alpha"}) and not reader.may("upload", {"alpha"})
    assert reader.missing("upload", {"alpha"}) == "scope 'upload' on collection 'alpha'"
    assert reader.missing("query", {"alpha", "beta", "gamma"}) == "scope 'query' on collections 'beta', 'gamma'"
    assert reader.missing("query", ()) is None and reader.missing("delete", ()) == "scope 'delete'"
    admin = Principal("key:2", "key", frozenset({"admin"}), frozenset({"*"}))
    assert admin.may("delete", {"anything"}) and LOCAL.may("admin")


def test_the_authenticator_asks_for_credentials_once_any_exists(tmp_path):
    auth = Authenticator(None, tmp_path)
    assert not auth.required() and auth.authenticate([]).principal == LOCAL
    _, key = KeyStore(keys_file(tmp_path)).create("ci", ["query"], ["alpha"], ["hr"])
    assert auth.required()
    assert auth.authenticate([]).principal is None
    header = [(b"authorization", f"Bearer {key}".encode())]
    principal = auth.authenticate(header).principal
    assert (principal.kind, principal.scopes, principal.collections, principal.groups) == \
        ("key", {"query"}, {"alpha"}, {"hr"})
    assert auth.authenticate([(b"authorization", b"Bearer rl_nope")]).refusal == "not a ragline API key"


def test_the_legacy_token_is_admin_on_everything(tmp_path):
    auth = Authenticator("s3cret", tmp_path)
    principal = auth.authenticate([(b"authorization", b"Bearer s3cret")]).principal
    assert principal.kind == "legacy-token" and principal.may("admin", {"any"})
    assert auth.authenticate([(b"authorization", b"Bearer s3cretx")]).principal is None
