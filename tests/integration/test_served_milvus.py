"""`ragline serve` on the milvus index engine's embedded file (issue 22 item 4): milvus-lite serves one
process per `.db` file, and `ragline serve` is several (its API, a process per flow run, a terminal
`ragline index` beside it). The service runs the engine once over the file (flows/ops/milvus_server.py)
and every process goes through it: child flow runs index, the API answers from what they wrote, a
terminal run adds beside it, a Prefect-triggered run deletes, and a killed engine comes back on its
port with the collection intact."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("milvus_lite")

from tests.integration.serving import _create_flow_run, _deployment, _wait_flow_run, serving  # noqa: E402
from tests.integration.served_index import (AXOLOTL, OKAPI, PIPELINES as CHROMA_PIPELINES,  # noqa: E402
                                                  documents, ingest, query, sources, the, write_project)

pytestmark = pytest.mark.integration

# The served-index project with only the resource lines changed: one milvus resource, both roles.
PIPELINES = CHROMA_PIPELINES.replace("""  store:    {type: chroma, path: idx/chroma, collection: main}
  sparse:   {type: bm25, path: idx/bm25}
""", """  store:    {type: milvus, uri: idx/milvus.db, collection: main}
""")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    assert "milvus" in PIPELINES
    return write_project(tmp_path_factory.mktemp("served-milvus"), PIPELINES)


@pytest.fixture(scope="module")
def served(project, prefect_api):
    with serving(project, prefect_api) as url:
        yield url


def database(project: Path) -> Path:
    return project.parent / "idx" / "milvus.db"


def assert_agree(served: str, project: Path) -> set[str]:
    """Both retrievers see every indexed document and nothing else; no passage is empty."""
    expected = documents(project)
    for pipeline in ("dense", "bm25"):
        passages = query(served, pipeline, "cells proteins zebrafish okapi axolotl")
        assert all(p["text"].strip() and p["source_id"] for p in passages)
        assert sources(passages) <= expected
    assert sources(query(served, "dense", "cells")) == expected
    return expected


def test_flow_runs_the_api_and_a_terminal_index_share_the_served_engine(served, prefect_api, project):
    from ragline.flows.resources.stores.store_owner import owner_of

    owner = owner_of(database(project))
    assert owner is not None, (project.parent / "serve.log").read_text()[-3000:]
    assert "Milvus server for" in (project.parent / "serve.log").read_text()

    ingest(served)  # a child flow run writes through the engine the API reads
    assert len(assert_agree(served, project)) == 13
    assert the("zebrafish.md", sources(query(served, "bm25", "zebrafish fins")))

    (project.parent / "docs" / "zebrafish.md").write_text(AXOLOTL)
    ingest(served)
    assert the("zebrafish.md", sources(query(served, "bm25", "axolotl salamanders")))
    assert not any("fins" in p["text"] for p in query(served, "dense", "regrow")
                   if p["source_id"].endswith("zebrafish.md"))

    (project.parent / "docs" / "okapi.md").write_text(OKAPI)  # a user's terminal run beside the service
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([str(Path(sys.executable).with_name("ragline")), "index", "-f", str(project),
                           "--no-prefect"], cwd=project.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "added 1" in done.stdout
    assert the("okapi.md", sources(query(served, "bm25", "okapi congo")))

    (project.parent / "docs" / "zebrafish.md").unlink()  # a deletion by a Prefect-triggered run
    run = _wait_flow_run(prefect_api, _create_flow_run(prefect_api, _deployment(prefect_api, "index")["id"], {}),
                         timeout=600)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    found = assert_agree(served, project)
    assert the("zebrafish.md", found) is None and len(found) == 13


def test_a_killed_engine_is_restarted_on_its_port_with_the_collection(served, project):
    from ragline.flows.resources.stores.store_owner import owner_of

    owner = owner_of(database(project))
    before = documents(project)
    os.killpg(owner.pid, 9)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        again = owner_of(database(project))
        if again is not None and again.pid != owner.pid:
            break
        time.sleep(0.5)
    assert again is not None and again.pid != owner.pid and again.port == owner.port
    assert sources(query(served, "dense", "cells")) == before  # the API's client reconnects
    assert the("okapi.md", sources(query(served, "bm25", "okapi congo")))
    log = (project.parent / "serve.log").read_text()
    assert "Milvus server" in log and "restarting it" in log
