"""Unit tests for the Chroma vector store (flows.resources.chroma): embedded, persisted in tmp_path,
plus its server-mode fault handling with the server faked or absent (tests/integration has a real one)."""
from __future__ import annotations

import logging
import time

import httpx
import numpy as np
import pytest
from chromadb.errors import InvalidArgumentError

from ragline.flows.contracts import Chunk, Passage
from ragline.flows.errors import IndexUnavailable
from ragline.flows.resources.stores.state import StoreMissing
from ragline.flows.resources.stores.chroma import (ChromaSpec, ChromaStore, ChromaUnavailable, EmbedderMismatch,
                                            chroma_metadata, is_transient)
from tests.helpers.chroma_vectors import DIM, basis, chunk, make, unit
from tests.helpers.harness import free_port



@pytest.fixture
def store(tmp_path):
    return make(tmp_path)


@pytest.fixture
def filled(store):
    store.upsert([chunk(f"e{i}", basis(i), source=f"s{i % 2}", lang="en" if i < 6 else "de", year=2015 + i)
                  for i in range(DIM)])
    return store


def test_empty_store(store):
    for read in (store.count, lambda: store.query(np.asarray([basis(0)]), k=3), lambda: store.existing_collection):
        with pytest.raises(StoreMissing, match="there is no store at"):
            read()  # a read never creates the store (queries never write)
    assert not store.path.exists()
    store.collection  # a writer opens (creates) it
    assert store.count() == 0
    assert store.all_ids() == set()
    assert store.query(np.asarray([basis(0), basis(1)]), k=3) == [[], []]
    assert store.path == (store.base_dir / "c").resolve()
    assert str(store.path) in store.location


def test_existing_collection_reads_and_creates_no_other_collection(filled, tmp_path):
    got = filled.existing_collection.get(include=["embeddings"])  # what the benches read through
    assert sorted(got["ids"]) == sorted(f"e{i}" for i in range(DIM)) and len(got["embeddings"]) == DIM
    other = ChromaStore(ChromaSpec(type="chroma", path="c", collection="other"), base_dir=tmp_path)  # never written
    with pytest.raises(StoreMissing, match="the collection does not exist"):
        other.existing_collection
    assert [c.name for c in filled.client.list_collections()] == ["test"]


def test_upsert_count_all_ids_delete(filled):
    assert filled.count() == DIM
    assert filled.all_ids() == {f"e{i}" for i in range(DIM)}
    filled.delete(["e0", "e3", "never-there"])
    assert filled.count() == DIM - 2
    assert filled.all_ids() == {f"e{i}" for i in range(DIM)} - {"e0", "e3"}
    filled.delete([])
    assert filled.count() == DIM - 2


def test_upsert_same_id_twice_keeps_one_row(store):
    store.upsert([chunk("a", basis(0), lang="en")])
    store.upsert([chunk("a", basis(5), lang="de")])
    assert store.count() == 1
    [[hit]] = store.query(np.asarray([basis(5)]), k=5)
    assert hit.chunk_id == "a"
    assert hit.metadata["lang"] == "de"
    assert hit.score == pytest.approx(1.0, abs=1e-5)


def test_query_returns_passages_with_scores(filled):
    q = unit([1.0, 0.2, 0, 0, 0, 0, 0, 0])
    [hits] = filled.query(np.asarray([q]), k=3, retriever="dense_step")
    assert [h.chunk_id for h in hits][:2] == ["e0", "e1"]
    top = hits[0]
    assert isinstance(top, Passage)
    assert top.score == pytest.approx(float(np.dot(q, basis(0))), abs=1e-4)  # cosine similarity
    assert hits[1].score == pytest.approx(float(np.dot(q, basis(1))), abs=1e-4)
    assert top.score > hits[1].score > hits[2].score
    assert top.retriever == "dense_step"
    assert top.source_id == "s0" and top.title == "title s0" and top.text == "text of e0"
    # reserved keys moved into the passage fields; "ordinal" dropped
    assert top.metadata == {"chunk": 0, "lang": "en", "year": 2015}


def test_query_several_vectors_at_once(filled):
    results = filled.query(np.asarray([basis(2), basis(7)]), k=1)
    assert [[p.chunk_id for p in r] for r in results] == [["e2"], ["e7"]]


def test_query_where_filter(filled):
    [hits] = filled.query(np.asarray([basis(0)]), k=8, where={"lang": "de"})
    assert {h.chunk_id for h in hits} == {"e6", "e7"}
    [hits] = filled.query(np.asarray([basis(0)]), k=8,
                          where={"$and": [{"lang": "en"}, {"year": {"$gte": 2019}}]})
    assert {h.chunk_id for h in hits} == {"e4", "e5"}
    [hits] = filled.query(np.asarray([basis(0)]), k=8, where={"source_id": "s1"})
    assert {h.chunk_id for h in hits} == {"e1", "e3", "e5", "e7"}


def test_l2_space_scores_are_negative_distances(tmp_path):
    store = make(tmp_path, space="l2")
    store.upsert([chunk("a", basis(0)), chunk("b", basis(1))])
    [hits] = store.query(np.asarray([basis(0)]), k=2)
    assert [h.chunk_id for h in hits] == ["a", "b"]
    assert hits[0].score == pytest.approx(0.0, abs=1e-5)
    assert hits[1].score == pytest.approx(-2.0, abs=1e-4)  # Chroma's l2 is the squared distance


def test_reset_drops_the_collection(filled):
    filled.reset()
    with pytest.raises(StoreMissing, match="the collection does not exist"):
        filled.count()
    filled.reset()  # an absent collection is fine
    filled.upsert([chunk("x", [1.0, 0.0, 0.0])])  # a new dimension is accepted after a reset
    assert filled.all_ids() == {"x"}


def test_data_persists_for_a_new_store_on_the_same_path(tmp_path, filled):
    again = make(tmp_path)
    assert again.count() == DIM
    assert again.all_ids() == filled.all_ids()


def test_hnsw_configuration_is_applied(tmp_path):
    store = make(tmp_path, space="ip", ef_construction=123, max_neighbors=17, ef_search=77)
    hnsw = store.collection.configuration["hnsw"]
    assert hnsw["space"] == "ip"
    assert hnsw["ef_construction"] == 123
    assert hnsw["max_neighbors"] == 17
    assert hnsw["ef_search"] == 77
    # read back by a fresh client from the persisted collection
    reread = make(tmp_path)
    persisted = reread.client.get_collection("test").configuration["hnsw"]
    assert (persisted["space"], persisted["ef_construction"], persisted["max_neighbors"],
            persisted["ef_search"]) == ("ip", 123, 17, 77)


def test_default_hnsw_configuration(store):
    hnsw = store.collection.configuration["hnsw"]
    assert (hnsw["space"], hnsw["ef_construction"], hnsw["max_neighbors"], hnsw["ef_search"]) == \
        ("cosine", 200, 32, 200)


def test_sync_threshold_is_set_at_creation_and_on_an_older_collection_when_written(tmp_path):
    """A collection saves its HNSW index every ``sync_threshold`` vectors, so a new process replays at most
    that many unsaved ones when it opens the store; one made with Chroma's default (1,000) is changed by the
    next writer, and a reader never changes it (queries do not write)."""
    assert make(tmp_path / "new").collection.configuration["hnsw"]["sync_threshold"] == 100
    older = make(tmp_path / "old")
    older.client.create_collection("test", embedding_function=None, configuration={"hnsw": {"space": "cosine"}})
    assert older.client.get_collection("test").configuration["hnsw"]["sync_threshold"] == 1000
    run = make(tmp_path / "old", sync_threshold=250)
    run.count()  # an ingestion run's integrity check reads first (the handle it opens is then written)
    assert make(tmp_path / "old").client.get_collection("test").configuration["hnsw"]["sync_threshold"] == 1000
    run.upsert([chunk("e0", basis(0))])
    assert make(tmp_path / "old").client.get_collection("test").configuration["hnsw"]["sync_threshold"] == 250


def test_a_writer_opens_and_aligns_its_handle_once(tmp_path, monkeypatch):
    """The sync_threshold is set where a writer's handle is opened, not looked at again per write; a
    handle a read opened is replaced at the first write, and a later read keeps the writer's."""
    make(tmp_path).collection  # an earlier run made the collection
    store = make(tmp_path)
    opened = []
    original = store.client.get_or_create_collection
    monkeypatch.setattr(store.client, "get_or_create_collection",
                        lambda *a, **k: opened.append(a) or original(*a, **k))
    assert store.count() == 0  # a read opens a read handle
    assert opened == []
    for i in range(3):
        store.upsert([chunk(f"e{i}", basis(i))])
        store.count()
    assert opened == [("test",)] and store.count() == 3


def test_a_write_refused_by_sqlites_lock_is_run_again(tmp_path, monkeypatch, caplog):
    """SQLite refuses a transaction that reads then writes while another connection holds the
    write lock, at once (its deadlock rule, no busy wait): the call is run again, on a handle opened
    afresh. A mock: the refusal needs two connections' transactions interleaved inside Chroma."""
    from chromadb.errors import InternalError

    store = make(tmp_path)
    refusals = [InternalError("Database error: error returned from database: (code: 5) database is locked")] * 2
    original = store.client.get_or_create_collection

    def contended(*args, **kwargs):
        if refusals:
            raise refusals.pop()
        return original(*args, **kwargs)

    monkeypatch.setattr(store.client, "get_or_create_collection", contended)
    with caplog.at_level(logging.WARNING, logger="ragline.chroma"):
        store.upsert([chunk("a", basis(0))])
    assert store.count() == 1 and not refusals
    assert [r.getMessage().count("found the database locked") for r in caplog.records] == [1, 1]


def test_a_lock_that_stays_is_reported_after_the_attempts(tmp_path, monkeypatch):
    from chromadb.errors import InternalError

    from ragline.flows.resources.stores import chroma

    monkeypatch.setattr(chroma, "_LOCKED_ATTEMPTS", 2)
    store = make(tmp_path)
    calls = []

    def locked(*args, **kwargs):
        calls.append(args)
        raise InternalError("(code: 5) database is locked")

    monkeypatch.setattr(store.client, "get_or_create_collection", locked)
    with pytest.raises(IndexUnavailable, match=r"upsert found .*chroma\.sqlite3 locked 2 times; is another process") as err:
        store.upsert([chunk("a", basis(0))])
    assert len(calls) == 2 and isinstance(err.value.__cause__, InternalError) and str(tmp_path) in str(err.value)


def test_writes_in_batches(tmp_path):
    store = make(tmp_path, write_batch_size=7)
    rng = np.random.default_rng(0)
    chunks = [chunk(f"r{i:02d}", rng.standard_normal(DIM).tolist(), source=f"s{i}") for i in range(50)]
    store.upsert(chunks)
    assert store.count() == 50
    assert store.all_ids() == {c.chunk_id for c in chunks}
    store.delete([c.chunk_id for c in chunks[:45]])
    assert store.all_ids() == {c.chunk_id for c in chunks[45:]}


def test_write_batch_size_above_the_client_limit(tmp_path):
    # the spec allows up to 40k per call; embedded Chroma refuses calls above its own maximum
    store = make(tmp_path, write_batch_size=40_000, ef_construction=10, max_neighbors=4, ef_search=10)
    n = store.client.get_max_batch_size() + 1
    chunks = [Chunk(chunk_id=f"b{i}", source_id="s", ordinal=i, text="", embedding=[1.0, float(i)])
              for i in range(n)]
    store.upsert(chunks)
    assert store.count() == n
    store.delete([c.chunk_id for c in chunks])
    assert store.count() == 0


def test_all_ids_pages_through_large_collections(tmp_path):
    # all_ids reads 20,000 ids per page: one more than a page needs a second one
    store = make(tmp_path, ef_construction=10, max_neighbors=4, ef_search=10)
    n = 20_001
    rng = np.random.default_rng(1)
    vectors = rng.random((n, 2), dtype=np.float32)
    step = store.client.get_max_batch_size()
    for start in range(0, n, step):
        store.collection.add(ids=[f"p{i}" for i in range(start, min(n, start + step))],
                             embeddings=vectors[start:start + step])
    ids = store.all_ids()
    assert len(ids) == n
    assert ids == {f"p{i}" for i in range(n)}


def test_chroma_metadata_reserved_keys_and_none():
    c = Chunk(chunk_id="c", source_id="real", ordinal=3, text="t", title="T",
              metadata={"source_id": "fake", "title": "fake", "ordinal": 99, "lang": "en"})
    c.metadata["gone"] = None  # None is not storable in Chroma
    assert chroma_metadata(c) == {"lang": "en", "source_id": "real", "title": "T", "ordinal": 3}


def test_spec_validation():
    with pytest.raises(ValueError):
        ChromaSpec(type="chroma", collection="ab")  # Chroma needs >= 3 characters
    with pytest.raises(ValueError):
        ChromaSpec(type="chroma", space="dot")
    with pytest.raises(ValueError):
        ChromaSpec(type="chroma", max_neighbors=2)
    for bad in ({"retries": -1}, {"retry_max_seconds": 0}, {"timeout_seconds": 0}, {"auth_token_env": "not-a-name"},
                {"auth_header": "Cookie"}, {"port": 0}):
        with pytest.raises(ValueError):
            ChromaSpec(type="chroma", host="h", **bad)


# ----------------------------------------------------------------------------- queries without count()
def test_query_makes_no_count_round_trip(filled, monkeypatch):
    def no_count(*_a, **_k):
        raise AssertionError("query must not call count()")

    monkeypatch.setattr(type(filled.collection), "count", no_count)
    [hits] = filled.query(np.asarray([basis(3)]), k=3)
    assert hits[0].chunk_id == "e3"


def test_k_larger_than_the_collection_returns_what_there_is(store):
    store.upsert([chunk("a", basis(0)), chunk("b", basis(1))])
    results = store.query(np.asarray([basis(0), basis(1)]), k=50)
    assert [[p.chunk_id for p in r] for r in results] == [["a", "b"], ["b", "a"]]
    assert store.query(np.zeros((0, DIM)), k=5) == []


def test_telemetry_is_off(store):
    assert store.client.get_settings().anonymized_telemetry is False


# ----------------------------------------------------------------------------- stale handles
def test_stale_collection_handle_is_reopened(tmp_path, filled):
    """Another store on the same path drops and rebuilds the collection: the cached handle re-opens."""
    other = make(tmp_path)
    other.reset()
    other.upsert([chunk("new", basis(2))])
    [[hit]] = filled.query(np.asarray([basis(2)]), k=5)
    assert hit.chunk_id == "new"
    assert filled.all_ids() == {"new"}
    filled.upsert([chunk("more", basis(3))])
    assert other.all_ids() == {"new", "more"}


def test_vectors_of_another_embedder_are_refused_until_re_embedded(tmp_path, filled):
    filled.check_embedder("aaaa", "all-MiniLM-L6-v2")  # written before embedders were recorded: trusted
    filled.record_embedder("aaaa", "all-MiniLM-L6-v2")
    filled.check_embedder("aaaa", "all-MiniLM-L6-v2")
    with pytest.raises(EmbedderMismatch) as caught:
        filled.check_embedder("bbbb", "/models/adapted")
    message = str(caught.value)
    assert "'all-MiniLM-L6-v2'" in message and "'/models/adapted'" in message and "re-embed" in message
    assert filled.spec.collection in message and "ragline run index" in message
    # another process re-embeds with the new model: this handle's metadata is stale, the check re-reads it
    other = make(tmp_path)
    other.record_embedder("bbbb", "/models/adapted")
    filled.check_embedder("bbbb", "/models/adapted")
    assert make(tmp_path).collection.configuration["hnsw"]["space"] == "cosine"  # the metadata kept it
    filled.reset()
    filled.collection  # a new collection names no embedder yet
    filled.check_embedder("cccc", "other")


# ----------------------------------------------------------------------------- server-mode faults (no server)
class FakeCollection:
    def __init__(self, result=7, error: Exception | None = None):
        self.result, self.error, self.calls = result, error, 0

    def count(self) -> int:
        self.calls += 1
        if self.error:
            raise self.error
        return self.result


def server_store(port: int = 8000, **spec) -> ChromaStore:
    return ChromaStore(ChromaSpec(type="chroma", host="127.0.0.1", port=port, collection="test", **spec))


def flaky_open(failures: int, collection: FakeCollection):
    """An _open that cannot connect ``failures`` times, then returns ``collection``."""
    attempts = []

    def _open(create: bool = True):
        attempts.append(time.monotonic())
        if len(attempts) <= failures:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return collection

    return _open, attempts


def test_transient_failures_are_retried_with_backoff(monkeypatch, caplog):
    store = server_store(retries=5)
    _open, attempts = flaky_open(3, FakeCollection(result=7))
    monkeypatch.setattr(store, "_open", _open)
    with caplog.at_level(logging.WARNING, logger="ragline.chroma"):
        assert store.count() == 7
    assert len(attempts) == 4
    gaps = np.diff(attempts)
    assert gaps[0] >= 0.2 and gaps[1] > gaps[0] and gaps[2] > gaps[1]  # exponential
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 3 and "127.0.0.1:8000" in retries[0] and "ConnectError" in retries[0]


def test_gives_up_at_the_deadline_naming_the_server(monkeypatch):
    store = server_store(port=8123, retries=100, retry_max_seconds=1.0)
    _open, attempts = flaky_open(10_000, FakeCollection())
    monkeypatch.setattr(store, "_open", _open)
    with pytest.raises(ChromaUnavailable, match=r"http://127\.0\.0\.1:8123 unreachable: count failed") as err:
        store.count()
    assert 2 <= len(attempts) < 10  # the 1 s deadline ended it, not the 100 retries
    assert isinstance(err.value.__cause__, httpx.ConnectError)


def test_gives_up_after_the_retry_count(monkeypatch):
    store = server_store(retries=2)
    _open, attempts = flaky_open(10_000, FakeCollection())
    monkeypatch.setattr(store, "_open", _open)
    with pytest.raises(ChromaUnavailable, match="failed 3 times"):
        store.count()
    assert len(attempts) == 3


def test_refused_requests_are_not_retried(monkeypatch):
    store = server_store(retries=5)
    collection = FakeCollection(error=InvalidArgumentError("bad where"))
    monkeypatch.setattr(store, "_open", lambda create=True: collection)
    with pytest.raises(InvalidArgumentError):
        store.count()
    assert collection.calls == 1


def test_embedded_mode_does_not_retry(tmp_path, monkeypatch):
    store = make(tmp_path)
    _open, attempts = flaky_open(1, FakeCollection())
    monkeypatch.setattr(store, "_open", _open)
    with pytest.raises(httpx.ConnectError):
        store.count()
    assert len(attempts) == 1


def test_no_server_listening_fails_clearly():
    """A real HttpClient against a closed port: connection refused, retried, then one clear error."""
    port = free_port()
    store = server_store(port=port, retries=2, retry_max_seconds=60)  # the attempts end it, not the budget
    with pytest.raises(ChromaUnavailable, match=f"127.0.0.1:{port} unreachable: query failed 3 times") as err:
        store.query(np.asarray([basis(0)]), k=3)
    assert "is it running?" in str(err.value)
    assert is_transient(err.value.__cause__)


def test_transient_classification():
    assert is_transient(httpx.ReadTimeout("slow"))
    assert is_transient(httpx.RemoteProtocolError("Server disconnected"))
    assert not is_transient(InvalidArgumentError("bad"))
    assert not is_transient(ValueError("bad value"))
    try:
        try:
            raise httpx.ConnectError("refused")
        except httpx.ConnectError:
            raise ValueError("Could not connect to a Chroma server. Are you sure it is running?")
    except ValueError as wrapped:
        assert is_transient(wrapped)  # how chromadb's client constructor reports it


# ----------------------------------------------------------------------------- auth token
def test_auth_token_comes_from_the_environment(monkeypatch):
    store = server_store(auth_token_env="RAGLINE_TEST_CHROMA_TOKEN", auth_header="X-Chroma-Token")
    monkeypatch.delenv("RAGLINE_TEST_CHROMA_TOKEN", raising=False)
    with pytest.raises(ValueError, match="RAGLINE_TEST_CHROMA_TOKEN"):
        store.count()  # not transient: raised at once, not retried
    monkeypatch.setenv("RAGLINE_TEST_CHROMA_TOKEN", "s3cret-token")
    settings = store._settings()
    assert settings.chroma_client_auth_credentials == "s3cret-token"
    assert settings.chroma_auth_token_transport_header == "X-Chroma-Token"
    assert settings.anonymized_telemetry is False
    for shown in (store.location, store.spec.model_dump_json(), repr(store.spec)):
        assert "s3cret" not in shown


def test_embedded_mode_ignores_the_token(tmp_path, monkeypatch):
    monkeypatch.delenv("RAGLINE_TEST_CHROMA_TOKEN", raising=False)
    store = make(tmp_path, auth_token_env="RAGLINE_TEST_CHROMA_TOKEN")
    assert store._settings().chroma_client_auth_provider is None
    store.collection
    assert store.count() == 0
