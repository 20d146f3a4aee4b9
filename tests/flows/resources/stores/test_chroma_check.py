"""`ragline check` without `--repair` only reads Chroma: a missing collection is reported, never created,
and an older collection's settings (its HNSW sync_threshold) are left as they are. Real embedded Chroma,
SQLite state and BM25 index; no embedding model (the vectors are written by hand)."""
from __future__ import annotations

import chromadb
import pytest
from chromadb.config import Settings

from ragline.flows.cli import main
from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources import clear_cache
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.state import IndexState, StateSpec, StoreMissing
from tests.helpers.data import index_and_search_yaml

IDS = ["a#0", "a#1", "b#0"]


@pytest.fixture
def project(make_project):
    path = make_project(index_and_search_yaml())
    yield path
    clear_cache()


def record_state(project) -> None:
    """The index state names IDS, as an ingestion run would have recorded them."""
    state = IndexState(StateSpec(type="index_state", path="idx/state.sqlite"), base_dir=project.parent)
    docs = [Document(source_id=s, text=f"{s} text", path=s, content_hash=f"h-{s}") for s in ("a", "b")]
    chunks = [Chunk(chunk_id=cid, source_id=cid[0], ordinal=int(cid[-1]), text=f"words of {cid}") for cid in IDS]
    state.record("docs", "fp", docs, chunks)
    state.close()


def client(project) -> chromadb.ClientAPI:
    return chromadb.PersistentClient(path=str(project.parent / "idx" / "chroma"),
                                     settings=Settings(anonymized_telemetry=False))


def check(project, capsys) -> tuple[int, str]:
    clear_cache()  # each command is a new process
    capsys.readouterr()
    code = main(["check", "-f", str(project)])
    return code, capsys.readouterr().out


def test_check_reports_a_missing_collection_and_creates_none(project, capsys):
    record_state(project)
    client(project).create_collection("other", embedding_function=None)  # the store exists, its collection not
    code, out = check(project, capsys)
    assert code == 1 and "chroma: " in out and "the collection does not exist while the index state holds 3 " \
                                                 "chunks" in out
    assert [c.name for c in client(project).list_collections()] == ["other"]


def test_listing_the_ids_of_a_missing_store_or_collection_creates_nothing(tmp_path):
    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="test"), base_dir=tmp_path)
    assert store.all_ids() == set()
    assert not store.path.exists()  # no store folder either
    store.path.mkdir()
    chromadb.PersistentClient(path=str(store.path), settings=Settings(anonymized_telemetry=False)) \
        .create_collection("other", embedding_function=None)
    assert store.all_ids() == set()
    assert [c.name for c in store.client.list_collections()] == ["other"]
    with pytest.raises(StoreMissing):
        store.count()
    store.close()


def test_check_leaves_an_older_collections_sync_threshold_alone(project, capsys):
    record_state(project)
    older = client(project).create_collection("test", embedding_function=None,
                                              configuration={"hnsw": {"space": "cosine"}})  # Chroma's 1,000
    older.add(ids=IDS, embeddings=[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    state = IndexState(StateSpec(type="index_state", path="idx/state.sqlite"), base_dir=project.parent)
    clear_cache()
    from ragline.flows.spec.compile import load_project

    load_project(project).resource("sparse").sync(state)  # BM25 published from the state: it agrees too
    state.close()
    assert check(project, capsys) == (0, "ok: every store agrees with the index state\n")
    assert client(project).get_collection("test").configuration["hnsw"]["sync_threshold"] == 1000
