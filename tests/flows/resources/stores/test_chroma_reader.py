"""The Chroma reader without the chromadb package (flows.resources.stores.chroma_reader, issue 38.1):
on a real store, every read a ChromaStore makes answers what chromadb's own client answers; its
errors are Chroma's; where it cannot open a folder the store reads it with the client instead."""
from __future__ import annotations

import shutil
import sys
import types

import chromadb
import numpy as np
import pytest
from chromadb.config import Settings
from chromadb.errors import NotFoundError

from ragline.flows.resources.stores import chroma_reader
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.state import StoreMissing
from tests.helpers.chroma_vectors import DIM, basis, chunk, unit

ROWS = 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One store written by a ChromaStore (more rows than one HNSW save), in two copies: one for the
    reader, one for chromadb's client (two engines never share a folder)."""
    base = tmp_path_factory.mktemp("written")
    writer = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=base)
    rng = np.random.default_rng(7)
    writer.upsert([chunk(f"e{i:02d}", unit(rng.normal(size=DIM)), source=f"s{i % 3}", lang="en" if i % 2 else "de",
                         year=2000 + i) for i in range(ROWS)])
    writer.record_embedder("key", "model")
    writer.close()
    copies = {}
    for name in ("reader", "client"):
        copies[name] = tmp_path_factory.mktemp(name) / "c"
        shutil.copytree(base / "c", copies[name])
    return copies


@pytest.fixture(scope="module")
def pair(folders):
    reader = chroma_reader.open_reader(folders["reader"])
    client = chromadb.PersistentClient(path=str(folders["client"]), settings=Settings(anonymized_telemetry=False))
    yield reader.get_collection("test"), client.get_collection("test", embedding_function=None)
    reader.close()


def same(ours: dict, theirs: dict) -> None:
    assert ours.keys() >= {k for k in theirs if theirs[k] is not None}
    for key, value in theirs.items():
        if isinstance(value, np.ndarray) or (isinstance(value, list) and value and isinstance(value[0], np.ndarray)):
            np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(value), err_msg=key)
        elif key != "included":
            assert ours[key] == value, key


def test_the_collections_metadata_and_configuration_are_the_clients(pair):
    ours, theirs = pair
    assert ours.metadata == theirs.metadata and ours.metadata["ragline:embedder"] == "key"
    assert ours.configuration["hnsw"] == {**theirs.configuration["hnsw"]}
    assert ours.count() == theirs.count() == ROWS


@pytest.mark.parametrize("call", [
    {"ids": ["e03", "e17", "absent"], "include": []},
    {"include": [], "limit": 7, "offset": 5},
    {"ids": ["e01", "e02"], "include": ["embeddings"]},
    {"ids": ["e05", "e30"], "include": ["metadatas"]},
    {"where": {"lang": "de"}, "include": ["metadatas", "documents"]},
    {"limit": 1, "include": ["embeddings"]},
], ids=["ids", "page", "embeddings", "metadatas", "where", "first"])
def test_gets_answer_what_the_client_answers(pair, call):
    ours, theirs = pair
    same(ours.get(**call), theirs.get(**call))


@pytest.mark.parametrize("where", [None, {"lang": "en"}, {"$and": [{"year": {"$gte": 2010}}, {"source_id": "s1"}]},
                                   {"lang": "none of them"}])
@pytest.mark.parametrize("k", [1, 5, ROWS + 10])
def test_queries_answer_what_the_client_answers(pair, where, k):
    ours, theirs = pair
    vectors = np.asarray([basis(0), unit(np.arange(DIM))], dtype=np.float32)
    include = ["documents", "metadatas", "distances"]
    same(ours.query(query_embeddings=vectors, n_results=k, where=where, include=include),
         theirs.query(query_embeddings=vectors, n_results=k, where=where, include=include))


def test_errors_are_chromas_own(pair, folders):
    ours, _ = pair
    with pytest.raises(NotFoundError):
        chroma_reader.open_reader(folders["reader"]).get_collection("absent")
    with pytest.raises(Exception) as refused:
        ours.query(query_embeddings=np.asarray([basis(0)]), n_results=3, where={"lang": {"$bogus": 1}})
    assert type(refused.value).__module__.startswith("chromadb")


def spread(count: int) -> list[list[float]]:
    """Unit vectors at distinct distances from any query (HNSW orders ties as it likes)."""
    rng = np.random.default_rng(11)
    return [unit(rng.normal(size=DIM)) for _ in range(count)]


def test_a_store_that_only_reads_uses_the_reader_and_answers_as_before(tmp_path):
    written = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=tmp_path)
    written.upsert([chunk(f"e{i}", vector, lang="en") for i, vector in enumerate(spread(DIM))])
    expected = written.query(np.asarray([basis(2)]), k=3)
    written.close()
    reading = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=tmp_path)
    assert reading.query(np.asarray([basis(2)]), k=3) == expected
    assert isinstance(reading._client.get(), chroma_reader.Reader)
    assert reading.count() == DIM and reading.present(["e1", "nope"]) == {"e1"}
    reading.close()
    missing = ChromaStore(ChromaSpec(type="chroma", path="c", collection="other"), base_dir=tmp_path)
    with pytest.raises(StoreMissing, match="the collection does not exist"):
        missing.query(np.asarray([basis(2)]), k=3)
    missing.close()


def test_where_the_reader_cannot_open_the_client_reads(tmp_path, monkeypatch, caplog):
    """Another Chroma release's bindings (a constructor this module does not call right), or a schema
    that needs a migration: the store opens the copy with chromadb's client and answers the same."""
    written = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=tmp_path)
    written.upsert([chunk(f"e{i}", vector) for i, vector in enumerate(spread(DIM))])
    expected = written.query(np.asarray([basis(4)]), k=2)
    written.close()
    # A release whose bindings lack what the reader calls (chromadb's own shim keeps the real module).
    monkeypatch.setitem(sys.modules, "chromadb_rust_bindings", types.ModuleType("chromadb_rust_bindings"))
    with pytest.raises(chroma_reader.ReaderUnsupported, match="not the release this reader calls"):
        chroma_reader.open_reader(tmp_path / "c")
    reading = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=tmp_path)
    with caplog.at_level("DEBUG", logger="ragline.chroma"):
        assert reading.query(np.asarray([basis(4)]), k=2) == expected
    assert not isinstance(reading._client.get(), chroma_reader.Reader)
    assert "reading with chromadb's client (chromadb_rust_bindings is not the release" in caplog.text
    assert reading.count() == DIM
    reading.close()
