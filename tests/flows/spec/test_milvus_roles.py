"""One milvus resource for both index roles with only the resource lines of pipelines.yaml changed:
`store: &milvus {...}` and `sparse: *milvus` bind steps that name no resource (several fit: the one named
after the role), and the index sink refuses a milvus `sparse` that is not its own store."""
from __future__ import annotations

import textwrap

import pytest

from ragline.flows.errors import ConfigError
from ragline.flows.resources.stores.milvus import MilvusSpec, MilvusStore, check_roles
from ragline.flows.spec.compile import load_project
from tests.helpers.data import index_and_search_yaml

CHROMA_LINES = """  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
"""
ANCHORED = """  store:    &milvus {type: milvus, uri: idx/milvus.db, collection: test}
  sparse:   *milvus
"""


def test_anchored_milvus_lines_bind_both_roles(tmp_path):
    text = textwrap.dedent(index_and_search_yaml())
    assert CHROMA_LINES in text
    (tmp_path / "pipelines.yaml").write_text(text.replace(CHROMA_LINES, ANCHORED))
    project = load_project(tmp_path / "pipelines.yaml")
    write = project.pipeline("index").steps[-1]
    assert (write.resources["store"], write.resources["sparse"]) == ("store", "sparse")
    assert project.resource("store") is project.resource("sparse")  # one engine, one instance
    assert [s.resources for s in project.pipeline("search").steps[:2]] == [
        {"store": "store", "embedder": "embedder"}, {"sparse": "sparse", "state": "state"}]


def test_a_milvus_sparse_must_be_the_store_itself(tmp_path):
    store = MilvusStore(MilvusSpec(type="milvus", collection="a"), tmp_path)
    other = MilvusStore(MilvusSpec(type="milvus", collection="b"), tmp_path)
    check_roles(store, store)
    with pytest.raises(ConfigError, match="name the same milvus resource for both"):
        check_roles(store, other)


def test_bm25_settings_leave_the_fingerprint_alone_the_vectors_do_not():
    """Other BM25 settings rebuild the collection from its own rows (sync): no source is re-indexed for
    them; the distance or the index is what the vectors were written with."""
    base = MilvusStore.fingerprint_fields(MilvusSpec(type="milvus"))
    for change in ({"analyzer": "english"}, {"stemmer": "none"}, {"stopwords": "none"}, {"k1": 1.5}, {"b": 0.5}):
        assert MilvusStore.fingerprint_fields(MilvusSpec(type="milvus", **change)) == base
    assert MilvusStore.fingerprint_fields(MilvusSpec(type="milvus", space="ip")) != base
