"""The managed Chroma server of an embedded store (flows/ops/chroma_server.py): published, found by every
ChromaStore of that folder, never trusted when its process is gone, unpublished when stopped."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ragline.flows.ops.chroma_server import ManagedChroma
from ragline.flows.ops.managed_server import MAX_RESTARTS
from ragline.flows.resources.stores.store_owner import owner_of, server_file
from ragline.flows.contracts import Chunk
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore


def store(tmp_path) -> ChromaStore:
    return ChromaStore(ChromaSpec(type="chroma", path="chroma", collection="managed"), tmp_path)


def chunk(cid: str, seed: int) -> Chunk:
    vector = np.random.default_rng(seed).random(8).astype(np.float32).tolist()
    return Chunk(chunk_id=cid, source_id=f"doc-{cid}", ordinal=0, text=f"text {cid}", embedding=vector)


def test_no_file_or_a_dead_process_or_another_host_is_no_owner(tmp_path):
    folder = tmp_path / "chroma"
    assert owner_of(folder) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": "127.0.0.1", "port": 1, "pid": dead.pid}
    server_file(folder).write_text(json.dumps(record))
    assert owner_of(folder) is None
    server_file(folder).write_text(json.dumps({**record, "pid": os.getpid(), "started": "not-my-start-time"}))
    assert owner_of(folder) is None  # a reused pid is not the server
    server_file(folder).write_text(json.dumps({**record, "pid": os.getpid(), "hostname": "elsewhere.example"}))
    assert owner_of(folder) is None  # a folder shared with another machine
    server_file(folder).write_text("{not json")
    assert owner_of(folder) is None
    server_file(folder).write_text(json.dumps({**record, "pid": os.getpid(), "hostname": socket.gethostname()}))
    assert owner_of(folder).pid == os.getpid()


@pytest.mark.integration  # a real `chroma run` server process
def test_every_store_of_the_folder_goes_through_the_server_and_sees_each_others_writes(tmp_path):
    writer = store(tmp_path)
    writer.upsert([chunk("a", 1)])  # embedded, before any server: the data is on disk
    writer.count()
    server = ManagedChroma(writer.path, logs=tmp_path / "logs").start()
    try:
        assert oct(server_file(writer.path).stat().st_mode & 0o777) == "0o600"
        reader, second_writer = store(tmp_path), store(tmp_path)  # as in two other processes
        assert reader.count() == 1 and reader.server == f"http://127.0.0.1:{server.port}"
        assert "served by" in reader.location
        reader.query(np.ones((1, 8), dtype=np.float32), k=5)  # the reader's index is loaded now
        second_writer.upsert([chunk("b", 2), chunk("c", 3)])
        second_writer.delete(["a"])
        hits = reader.query(np.ones((1, 8), dtype=np.float32), k=5)[0]
        assert sorted(p.chunk_id for p in hits) == ["b", "c"] and all(p.text for p in hits)
    finally:
        server.stop()
    assert not server_file(writer.path).exists() and owner_of(writer.path) is None
    assert store(tmp_path).count() == 2  # embedded again, the server's writes on disk


@pytest.mark.integration  # a real `chroma run` server process
def test_a_killed_server_is_restarted_on_its_port(tmp_path):
    said: list[str] = []
    server = ManagedChroma(tmp_path / "chroma", say=said.append, logs=tmp_path / "logs").start()
    try:
        first = owner_of(tmp_path / "chroma")
        os.killpg(first.pid, 9)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            again = owner_of(tmp_path / "chroma")
            if again is not None and again.pid != first.pid:
                break
            time.sleep(0.2)
        assert again.port == first.port and again.pid != first.pid
        assert any("exited with code" in line and "restarting it" in line for line in said)
        store(tmp_path).upsert([chunk("z", 5)])  # the restarted server takes writes and reads
        assert store(tmp_path).count() == 1
    finally:
        server.stop()


def test_restarts_are_bounded(tmp_path):
    said: list[str] = []
    server = ManagedChroma(tmp_path / "chroma", say=said.append, logs=tmp_path / "logs")
    server.restarts = [time.monotonic()] * MAX_RESTARTS
    server.process = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    server.process.wait()
    server._restart(server.process.returncode)
    assert server.process is None and server.health()["up"] is False
    assert "stays down" in said[-1] and "exited with code 0" in server.health()["error"]


@pytest.mark.integration  # a real `chroma run` server process
def test_the_service_waits_for_an_embedded_writer_before_serving_the_store(make_project):
    import contextlib
    import threading

    from ragline.flows.ops.store_servers import serve_stores
    from ragline.flows.spec.compile import load_project
    from tests.helpers.data import index_and_search_yaml

    project = load_project(make_project(index_and_search_yaml()))
    holding, said = threading.Event(), []

    def terminal_index() -> None:
        with project.resource("state").lease("terminal index"):
            holding.set()
            time.sleep(2.0)

    writer = threading.Thread(target=terminal_index)
    writer.start()
    holding.wait(10)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        [server] = serve_stores(project, stack, said.append)
        waited = time.monotonic() - started
        assert owner_of(server.path).port == server.port
    writer.join()
    assert waited >= 1.0 and "waiting for terminal index" in said[0] and "Chroma server for" in said[1]
    assert owner_of(server.path) is None
    assert project.resource("state").lease_holder() is None
