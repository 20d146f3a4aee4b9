"""A collection-scoped key reaches a milvus-backed pipeline only with a grant on its collection, as on Chroma."""
from __future__ import annotations

from ragline.flows.serve.auth.principals import Principal, collections_of
from ragline.flows.spec.compile import load_project

MILVUS = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: milvus, uri: idx/milvus.db, collection: team-docs}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load, task: load, with: {paths: [docs]}}
      - {id: chunk, task: chunk}
      - {id: embed, task: embed}
      - {id: write, task: index}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense}
      - {id: sparse, task: retrieve_sparse, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
"""


def test_milvus_pipelines_touch_their_collection(tmp_path):
    (tmp_path / "pipelines.yaml").write_text(MILVUS)
    project = load_project(tmp_path / "pipelines.yaml")
    assert collections_of(project.pipeline("search")) == {"team-docs"}
    assert collections_of(project.pipeline("index")) == {"team-docs"}
    other = Principal(id="k", kind="key", scopes=frozenset({"query"}), collections=frozenset({"other"}))
    assert other.missing("query", collections_of(project.pipeline("search"))) == "scope 'query' on collection 'team-docs'"
