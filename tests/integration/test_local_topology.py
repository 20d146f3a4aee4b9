"""deploy/local/up.sh and down.sh (issue 7, item 9): the production topology on one machine, for real.

PostgreSQL (our own cluster), the Prefect API server on it plus its services process, a Chroma server, a
Dask scheduler and worker, and `ragline serve`: every service healthy, an ingestion triggered over
ragline's API runs on the Dask cluster into the Chroma server and is recorded in Postgres, a search finds
the document, and down.sh leaves no process behind. The LLM is pointed at a closed port: /readyz
reports it down and everything else up."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.data import REPO
from tests.helpers.harness import free_port

pytestmark = pytest.mark.integration

UP, DOWN = REPO / "deploy" / "local" / "up.sh", REPO / "deploy" / "local" / "down.sh"


def _postgres_available() -> bool:
    have = any(Path(d, "initdb").exists() for d in Path("/usr/lib/postgresql").glob("*/bin")) \
        or shutil.which("initdb") is not None
    return have or (os.geteuid() == 0 and shutil.which("apt-get") is not None)


if not _postgres_available():
    pytest.skip("no PostgreSQL binaries (initdb) and not root with apt-get to install them "
                "(bash deploy/local/install.sh as root)", allow_module_level=True)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{proc.name}: {cmd[:200]}")
    return found


def test_local_topology_up_ingest_query_down():
    started = time.monotonic()
    # Not pytest's tmp_path: its parents are 0700 and the cluster runs as user postgres when we are root.
    folder = Path(tempfile.mkdtemp(prefix="ragline-local-"))
    folder.chmod(0o755)
    docs = folder / "docs"
    docs.mkdir()
    (docs / "heron.md").write_text("# Herons\n\nThe grey heron nests in colonies called heronries near water.\n")
    (docs / "kiln.md").write_text("# Kilns\n\nA kiln fires clay at high temperature to make pottery.\n")
    ports = {name: free_port() for name in ("PG", "PREFECT", "CHROMA", "DASK", "DASK_DASHBOARD", "API")}
    env = dict(os.environ, RAGLINE_LOCAL_DIR=str(folder / "local"), RAGLINE_DOCS=str(docs),
               RAGLINE_PG_PORT=str(ports["PG"]), RAGLINE_PREFECT_PORT=str(ports["PREFECT"]),
               RAGLINE_CHROMA_PORT=str(ports["CHROMA"]), RAGLINE_DASK_PORT=str(ports["DASK"]),
               RAGLINE_DASK_DASHBOARD_PORT=str(ports["DASK_DASHBOARD"]), RAGLINE_PORT=str(ports["API"]),
               RAGLINE_LLM_BASE_URL=f"http://127.0.0.1:{free_port()}/v1", OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)
    env.pop("RAGLINE_PIPELINES", None)
    api, prefect = f"http://127.0.0.1:{ports['API']}", f"http://127.0.0.1:{ports['PREFECT']}/api"
    try:
        up = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"Prefect dashboard: http://127.0.0.1:{ports['PREFECT']}" in up.stdout
        pg_bin = next(line.split(": ", 1)[1] for line in subprocess.run(
            ["bash", str(REPO / "deploy" / "local" / "install.sh")], capture_output=True, text=True,
            check=True).stdout.splitlines() if line.startswith("postgres binaries: "))
        pg_env = dict(env, PGPASSWORD=(folder / "local" / "pg.password").read_text().strip())

        def psql(sql: str) -> str:
            return subprocess.run([f"{pg_bin}/psql", "-h", "127.0.0.1", "-p", str(ports["PG"]), "-U", "ragline",
                                   "-d", "prefect", "-tAc", sql], env=pg_env, capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()

        # every service answers
        assert psql("select 1") == "1"
        assert httpx.get(f"{prefect}/health", timeout=10).json() is True
        assert httpx.get(f"http://127.0.0.1:{ports['CHROMA']}/api/v2/heartbeat", timeout=10).status_code == 200
        counts = httpx.get(f"http://127.0.0.1:{ports['DASK_DASHBOARD']}/json/counts.json", timeout=10).json()
        assert counts["workers"] >= 1
        ready = httpx.get(f"{api}/readyz", timeout=60)
        checks = ready.json()["checks"]
        assert checks["store"]["status"] == "up" and checks["prefect"]["status"] == "up", checks
        assert checks["llm"]["status"] == "down" and ready.status_code == 503  # the LLM port is closed

        # ingestion through ragline's API: a deployment run by ragline serve's runner, on the Dask cluster
        accepted = httpx.post(f"{api}/v1/ingest", json={"pipeline": "index"}, timeout=60)
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["run_id"]
        deadline, status = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            status = httpx.get(f"{api}/v1/runs/{run_id}", timeout=30).json()
            if status["state"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(1)
        assert status.get("state") == "COMPLETED", status
        assert status["result"]["added"] == 2 and status["result"]["failed"] == 0, status
        # recorded in Postgres, written to the Chroma server (not an embedded store), searchable
        assert psql(f"select state_type from flow_run where id = '{run_id}'") == "COMPLETED"
        assert httpx.get(f"{api}/readyz", timeout=60).json()["checks"]["store"]["detail"]["chunks"] >= 2
        assert not (folder / "local" / "store").exists()
        found = httpx.post(f"{api}/v1/query", json={"question": "where do herons nest", "pipeline": "search",
                                                    "top_k": 1}, timeout=120)
        assert found.status_code == 200, found.text
        assert "heronries" in str(found.json()["passages"][0])
        assert list((folder / "local" / "logs").glob("dask-worker.log"))
    finally:
        down = subprocess.run(["bash", str(DOWN)], env=env, capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not list((folder / "local" / "pids").glob("*.pid"))
    time.sleep(1)
    assert _processes_mentioning(str(folder)) == []
    for port in ports.values():  # nothing listens any more
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
    shutil.rmtree(folder, ignore_errors=True)
    print(f"local topology: up, ingest, query, down in {time.monotonic() - started:.1f} s")
