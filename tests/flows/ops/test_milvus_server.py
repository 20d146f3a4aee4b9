"""The managed milvus-lite engine of an embedded `.db` file (flows/ops/milvus_server.py): published,
found by every MilvusStore of that file, holding the file's lock so nothing opens it embedded
beside it, refusing to start over a file another process has open, restarted when killed."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("milvus_lite")

from ragline.flows.contracts import Chunk  # noqa: E402
from ragline.flows.ops import milvus_server  # noqa: E402
from ragline.flows.ops.milvus_server import ManagedMilvus  # noqa: E402
from ragline.flows.resources.stores.milvus import MilvusSpec, MilvusStore, MilvusUnavailable  # noqa: E402
from ragline.flows.resources.stores.store_owner import owner_of, server_file  # noqa: E402

pytestmark = pytest.mark.integration  # milvus-lite's engine, a real process


def store(tmp_path) -> MilvusStore:
    return MilvusStore(MilvusSpec(type="milvus", uri="milvus.db", collection="managed"), tmp_path)


def chunk(cid: str, text: str, vector: list[float]) -> Chunk:
    return Chunk(chunk_id=cid, source_id=f"doc-{cid}", ordinal=0, text=text, metadata={"n": len(cid)},
                 embedding=vector)


def test_every_store_of_the_file_goes_through_the_engine_and_nothing_opens_it_beside(tmp_path):
    first = store(tmp_path)
    first.upsert([chunk("a", "alpha helices fold", [1.0, 0.0])])  # embedded, before any server
    first.close()
    server = ManagedMilvus(first.path, logs=tmp_path / "logs").start()
    try:
        assert oct(server_file(first.path).stat().st_mode & 0o777) == "0o600"
        reader, writer = store(tmp_path), store(tmp_path)  # as in two other processes
        assert reader.count() == 1 and reader.remote == server.url and "served by" in reader.location
        writer.upsert([chunk("b", "beta sheets", [0.0, 1.0]), chunk("c", "gamma rays", [0.5, 0.5])])
        writer.delete(["a"])
        assert reader.count() == 2
        assert [h[0] for h in reader.search(["beta sheets"], 5)[0]] == ["b"]
        assert {p.chunk_id for p in reader.query([[0.0, 1.0]], k=5)[0]} == {"b", "c"}
        embedded = MilvusStore(MilvusSpec(type="milvus", uri="milvus.db", collection="managed"), tmp_path)
        embedded._owner_resolved = True  # a process that looked before the server was published
        with pytest.raises(MilvusUnavailable, match="could not open the file"):
            embedded.count()
        reader.close(), writer.close()
    finally:
        server.stop()
    assert not server_file(first.path).exists() and owner_of(first.path) is None
    again = store(tmp_path)
    assert again.count() == 2  # embedded again: the engine's writes are in the file
    again.close()


def test_an_engine_does_not_start_over_a_file_another_process_has_open(tmp_path, monkeypatch):
    holder = store(tmp_path)
    holder.upsert([chunk("a", "held open", [1.0, 0.0])])  # this process's embedded engine holds the lock
    monkeypatch.setattr(milvus_server, "LOCK_WAIT", 1.0)
    try:
        with pytest.raises(RuntimeError, match="is open in another process"):
            ManagedMilvus(holder.path, logs=tmp_path / "logs").start()
        assert owner_of(holder.path) is None
    finally:
        holder.close()
    server = ManagedMilvus(holder.path, logs=tmp_path / "logs").start()  # released: it starts
    server.stop()


def test_a_killed_engine_is_restarted_on_its_port(tmp_path):
    said: list[str] = []
    path = store(tmp_path).path
    server = ManagedMilvus(path, say=said.append, logs=tmp_path / "logs").start()
    try:
        writer = store(tmp_path)
        writer.upsert([chunk("z", "zeta", [1.0, 1.0])])
        first = owner_of(path)
        os.killpg(first.pid, 9)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            again = owner_of(path)
            if again is not None and again.pid != first.pid:
                break
            time.sleep(0.2)
        assert again.port == first.port and again.pid != first.pid
        assert any("Milvus server" in line and "restarting it" in line for line in said)
        assert writer.count() == 1  # the same handle reconnects; what was written is there
        writer.close()
    finally:
        server.stop()
