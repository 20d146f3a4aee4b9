"""The Resource protocol on every built-in type, with the real thing (packaged MiniLM, a tiny local
cross-encoder, embedded Chroma, bm25s, SQLite, a scripted OpenAI-compatible server): ``warm_up``
loads what the first query would and creates nothing on disk, ``health`` says whether it can serve
(a store against its index state), ``close`` lets go and a later use loads again."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from ragline.flows.contracts import Chunk, Document
from ragline.flows.resources import GROUP, Resource, clear_cache, get_resource, resource_types
from ragline.flows.resources.base import Health, Lazy
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.models.cross_encoder import CrossEncoderModel, CrossEncoderSpec
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.resources.stores.state import IndexState, StateSpec
from tests.scripted_llm import ScriptedLLM


def chunks(n: int, dim: int = 4) -> list[Chunk]:
    return [Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=f"penguins number {i} swim",
                  embedding=np.eye(dim, dtype=np.float32)[i % dim].tolist()) for i in range(n)]


def recorded(state: IndexState, items: list[Chunk]) -> IndexState:
    docs = [Document(source_id=c.source_id, text=c.text, content_hash="h") for c in items]
    state.record("root", "fp", docs, items)
    return state


# ----------------------------------------------------------------------------- the registry
def test_every_builtin_type_is_a_resource_registered_by_entry_point():
    types = resource_types()
    assert {"sentence_transformer", "chroma", "bm25", "index_state", "openai_compatible",
            "cross_encoder"} <= set(types), GROUP
    assert all(issubclass(cls, Resource) and cls.type_name() == name for name, cls in types.items())
    assert {name for name, cls in types.items() if cls.located} >= {"chroma", "bm25", "index_state"}
    assert not types["sentence_transformer"].located and not types["openai_compatible"].located


def test_located_resources_are_per_data_folder_and_models_are_shared(tmp_path):
    state, embedder = StateSpec(type="index_state"), EmbedderSpec(type="sentence_transformer")
    assert get_resource(state, tmp_path / "a") is not get_resource(state, tmp_path / "b")
    assert get_resource(embedder, tmp_path / "a") is get_resource(embedder, tmp_path / "b")
    clear_cache()
    assert not (tmp_path / "a").exists()  # constructing (and closing) creates nothing


def test_lazy_builds_once_under_concurrency_and_reset_forgets():
    built: list[int] = []

    def build() -> int:
        time.sleep(0.05)
        built.append(1)
        return len(built)

    lazy = Lazy(build)
    threads = [threading.Thread(target=lazy.get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1] and lazy.loaded and lazy.get() == 1
    assert lazy.reset() == 1 and not lazy.loaded and lazy.reset() is None
    assert lazy.get() == 2
    none = Lazy(lambda: None)
    assert none.get() is None and none.loaded  # None is a value: built once, not on every use


# ----------------------------------------------------------------------------- models
def test_embedder_warm_up_health_close():
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    assert embedder.health().status == "degraded" and embedder.health().detail["loaded"] is False
    embedder.warm_up()
    assert embedder.health() == Health.up(model="all-MiniLM-L6-v2", loaded=True)
    started = time.process_time()  # CPU time (a model load is seconds of it; load does not inflate it)
    embedder.encode_queries(["how do penguins swim"])
    assert time.process_time() - started < 2.0  # warm: no model load on the first real use
    embedder.close()
    assert embedder.health().status == "degraded"
    assert embedder.encode_queries(["again"]).shape == (1, 384)  # a later use loads it again


def test_cross_encoder_warm_up_health_close(tiny_cross_encoder_dir):
    model = CrossEncoderModel(CrossEncoderSpec(type="cross_encoder", model=str(tiny_cross_encoder_dir)))
    assert model.health().status == "degraded"
    model.warm_up()
    assert model.health().status == "up" and model._model.loaded
    model.close()
    assert model.health().status == "degraded" and not model._model.loaded
    assert len(model.score("q", ["a", "b"])) == 2


def test_llm_warm_up_asks_nothing_health_tells_up_from_down_close():
    with ScriptedLLM() as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url))
        llm.warm_up()
        assert server.paths == [] and llm._client.loaded  # the server may still be starting: not asked
        health = llm.health()
        assert health.status == "up" and health.detail["model"] == "smollm2", health
        assert llm.chat("hi").text == "ok"
        llm.close()
        assert not llm._client.loaded
        assert llm.chat("hi again").text == "ok"  # a new client after close
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = LLMClient(LLMSpec(type="openai_compatible", base_url=f"http://127.0.0.1:{port}/v1")).health()
    assert down.status == "down" and "unreachable" in down.error and f"127.0.0.1:{port}" in down.error


# ----------------------------------------------------------------------------- stores
def test_chroma_warm_up_creates_nothing_health_against_the_state_close(tmp_path):
    store = ChromaStore(ChromaSpec(type="chroma", path="chroma", collection="docs"), tmp_path)
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), tmp_path)
    store.warm_up()
    assert not (tmp_path / "chroma").exists()  # a query path never creates the store
    assert store.health().status == "degraded" and "no store" in store.health().error
    assert store.health(state) == Health.up(state_chunks=0, chunks=0)  # never indexed: empty, not damaged
    items = chunks(3)
    store.upsert(items)
    recorded(state, items[:2])
    mismatch = store.health(state)
    assert mismatch.status == "down" and "holds 3 vectors, the index state names 2 chunks" in mismatch.error
    recorded(state, items)
    assert store.health(state) == Health.up(state_chunks=3, chunks=3)
    store.close()
    assert not store._client.loaded and store._collection is None
    fresh = ChromaStore(store.spec, tmp_path)
    fresh.warm_up()  # opens the collection and searches it once
    assert fresh._client.loaded and fresh._collection is not None
    assert fresh.count() == 3
    fresh.close()
    clear_cache()


def test_bm25_warm_up_health_close(tmp_path):
    index = BM25Index(BM25Spec(type="bm25", path="bm25"), tmp_path)
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), tmp_path)
    index.warm_up()  # nothing published: nothing to load, nothing created
    assert not (tmp_path / "bm25").exists() and index._loaded is None
    assert index.health() == Health.up(chunks=0)
    recorded(state, chunks(3))
    lagging = index.health(state)
    assert lagging.status == "down" and "nothing is published while the index state holds 3 chunks" in lagging.error
    assert index.sync(state)
    index.warm_up()
    assert index._loaded is not None  # mapped: the first search does not load it
    assert index.health(state) == Health.up(state_chunks=3, chunks=3)
    index.close()
    assert index._loaded is None
    assert index.search(["penguins"], 2)[0]  # loads again on use


def test_index_state_warm_up_health_close(tmp_path):
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), tmp_path)
    state.warm_up()
    assert not (tmp_path / "state.sqlite").exists()  # warm-up creates no state
    assert state.health().status == "degraded" and "does not exist" in state.health().error
    recorded(state, chunks(2))
    state.close()
    state.warm_up()
    assert state._reader is not None  # the read connection is open
    assert state.health() == Health.up(sources=2, chunks=2)
    state.close()
    assert state._reader is None and state._conn is None
