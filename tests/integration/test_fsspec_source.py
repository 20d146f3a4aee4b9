"""``fsspec`` roots against a real S3-compatible server (moto's server mode) on loopback, reached
through a TCP proxy the test controls: it counts object downloads, cuts a listing halfway and
changes an object between its listing and its download."""
from __future__ import annotations

import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ragline.flows.context import StepContext
from ragline.tasks.ingest.index import gone_sources
from ragline.tasks.ingest.load import Params, load
from tests.helpers.data import index_and_search_yaml
from tests.helpers.harness import run_index, snapshot
from tests.helpers.store_proxy import Proxy, http_refusal

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.integration

KEY_ID, SECRET = "AKIATESTSOURCEKEY01", "s3cr3t-Value-That-Must-Never-Show"


def s3_download(line: str) -> bool:
    """An object GET (not a listing)."""
    return line.startswith("GET ") and "list-type" not in line and "?" not in line


@pytest.fixture(scope="module")
def s3_server():
    """One moto S3 server for the module (host, port); each test resets it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEST_S3_KEY_ID", KEY_ID)
    monkeypatch.setenv("TEST_S3_SECRET", SECRET)
    host, port = s3_server
    # moto keeps its buckets per process: start each test from an empty store
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    direct = boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id=KEY_ID,
                          aws_secret_access_key=SECRET, region_name="us-east-1")
    direct.create_bucket(Bucket="docs")
    proxy = Proxy((host, port), s3_download)
    yield direct, proxy
    proxy.close()


def root_yaml(proxy: Proxy, url: str = "s3://docs/handbook/") -> str:
    return (f"{{type: fsspec, url: '{url}', options: {{endpoint_url: 'http://127.0.0.1:{proxy.port}', "
            f"config_kwargs: {{retries: {{max_attempts: 1}}}}}}, secrets: {{key: TEST_S3_KEY_ID, secret: TEST_S3_SECRET}}}}")


def root_spec(proxy: Proxy, url: str = "s3://docs/handbook/") -> dict:
    return {"type": "fsspec", "url": url, "options": {"endpoint_url": f"http://127.0.0.1:{proxy.port}",
                                                      "config_kwargs": {"retries": {"max_attempts": 1}}},
            "secrets": {"key": "TEST_S3_KEY_ID", "secret": "TEST_S3_SECRET"}}


def put(client, key: str, text: str) -> None:
    client.put_object(Bucket="docs", Key=key, Body=text.encode())


def put_many(client, objects: dict[str, str]) -> None:
    """Many PUTs at once (the server is threaded): a thousand one by one take half a minute."""
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda item: put(client, *item), objects.items()))


HANDBOOK = {
    "handbook/onboarding.md": "# Onboarding\n\nNew engineers receive a yubikey and a laptop on day one.\n",
    "handbook/oncall.md": "# On-call\n\nThe pager rotates weekly; handover happens on Mondays at ten.\n",
    "handbook/travel/expenses.txt": "Travel expenses are reimbursed within thirty days of the receipt.\n",
    "handbook/logo.png": "not indexed: excluded by the include patterns",
}


@pytest.fixture
def project(s3, make_project):
    client, proxy = s3
    for key, text in HANDBOOK.items():
        put(client, key, text)
    put(client, "elsewhere/secret-plans.md", "# Not under the prefix\n")
    path = make_project(index_and_search_yaml(batch_size=2).replace("{paths: [docs]}",
                                                                    f"{{paths: [{root_yaml(proxy)}]}}"))
    return path, client, proxy


def test_a_prefix_is_indexed_then_kept_fresh_incrementally(project):
    path, client, proxy = project
    first = run_index(path)
    assert (first.added, first.failed, first.incomplete) == (3, 0, [])
    ids = set(snapshot(path)["sources"])
    assert ids == {"s3://docs/handbook/onboarding.md", "s3://docs/handbook/oncall.md",
                   "s3://docs/handbook/travel/expenses.txt"}
    assert len(proxy.downloads()) == 3

    proxy.requests.clear()
    again = run_index(path)
    assert (again.added, again.updated, again.deleted, again.unchanged) == (0, 0, 0, 3)
    assert proxy.downloads() == []  # every ETag unchanged: nothing downloaded

    proxy.requests.clear()
    put(client, "handbook/oncall.md", "# On-call\n\nThe pager now rotates every fortnight.\n")
    put(client, "handbook/security.md", "# Security\n\nReport phishing to the security desk.\n")
    client.delete_object(Bucket="docs", Key="handbook/onboarding.md")
    changed = run_index(path)
    assert (changed.added, changed.updated, changed.deleted, changed.unchanged) == (1, 1, 1, 1)
    assert sorted(d.split()[1].rsplit("/", 1)[-1] for d in proxy.downloads()) == ["oncall.md", "security.md"]
    snap = snapshot(path)
    assert "s3://docs/handbook/onboarding.md" not in snap["sources"]
    texts = " ".join(text for _, text, _ in snap["chroma"])
    assert "fortnight" in texts and "weekly" not in texts and "phishing" in texts
    assert [c[0] for c in snap["chroma"]] == snap["bm25"] == snap["state_chunks"]


def test_an_unreachable_store_deletes_nothing(project):
    path, client, proxy = project
    assert run_index(path).added == 3
    before = snapshot(path)
    proxy.close()  # the store goes away
    report = run_index(path)
    assert report.incomplete and report.deleted == 0
    assert "cannot list s3://docs/handbook" in report.incomplete[0].reason
    assert snapshot(path) == before


def test_an_object_changed_between_listing_and_download_is_indexed_as_downloaded_then_rechecked(project):
    path, client, proxy = project
    newer = "# On-call\n\nSince the reorganisation the pager rotates daily among seniors.\n"
    proxy.before_download = _only_for("oncall", lambda: put(client, "handbook/oncall.md", newer), proxy)
    first = run_index(path)
    assert first.added == 3
    assert "daily among seniors" in " ".join(text for _, text, _ in snapshot(path)["chroma"])
    proxy.requests.clear()
    second = run_index(path)  # the listing now shows the new ETag: downloaded once more, same content
    assert (second.updated, second.unchanged) == (0, 3)
    assert [d for d in proxy.downloads() if "oncall" in d] and len(proxy.downloads()) == 1
    proxy.requests.clear()
    assert run_index(path).unchanged == 3 and proxy.downloads() == []


def _only_for(name: str, action, proxy: Proxy):
    def hook(line: str) -> None:
        if name in line:
            action()
        else:  # another object came first: wait for ours
            proxy.before_download = hook
    return hook


def test_a_listing_that_fails_halfway_deletes_nothing(s3, tmp_path):
    client, proxy = s3
    put_many(client, {f"bulk/{n:04d}.txt": f"note {n}\n" for n in range(5)})
    params = Params(paths=[{**root_spec(proxy, "s3://docs/bulk/"), "page_size": 2}])  # three pages
    complete = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    documents = load.fn(params=params, ctx=complete)
    assert len(documents) == 5 and [c.path for c in complete.covered] == ["s3://docs/bulk"]
    assert len([r for r in proxy.requests if "max-keys=2" in r.split("\r\n", 1)[0]]) == 3

    client.delete_object(Bucket="docs", Key="bulk/0000.txt")
    # the second page is cut: its request is dropped, its answer never arrives
    proxy.refuse, proxy.refusal = (lambda head: "continuation-token" in head.split("\r\n", 1)[0]), None
    cut = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    assert load.fn(params=params, ctx=cut) == []
    assert cut.covered == [] and [f.source_id for f in cut.failures if f.root] == ["s3://docs/bulk"]
    assert any("continuation-token" in r for r in proxy.requests)
    indexed = [d.source_id for d in documents]
    assert gone_sources(indexed, set(), cut.failures, cut.covered) == []  # nothing is deleted

    proxy.refuse = None
    whole = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    again = load.fn(params=params, ctx=whole)
    assert len(again) == 4
    assert gone_sources(indexed, {d.source_id for d in again}, whole.failures, whole.covered) == \
        ["s3://docs/bulk/0000.txt"]


def test_objects_are_downloaded_several_at_once_and_a_paged_listing_keeps_their_signals(s3, tmp_path):
    client, proxy = s3
    put_many(client, {f"bulk/{n:04d}.txt": f"note {n}\n" for n in range(6)})
    meanwhile = []

    def hold(line: str) -> None:  # the first download waits until others have been asked for, at most 5 s
        deadline = time.monotonic() + 5
        while len(proxy.downloads()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        meanwhile.append(len(proxy.downloads()))

    proxy.before_download = hold
    proxy.refuse = lambda head: head.startswith("GET /docs/bulk/0004.txt ")  # one object cannot be read
    proxy.refusal = http_refusal("403 Forbidden", "<Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
                                 "</Error>", "application/xml")
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    spec = {**root_spec(proxy, "s3://docs/bulk/"), "concurrency": 3}
    assert len(load.fn(params=Params(paths=[spec]), ctx=ctx)) == 5  # the others are indexed
    assert [(f.source_id, f.root) for f in ctx.failures] == [("s3://docs/bulk/0004.txt", False)]
    assert "cannot read object" in ctx.failures[0].reason and [c.path for c in ctx.covered] == ["s3://docs/bulk"]
    assert meanwhile == [3] and len(proxy.downloads()) == 6  # three in flight while the first was held
    proxy.refuse = None

    proxy.requests.clear()
    paged = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    again = load.fn(params=Params(paths=[{**spec, "page_size": 1}]), ctx=paged)
    assert len(again) == 6 and [c.path for c in paged.covered] == ["s3://docs/bulk"] and paged.failures == []
    assert len([r for r in proxy.requests if "max-keys=1" in r.split("\r\n", 1)[0]]) >= 6
    # keys listed page by page have the signals they had: only the object that failed is fetched again
    assert [line.split()[1] for line in proxy.downloads()] == ["/docs/bulk/0004.txt"]


def test_credentials_come_from_the_environment_and_never_show(s3, tmp_path, caplog, monkeypatch):
    client, proxy = s3
    put(client, "handbook/a.md", "# A\n")
    caplog.set_level(logging.DEBUG, logger="ragline")
    spec = root_spec(proxy, "s3://no-such-bucket/x/")
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    load.fn(params=Params(paths=[spec]), ctx=ctx)
    [failure] = ctx.failures
    assert failure.root and "no-such-bucket" in failure.reason
    monkeypatch.delenv("TEST_S3_SECRET")
    missing = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    load.fn(params=Params(paths=[root_spec(proxy)]), ctx=missing)
    assert "TEST_S3_SECRET" in missing.failures[0].reason and missing.failures[0].root
    shown = caplog.text + " ".join(f.reason for f in ctx.failures + missing.failures)
    assert SECRET not in shown and KEY_ID not in shown
    cached = " ".join(p.read_text(errors="replace") for p in Path(tmp_path).rglob("*") if p.is_file())
    assert SECRET not in cached
