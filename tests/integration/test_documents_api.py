"""The document API under `ragline api` (a subprocess, no Prefect server): an upload over HTTP is
ingested by a run in the API's own process (one sent during that run, by the run after it), the
list shows it indexed, the query pipeline finds it, and a delete's run removes it from Chroma,
BM25 and the state. Same credentials and scopes as
`ragline serve`: no token is a 401, a query-only key may read the list but not upload."""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ragline.flows.serve.auth.keys import KeyStore, keys_file
from tests.helpers.net import free_port
from tests.helpers.uploads import PIPELINES

pytestmark = pytest.mark.integration

TOKEN = "ragline-api-documents"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OTHER = b"# Okapi\n\nThe okapi is a forest giraffe of the Congo with striped legs.\n"
NOTE = b"# Narwhal tusks\n\nA narwhal's tusk is an elongated canine tooth that senses salinity and temperature.\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("api-documents")
    (folder / "docs").mkdir()
    (folder / "docs" / "configured.md").write_text("# Configured\n\nA configured note about lichens.\n")
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES)
    return path


@pytest.fixture(scope="module")
def reader_key(project) -> str:
    return KeyStore(keys_file(project.parent)).create("reader", ["query"], ["*"])[1]


@pytest.fixture(scope="module")
def api(project, reader_key):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    port = free_port()
    log = open(project.parent / "api.log", "wb")
    process = subprocess.Popen([str(Path(sys.executable).with_name("ragline")), "api", "-f", str(project), "--port",
                                str(port), "--token", TOKEN], cwd=project.parent, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, \
                (project.parent / "api.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        log.close()


def documents(url: str) -> dict[str, dict]:
    response = httpx.get(f"{url}/v1/documents", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {d["id"]: d for d in response.json()["documents"]}


def wait_for(url: str, done, what: str, timeout: float = 180) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while not done(found := documents(url)):
        assert time.monotonic() < deadline, f"{what}: {found}"
        time.sleep(0.5)
    return found


def top_source(url: str, question: str) -> str | None:
    response = httpx.post(f"{url}/v1/query", json={"pipeline": "search", "question": question}, headers=AUTH,
                          timeout=60)
    assert response.status_code == 200, response.text
    passages = response.json()["passages"]
    return passages[0]["source_id"] if passages else None


def test_an_upload_is_ingested_in_process_found_and_deleted(api, project, reader_key):
    assert httpx.post(f"{api}/v1/documents", files={"file": ("narwhal.md", NOTE)}, timeout=30).status_code == 401
    reader = {"Authorization": f"Bearer {reader_key}"}
    refused = httpx.post(f"{api}/v1/documents", files={"file": ("narwhal.md", NOTE)}, headers=reader, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden", refused.text

    created = httpx.post(f"{api}/v1/documents", files={"file": ("narwhal.md", NOTE)}, headers=AUTH, timeout=60)
    assert created.status_code == 201, created.text
    assert created.json()["ingestion"]["state"] == "started", created.json()
    upload_id = created.json()["document"]["id"]
    # sent while that run writes the index: one more run follows it
    other = httpx.post(f"{api}/v1/documents", files={"file": ("okapi.md", OTHER)}, headers=AUTH, timeout=60)
    assert other.status_code == 201 and other.json()["ingestion"]["state"] == "scheduled", other.text
    other_id = other.json()["document"]["id"]
    found = wait_for(api, lambda d: all(d.get(i, {}).get("status") == "indexed"
                                        for i in (upload_id, other_id, "docs/configured.md")), "uploads never indexed")
    assert found[upload_id]["chunks"] >= 1
    assert httpx.get(f"{api}/v1/documents", headers=reader, timeout=30).status_code == 200
    source = f"uploads/{upload_id}/narwhal.md"
    assert top_source(api, "narwhal tusk canine tooth salinity") == source

    deleted = httpx.delete(f"{api}/v1/documents/{upload_id}", headers=AUTH, timeout=30)
    assert deleted.status_code == 202 and deleted.json()["deleted"] is True, deleted.text
    assert deleted.json()["ingestion"]["state"] in ("started", "scheduled")
    wait_for(api, lambda d: upload_id not in d, "the deleted upload never left the index")
    deadline = time.monotonic() + 60  # the run forgets it in the state, then deletes and publishes BM25
    while top_source(api, "narwhal tusk canine tooth salinity") == source:
        assert time.monotonic() < deadline, "the deleted upload is still found by queries after 60 s"
        time.sleep(0.5)
    with sqlite3.connect(project.parent / "idx" / "state.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM chunks WHERE source_id LIKE ?", (f"%{upload_id}%",)).fetchone()[0] == 0
    assert set(documents(api)) == {"docs/configured.md", other_id}
