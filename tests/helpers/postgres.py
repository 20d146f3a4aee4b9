"""A real PostgreSQL for the index state's tests: initdb into a temporary folder, started on a free
loopback port with a password, once per test session; each test gets a schema of its own."""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.helpers.net import free_port

PASSWORD = "pg-" + secrets.token_hex(8)  # the tests check it is never shown


def postgres_bin() -> Path | None:
    """The folder of initdb/pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    return None


def skip_reason() -> str | None:
    """Why the PostgreSQL tests cannot run here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[dev]')"
    if postgres_bin() is None:
        return "no PostgreSQL binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin (apt-get install postgresql)"
    return None


class PostgresServer:
    """One cluster of our own; as root it runs as the `postgres` user (postgres refuses root)."""

    def __init__(self, fsync: bool = False) -> None:
        self.bin, self.fsync = postgres_bin(), fsync  # tests: off (nothing to keep); the bench: on
        self.folder = Path(tempfile.mkdtemp(prefix="ragline-pg-"))  # not tmp_path: its parents are 0700
        self.folder.chmod(0o755)
        self.data, self.port = self.folder / "data", free_port()
        self.url = f"postgresql://ragline:{PASSWORD}@127.0.0.1:{self.port}/postgres"

    def _as_owner(self, *command: str) -> list[str]:
        if os.geteuid() != 0:
            return list(command)
        return [shutil.which("runuser") or "/usr/sbin/runuser", "-u", "postgres", "--", *command]

    def start(self) -> "PostgresServer":
        pwfile = self.folder / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if os.geteuid() == 0:
            _ensure_postgres_user()
            shutil.chown(self.folder, "postgres")
            shutil.chown(pwfile, "postgres")
        subprocess.run(self._as_owner(str(self.bin / "initdb"), "-D", str(self.data), "-U", "ragline",
                                      f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                                      "--no-sync"), check=True, capture_output=True, timeout=120)
        subprocess.run(self._as_owner(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"),
                                      "-w", "-t", "60", "start", "-o",
                                      f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories="
                                      f"{self.folder} -c fsync={'on' if self.fsync else 'off'} -c max_connections=200"),
                       check=True, capture_output=True, timeout=120)
        return self

    def stop(self) -> None:
        subprocess.run(self._as_owner(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                                      "stop"), capture_output=True, timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


def _ensure_postgres_user() -> None:
    """As root: the system user the cluster runs as (deploy/local/up.sh does the same)."""
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--home-dir", "/var/lib/postgresql", "--shell", "/bin/false",
                        "postgres"], check=True, capture_output=True, timeout=60)


def new_schema() -> str:
    return "t_" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def postgres():
    """The session's PostgreSQL server (skipped, saying why, where there is none)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    server = PostgresServer().start()
    yield server
    server.stop()
