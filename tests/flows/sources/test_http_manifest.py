"""``fsspec`` roots over http(s)://, which cannot list a folder: a manifest names the keys. Against a
real HTTP server on loopback (Python's own file server), through the ``load`` stage."""
from __future__ import annotations

from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from ragline.flows.context import StepContext
from ragline.flows.sources.fsspec import FsspecSpec
from ragline.tasks.ingest.index import gone_sources
from ragline.tasks.ingest.load import Params, load
from tests.helpers.net import serve_in_thread
from tests.helpers.optional import requires

pytestmark = requires("aiohttp")  # fsspec's http backend


class CountingHandler(SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def send_head(self):
        type(self).requests.append(f"{self.command} {self.path}")
        return super().send_head()


@pytest.fixture
def site(tmp_path):
    folder = tmp_path / "site"
    (folder / "docs" / "sub").mkdir(parents=True)
    (folder / "docs" / "a.md").write_text("# Alpha\n\nAlpha is served over HTTP.\n")
    (folder / "docs" / "sub" / "b.txt").write_text("Beta notes over HTTP.\n")
    (folder / "secret.txt").write_text("outside the prefix\n")
    (folder / "docs" / "manifest.txt").write_text(
        "a.md\nsub/b.txt\n../secret.txt\nhttp://169.254.169.254/latest\nmissing.md\n# a comment\n\n")
    CountingHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(CountingHandler, directory=str(folder)))
    serve_in_thread(server)
    yield folder, f"http://127.0.0.1:{server.server_port}/docs/"
    server.shutdown()
    server.server_close()


def run_load(url, tmp_path):
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    params = Params(paths=[{"type": "fsspec", "url": url, "manifest": "manifest.txt"}])
    return load.fn(params=params, ctx=ctx), ctx


def test_the_manifest_is_the_listing_and_entries_outside_the_prefix_are_never_fetched(site, tmp_path):
    folder, url = site
    documents, ctx = run_load(url, tmp_path)
    root = url.rstrip("/")
    assert sorted(d.source_id for d in documents) == [f"{root}/a.md", f"{root}/sub/b.txt"]
    assert [c.path for c in ctx.covered] == [root]
    reasons = {f.source_id.rsplit("/", 1)[-1]: f.reason for f in ctx.failures}
    assert "no '..'" in reasons["secret.txt"] and "latest" in reasons and "unreadable" in reasons["missing.md"]
    assert not any("secret" in r or "169.254" in r for r in CountingHandler.requests)


def test_an_unchanged_file_is_not_downloaded_again_and_a_key_taken_out_is_deleted(site, tmp_path):
    folder, url = site
    first, _ = run_load(url, tmp_path)
    CountingHandler.requests = []
    again, _ = run_load(url, tmp_path)
    assert [d.text for d in again] == [d.text for d in first]
    downloads = [r for r in CountingHandler.requests if r.startswith("GET") and r.endswith(("/a.md", "/b.txt"))]
    assert downloads == [] and "HEAD /docs/a.md" in CountingHandler.requests  # one HEAD each, no body
    (folder / "docs" / "manifest.txt").write_text("a.md\n")
    fewer, ctx = run_load(url, tmp_path)
    root = url.rstrip("/")
    assert gone_sources([d.source_id for d in first], {d.source_id for d in fewer}, ctx.failures, ctx.covered) == \
        [f"{root}/sub/b.txt"]


def test_a_manifest_that_cannot_be_read_deletes_nothing(site, tmp_path):
    folder, url = site
    first, _ = run_load(url, tmp_path)
    (folder / "docs" / "manifest.txt").unlink()
    documents, ctx = run_load(url, tmp_path)
    assert documents == [] and ctx.covered == []
    [failure] = ctx.failures
    assert failure.root and "cannot read the manifest" in failure.reason
    assert gone_sources([d.source_id for d in first], set(), ctx.failures, ctx.covered) == []


@pytest.mark.parametrize(("fields", "message"), [
    ({"url": "https://example.org/docs/"}, "cannot be listed: name a `manifest`"),
    ({"url": "s3://bucket/docs/", "manifest": "list.txt"}, "`manifest` is for http(s)://"),
    ({"url": "https://example.org/docs/", "manifest": "../list.txt"}, "must be a path below `url`"),
    ({"url": "https://example.org/docs/", "manifest": "https://evil.example/list.txt"}, "must be a path below"),
])
def test_manifest_rules_are_checked_with_the_file(fields, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FsspecSpec(type="fsspec", **fields)
