"""Faults in what ragline depends on, provoked for real and without models (issue 9, item 1):
the disk under each store full (a small tmpfs, ENOSPC), read-only (a read-only bind mount, EROFS)
or forbidden (a child without root's override, EACCES); the Prefect API on a closed port. The
end-to-end versions (ingestion, the HTTP API, the CLI) are in tests/integration/test_dependency_faults.py."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.state import IndexState, StateSpec, StorageError
from tests.fault_mounts import fill, read_only, resize, tmpfs, without_root_override
from tests.helpers.data import REPO, index_and_search_yaml
from tests.helpers.net import closed_port, serve_in_thread
from tests.helpers.store_data import chunks, doc


def assert_names(error: BaseException, path: Path, reason: str) -> None:
    message = str(error)
    assert str(path) in message and reason in message, message


# ----------------------------------------------------------------------------- disk full (ENOSPC)
@pytest.mark.timeout(120)
def test_a_full_disk_under_the_index_state_names_the_file_and_keeps_what_it_held(tmp_path):
    with tmpfs(tmp_path / "data", "1m") as data:
        state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=data)
        state.record("index", "fp", [doc("a")], chunks("a", 3))
        held = state.sources(), state.chunk_rows(), state.generation
        filler = fill(data)
        with pytest.raises(StorageError) as err:
            state.record("index", "fp", [doc("b")], chunks("b", 400))
        assert err.value.errno == errno.ENOSPC
        assert_names(err.value, state.path, "no space left on device")
        filler.unlink()
        assert (state.sources(), state.chunk_rows(), state.generation) == held  # nothing half-written
        state.record("index", "fp", [doc("b")], chunks("b", 400))  # the same object, once there is room
        assert set(state.sources()) == {"a", "b"} and len(state.chunk_rows()) == 403
        state.close()


@pytest.mark.timeout(120)
def test_a_bm25_version_that_does_not_fit_is_never_published(tmp_path):
    with tmpfs(tmp_path / "data", "256k") as data:
        index = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=data)
        small = [(c.chunk_id, c.text, {"source_id": "a"}) for c in chunks("a", 20)]
        index.build(small, 1, index.settings)
        published = index.published_version()
        hits = index.search(["okapi frequency"], k=5)
        big = small + [(c.chunk_id, c.text, {"source_id": "b"}) for c in chunks("b", 2000)]
        with pytest.raises(OSError) as err:
            index.build(big, 2, index.settings)
        assert err.value.errno == errno.ENOSPC
        assert_names(err.value, index.path, "no space left on device")
        assert index.published_version() == published
        assert sorted(p.name for p in index.path.iterdir()) == sorted([published["version"], "CURRENT", "BUILD.lock"])
        fresh = BM25Index(index.spec, base_dir=data)  # a new reader loads the previous version
        assert fresh.search(["okapi frequency"], k=5) == hits
        resize(data, "8m")  # space freed: the next build publishes
        assert index.build(big, 2, index.settings) == 2020
        assert index.published_version()["generation"] == 2


@pytest.mark.timeout(180)
def test_embedded_chroma_on_a_full_disk_names_its_folder_and_works_again_once_there_is_room(tmp_path):
    with tmpfs(tmp_path / "data", "16m") as data:
        store = ChromaStore(ChromaSpec(type="chroma", path="chroma", collection="test"), base_dir=data)
        first = chunks("a", 20)
        store.upsert(first)
        probe = np.asarray([first[0].embedding], dtype=np.float32)
        top = [p.chunk_id for p in store.query(probe, k=3)[0]]
        filler = fill(data, leave=64 << 10)
        more = chunks("b", 1000)  # 3.3 MB in Chroma
        with pytest.raises(StorageError) as err:
            store.upsert(more)
        assert err.value.errno == errno.ENOSPC
        assert_names(err.value, store.path, "no space left on device")
        filler.unlink()
        # The same store (its engine was closed on the fault: reusing it sometimes hung) reads the
        # earlier vectors, then takes the batch that did not fit.
        assert {c.chunk_id for c in first} <= store.all_ids()
        assert [p.chunk_id for p in store.query(probe, k=3)[0]] == top
        store.upsert(more)
        assert store.all_ids() == {c.chunk_id for c in first + more}
        store.client.close()


SIZE_LIMITED = r"""
import json, resource, signal, sys
from pathlib import Path
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from tests.helpers.store_data import chunks
index = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=Path(sys.argv[1]))
index.build([(c.chunk_id, c.text, {}) for c in chunks("a", 5)], 1, index.settings)
before = index.published_version()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
try:
    index.build([(c.chunk_id, c.text, {}) for c in chunks("b", 2000)], 2, index.settings)
    out = {"error": None}
except OSError as exc:
    out = {"error": [exc.errno, str(exc)]}
out["unchanged"] = index.published_version() == before
out["left"] = sorted(p.name for p in index.path.iterdir())
out["version"] = before["version"]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_file_size_limit_is_named_and_publishes_nothing_without_root_or_mounts(tmp_path):
    """The same fault where no tmpfs can be mounted: RLIMIT_FSIZE in a child (EFBIG)."""
    done = subprocess.run([sys.executable, "-c", SIZE_LIMITED, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=100, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["error"] and out["error"][0] == errno.EFBIG, out
    assert str(tmp_path / "bm25") in out["error"][1] and "file too large" in out["error"][1], out
    assert out["unchanged"] and out["left"] == sorted([out["version"], "CURRENT", "BUILD.lock"]), out


# ----------------------------------------------------------------------------- read-only (EROFS)
@pytest.mark.timeout(120)
def test_a_read_only_data_folder_is_named_by_every_store_and_nothing_changes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=data)
    state.record("index", "fp", [doc("a")], chunks("a", 3))
    held = state.sources(), state.chunk_rows()
    state.close()
    bm25 = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=data)
    bm25.build([(c.chunk_id, c.text, {}) for c in chunks("a", 3)], 1, bm25.settings)
    published = bm25.published_version()
    store = ChromaStore(ChromaSpec(type="chroma", path="chroma", collection="test"), base_dir=data)
    store.upsert(chunks("a", 3))
    store.client.close()
    with read_only(data):
        state = IndexState(state.spec, base_dir=data)  # opened anew: through the read-only mount
        with pytest.raises(StorageError) as err:
            state.record("index", "fp", [doc("b")], chunks("b", 3))
        assert err.value.errno == errno.EROFS
        assert_names(err.value, state.path, "read-only file system")
        with pytest.raises(OSError) as err:
            bm25.build([(c.chunk_id, c.text, {}) for c in chunks("b", 3)], 2, bm25.settings)
        assert err.value.errno == errno.EROFS and str(bm25.path) in str(err.value)
        assert bm25.published_version() == published
        store = ChromaStore(store.spec, base_dir=data)
        with pytest.raises(StorageError) as err:
            store.upsert(chunks("b", 3))  # embedded Chroma cannot even open a read-only folder
        assert err.value.errno == errno.EROFS
        assert_names(err.value, store.path, "read-only file system")
    state = IndexState(state.spec, base_dir=data)
    assert (state.sources(), state.chunk_rows()) == held
    state.close()
    store = ChromaStore(store.spec, base_dir=data)
    assert store.all_ids() == {c.chunk_id for c in chunks("a", 3)}
    store.client.close()


# ----------------------------------------------------------------------------- not permitted (EACCES)
FORBIDDEN = r"""
import json, sys
from pathlib import Path
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.stores.state import IndexState, StateSpec
from tests.helpers.store_data import chunks, doc
data = Path(sys.argv[1])
out = {}
def attempt(name, call):
    try:
        call()
        out[name] = None
    except OSError as exc:
        out[name] = [type(exc).__name__, exc.errno, str(exc)]
state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=data)
attempt("state", lambda: state.record("index", "fp", [doc("b")], chunks("b", 3)))
bm25 = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=data)
attempt("bm25", lambda: bm25.build([("x", "okapi", {})], 2, bm25.settings))
store = ChromaStore(ChromaSpec(type="chroma", path="chroma", collection="test"), base_dir=data)
attempt("chroma", lambda: store.upsert(chunks("b", 3)))
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_folder_the_process_may_not_write_is_named_with_permission_denied(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for sub in ("bm25", "chroma"):
        (data / sub).mkdir()
    os.chmod(tmp_path, 0o755)  # the child may reach the folder ...
    for folder in (data, data / "bm25", data / "chroma"):
        os.chmod(folder, 0o555)  # ... and not write in it (root's override dropped in the child)
    try:
        done = without_root_override(FORBIDDEN, str(data))
    finally:
        for folder in (data, data / "bm25", data / "chroma"):
            os.chmod(folder, 0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["state"][:2] == ["StorageError", errno.EACCES] and "permission denied" in result["state"][2]
    assert str(data / "state.sqlite") in result["state"][2]
    assert result["bm25"][1] == errno.EACCES and str(data / "bm25") in result["bm25"][2]
    assert result["chroma"][:2] == ["StorageError", errno.EACCES] and str(data / "chroma") in result["chroma"][2]
    assert sorted(p.name for p in data.iterdir()) == ["bm25", "chroma"]  # nothing written


# ----------------------------------------------------------------------------- Prefect API unreachable
@pytest.mark.integration  # an orchestrated (Prefect) run in a child process
@pytest.mark.timeout(180)
def test_an_orchestrated_ingestion_with_the_prefect_api_down_fails_in_one_line_naming_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\nOkapi BM25.\n")
    project = tmp_path / "pipelines.yaml"
    project.write_text(index_and_search_yaml())
    url = f"http://127.0.0.1:{closed_port()}/api"
    env = dict(os.environ, PREFECT_API_URL=url, PYTHONPATH=str(REPO), RAGLINE_HOME=str(tmp_path / "home"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ragline.flows.cli", "index", "-f", str(project)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=150)
    seconds = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"error: Prefect API {url} unreachable (ConnectError"), lines[0]
    assert "--no-prefect" in lines[0]
    assert not (tmp_path / "idx").exists()  # failed before any step: nothing opened for writing
    assert seconds < 120


class _Health(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.mark.timeout(60)
def test_query_events_for_an_unreachable_prefect_api_are_counted_lost_with_one_warning(monkeypatch, caplog):
    import contextvars

    import prefect.events

    from ragline.flows.serve.query_service import Events

    sent: list[str] = []
    monkeypatch.setattr(prefect.events, "emit_event", lambda **event: sent.append(event["event"]) or object())
    monkeypatch.setattr(Events, "PROBE_SECONDS", 0.0)
    port = closed_port()
    url = f"http://127.0.0.1:{port}/api"
    events = Events(url, contextvars.copy_context())

    def emit(n: int) -> None:
        for _ in range(n):
            events.query_done("search", "answered", 1.0, {}, 5, "query")
        events._pool.submit(lambda: None).result(timeout=30)  # one worker: every event before it is done

    with caplog.at_level(logging.INFO, logger="ragline.api"):
        emit(3)
        assert (events.emitted, events.failed, sent) == (0, 3, [])
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"Prefect API {url} unreachable" in warnings[0], warnings
        assert "not sent" in warnings[0] and "/readyz" in warnings[0]
        server = ThreadingHTTPServer(("127.0.0.1", port), _Health)  # the API is back
        serve_in_thread(server)
        try:
            emit(2)
        finally:
            server.shutdown()
            server.server_close()
    assert (events.emitted, events.failed, sent) == (2, 3, ["ragline.query.completed"] * 2)
    assert any("answers again" in r.getMessage() for r in caplog.records)
    events.close()
