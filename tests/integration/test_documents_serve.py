"""The document API end to end under `ragline serve` (a subprocess, a real Prefect server): uploads
start the pipeline's deployment run (or schedule one after the run in progress), the list shows
them indexed with chunk counts, the query pipeline finds them, and a delete's triggered run removes
the document from Chroma, BM25 and the state."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.uploads import DOCX, MD, PDF, PIPELINES
from tests.integration.serving import AUTH, serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("documents")
    (folder / "docs").mkdir()
    (folder / "docs" / "configured.md").write_text("# Configured\n\nA configured note about lichens.\n")
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES)
    return path


@pytest.fixture(scope="module")
def served(project, prefect_api):
    with serving(project, prefect_api) as url:
        yield url


def documents(url: str) -> dict[str, dict]:
    response = httpx.get(f"{url}/v1/documents", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {d["id"]: d for d in response.json()["documents"]}


def wait_for(url: str, done, what: str, timeout: float = 300) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = documents(url)
        if done(found):
            return found
        time.sleep(1)
    raise TimeoutError(f"{what}: {found}")


def top_sources(url: str, question: str) -> list[str]:
    response = httpx.post(f"{url}/v1/query", json={"pipeline": "search", "question": question}, headers=AUTH,
                          timeout=60)
    assert response.status_code == 200, response.text
    return [p["source_id"] for p in response.json()["passages"]]


def test_upload_index_query_delete_over_http(served, project):
    uploads = [("axolotl.md", MD), ("quasars.pdf", PDF), ("tardigrades.docx", DOCX)]
    answers = [httpx.post(f"{served}/v1/documents", files={"file": item}, headers=AUTH, timeout=60) for item in uploads]
    assert [a.status_code for a in answers] == [201, 201, 201], [a.text for a in answers]
    assert answers[0].json()["ingestion"]["state"] == "started" and answers[0].json()["ingestion"]["run_id"]
    assert {a.json()["ingestion"]["state"] for a in answers[1:]} <= {"started", "scheduled"}
    ids = {name: a.json()["document"]["id"] for (name, _), a in zip(uploads, answers)}

    found = wait_for(served, lambda d: all(d.get(i, {}).get("status") == "indexed" for i in ids.values())
                     and d.get("docs/configured.md", {}).get("status") == "indexed", "uploads never all indexed")
    assert all(found[i]["chunks"] >= 1 for i in ids.values())
    assert top_sources(served, "Lyman alpha forests in quasar spectra")[0] == f"uploads/{ids['quasars.pdf']}/quasars.pdf"
    assert top_sources(served, "tardigrade desiccation trehalose")[0] == \
        f"uploads/{ids['tardigrades.docx']}/tardigrades.docx"

    again = httpx.post(f"{served}/v1/documents", files={"file": ("axolotl.md", MD)}, headers=AUTH, timeout=60)
    assert again.status_code == 200 and again.json()["unchanged"] is True and again.json()["ingestion"] is None

    refused = httpx.delete(f"{served}/v1/documents/docs/configured.md", headers=AUTH, timeout=30)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_managed"
    gone = ids["quasars.pdf"]
    deleted = httpx.delete(f"{served}/v1/documents/{gone}", headers=AUTH, timeout=30)
    assert deleted.status_code == 202 and deleted.json()["deleted"] is True, deleted.text
    assert deleted.json()["ingestion"]["state"] in ("started", "scheduled")
    wait_for(served, lambda d: gone not in d, "the deleted upload never left the index")
    # The list reads the state, which forgets a source before its run deletes it from Chroma and
    # publishes BM25 (crash safety: the state is the truth); queries stop finding it when that run ends.
    deadline = time.monotonic() + 120
    while any(gone in s for s in top_sources(served, "Lyman alpha forests in quasar spectra")):
        assert time.monotonic() < deadline, "the deleted upload is still found by queries after 120 s"
        time.sleep(1)
    with sqlite3.connect(project.parent / "idx" / "state.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM sources WHERE source_id LIKE ?", (f"%{gone}%",)).fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM chunks WHERE source_id LIKE ?", (f"%{gone}%",)).fetchone()[0] == 0
    assert httpx.delete(f"{served}/v1/documents/{gone}", headers=AUTH, timeout=30).status_code == 404
    assert set(documents(served)) == {ids["axolotl.md"], ids["tardigrades.docx"], "docs/configured.md"}
