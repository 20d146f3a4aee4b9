"""``web`` roots against a real HTTP server on loopback: conditional requests, redirects (on and off
the origin), a redirect loop, 404s, a slow page, robots.txt, depth and page limits, links that must
never be fetched, and pages that disappear."""
from __future__ import annotations

import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragline.flows.context import StepContext
from ragline.flows.sources.web import WebSource, WebSpec
from ragline.tasks.ingest.index import gone_sources
from ragline.tasks.ingest.load import Params, load
from tests.helpers.data import index_and_search_yaml
from tests.helpers.harness import run_index, snapshot
from tests.helpers.net import serve_in_thread

pytestmark = pytest.mark.integration

MODIFIED = formatdate(1_700_000_000, usegmt=True)


class Site:
    """A small web site whose pages the test edits; counts every request by path and status."""

    def __init__(self, pages: dict[str, tuple]):
        self.pages = pages  # path -> (status, headers, body) or a callable returning it
        self.log: list[tuple[str, int]] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                status, headers, body = site.answer(self.path, self.headers)
                body = body.encode() if isinstance(body, str) else body
                site.log.append((self.path, status))
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (a timeout)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server)

    def answer(self, path: str, headers) -> tuple[int, dict, bytes]:
        entry = self.pages.get(path)
        if entry is None:
            return 404, {"Content-Type": "text/html"}, b"<h1>Not found</h1>"
        if callable(entry):
            return entry()
        status, extra, body = entry
        etag = extra.get("ETag")
        if etag and headers.get("If-None-Match") == etag:
            return 304, {"ETag": etag}, b""
        if extra.get("Last-Modified") and headers.get("If-Modified-Since") == extra["Last-Modified"]:
            return 304, {}, b""
        return status, extra, body.encode() if isinstance(body, str) else body

    def requests(self, status: int | None = None) -> list[str]:
        return [p for p, s in self.log if status is None or s == status]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def html(body: str, etag: str | None = None, modified: str | None = None, title: str = "") -> tuple:
    headers = {"Content-Type": "text/html; charset=utf-8"}
    if etag:
        headers["ETag"] = etag
    if modified:
        headers["Last-Modified"] = modified
    return 200, headers, f"<html><head><title>{title}</title></head><body>{body}</body></html>"


def redirect(to: str, status: int = 301) -> tuple:
    return status, {"Location": to}, b""


@pytest.fixture
def sites():
    other = Site({"/x": html("<p>Another host's page.</p>")})
    site = Site({})
    site.pages.update({
        "/robots.txt": (200, {"Content-Type": "text/plain"}, "User-agent: *\nDisallow: /private/\n"),
        "/": html(f"""<h1>Home</h1><p>Welcome to the handbook.</p>
            <a href="/a.html#intro">A</a> <a href="b">B</a> <a href="/to-a">to A</a>
            <a href="/loop1">loop</a> <a href="/missing">gone</a> <a href="/private/secret.html">private</a>
            <a href="/off-host">off-host redirect</a> <a href="file:///etc/passwd">passwd</a>
            <a href="http://169.254.169.254/latest/meta-data/">metadata</a> <a href="{other.url}/x">other host</a>
            <a href="/deep1">deep</a> <a href="/logo.png">logo</a> <a href="/print/a">print</a>""",
                  etag='"home-1"', title="Home"),
        "/print/a": (200, {"Content-Type": "text/html"}, '<link rel="canonical" href="/a.html"><p>Alpha, printable.</p>'),
        "/a.html": html("<p>Alpha explains the onboarding laptop.</p><a href='/'>home</a>", etag='"a-1"',
                        title="Alpha"),
        "/b": html("<p>Beta covers the pager rotation.</p>", modified=MODIFIED, title="Beta"),
        "/to-a": redirect("/a.html"),
        "/loop1": redirect("/loop2", 302),
        "/loop2": redirect("/loop1", 302),
        "/off-host": redirect("http://169.254.169.254/latest/meta-data/", 302),
        "/private/secret.html": html("<p>Disallowed by robots.txt.</p>"),
        "/deep1": html("<p>Depth one.</p><a href='/deep2'>2</a>", etag='"d1"'),
        "/deep2": html("<p>Depth two.</p><a href='/deep3'>3</a>", etag='"d2"'),
        "/deep3": html("<p>Depth three: beyond max_depth 2.</p>", etag='"d3"'),
        "/logo.png": (200, {"Content-Type": "image/png"}, b"\x89PNG..."),
    })
    yield site, other
    site.close()
    other.close()


def crawl(site: Site, tmp_path, **options) -> tuple[list, StepContext]:
    spec = {"type": "web", "start": [site.url + "/"], "max_depth": 2, "timeout_seconds": 1, **options}
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    return load.fn(params=Params(paths=[spec]), ctx=ctx), ctx


def test_a_crawl_stays_on_its_origin_and_ids_are_canonical_urls(sites, tmp_path):
    site, other = sites
    documents, ctx = crawl(site, tmp_path)
    assert sorted(d.source_id for d in documents) == [site.url + p for p in ("/", "/a.html", "/b", "/deep1", "/deep2")]
    assert {d.format for d in documents} == {"html"} and documents[0].path.startswith("http://127.0.0.1")
    assert other.log == []  # another host is never asked
    assert "/private/secret.html" not in site.requests() and "/deep3" not in site.requests()
    reasons = {f.source_id: f.reason for f in ctx.failures}
    assert "169.254.169.254" in reasons[site.url + "/off-host"] and "not followed" in reasons[site.url + "/off-host"]
    assert "redirect loop" in reasons[site.url + "/loop1"] and site.requests().count("/loop1") == 1
    assert site.requests().count("/a.html") == 1  # /to-a redirected to it: read once, one id
    assert "/print/a" in site.requests()  # read, but its <link rel=canonical> names /a.html: no second id
    assert "/logo.png" not in site.requests()  # an image link is never requested
    assert ctx.covered and not [f for f in ctx.failures if f.root]  # a loop or an off-host link is no outage
    assert all(f.skipped for f in ctx.failures)  # ... and what was indexed from such a page goes


def test_an_unchanged_page_costs_one_304(sites, tmp_path):
    site, _ = sites
    first, ctx = crawl(site, tmp_path)
    assert ctx.covered and not [f for f in ctx.failures if f.root]
    site.log.clear()
    again, ctx2 = crawl(site, tmp_path)
    assert [d.model_dump() for d in again] == [d.model_dump() for d in first]
    pages = {"/", "/a.html", "/b", "/deep1", "/deep2"}
    assert {p for p, s in site.log if s == 304} == pages  # ETag and Last-Modified both answered 304
    assert [p for p, s in site.log if s == 200] == ["/robots.txt", "/print/a"]  # no validator: read again


def test_a_slow_page_times_out_and_the_crawl_deletes_nothing(sites, tmp_path):
    site, _ = sites
    site.pages["/"] = html("<a href='/a.html'>a</a> <a href='/slow'>slow</a>", etag='"h3"')

    def slow():
        time.sleep(3)
        return html("<p>late</p>")
    site.pages["/slow"] = slow
    started = time.monotonic()
    documents, ctx = crawl(site, tmp_path)
    assert time.monotonic() - started < 3
    [root] = [f for f in ctx.failures if f.root]
    assert "/slow" in root.reason and "timed out" in root.reason and not ctx.covered
    assert gone_sources([site.url + "/gone.html"], set(), ctx.failures, ctx.covered) == []


def test_limits_and_robots(sites, tmp_path):
    site, _ = sites
    documents, ctx = crawl(site, tmp_path, max_pages=2)
    assert len(documents) == 2 and any("limit" in f.reason for f in ctx.failures if f.root)
    site.pages["/robots.txt"] = (503, {}, "down")
    documents, ctx = crawl(site, tmp_path)
    assert documents == [] and "robots.txt" in ctx.failures[0].reason and ctx.failures[0].root


def test_links_off_the_origin_are_never_allowed():
    source = WebSource(WebSpec(type="web", start=["http://docs.example:8080/"]), 1000)
    assert source.allowed("http://docs.example:8080/a")
    for url in ("file:///etc/passwd", "http://169.254.169.254/latest/meta-data/", "http://docs.example/a",
                "https://docs.example:8080/a", "http://evil.example/", "ftp://docs.example:8080/a",
                "http://docs.example:8080@169.254.169.254/"):
        assert not source.allowed(url), url


def test_a_sitemap_seeds_the_crawl(sites, tmp_path):
    site, _ = sites
    site.pages["/sitemap.xml"] = (200, {"Content-Type": "application/xml"},
                                  f"<?xml version='1.0'?><urlset xmlns='http://www.sitemaps.org/schemas/sitemap/0.9'>"
                                  f"<url><loc>{site.url}/b</loc></url><url><loc>{site.url}/deep3</loc></url>"
                                  f"<url><loc>http://169.254.169.254/x</loc></url></urlset>")
    spec = {"type": "web", "sitemap": site.url + "/sitemap.xml", "max_depth": 0}
    ctx = StepContext(pipeline="t", step_id="load", base_dir=str(tmp_path))
    documents = load.fn(params=Params(paths=[spec]), ctx=ctx)
    assert sorted(d.source_id for d in documents) == [site.url + "/b", site.url + "/deep3"] and ctx.covered


def test_a_page_that_disappears_is_deleted_only_after_a_complete_crawl(sites, make_project):
    site, _ = sites
    site.pages["/"] = html("<a href='/a.html'>a</a> <a href='/b'>b</a> <a href='/extra.html'>x</a>", etag='"h4"')
    site.pages["/extra.html"] = html("<p>Extra pages describe the quarterly offsite in Lisbon.</p>", etag='"x1"')
    root = f"{{type: web, start: ['{site.url}/'], max_depth: 1, timeout_seconds: 2}}"
    path = make_project(index_and_search_yaml(batch_size=2).replace("{paths: [docs]}", f"{{paths: [{root}]}}"))
    first = run_index(path)
    assert (first.added, first.failed) == (4, 0)
    del site.pages["/extra.html"]
    site.pages["/b"] = lambda: (500, {}, b"oops")  # fails this time: kept, and its last links still count
    second = run_index(path)
    assert second.deleted == 1 and second.failed == 1  # /b failed (kept), /extra.html gone (deleted)
    assert site.url + "/b" in snapshot(path)["sources"]
    assert site.url + "/extra.html" not in snapshot(path)["sources"]
    site.pages["/robots.txt"] = (503, {}, "")  # nothing can be crawled: nothing deleted
    del site.pages["/a.html"]
    third = run_index(path)
    assert third.incomplete and third.deleted == 0 and site.url + "/a.html" in snapshot(path)["sources"]


def test_a_damaged_cache_means_one_more_download_not_a_wrong_page(sites, tmp_path):
    site, _ = sites
    first, _ = crawl(site, tmp_path)
    for blob in (tmp_path / ".ragline" / "sources").rglob("blobs/*"):
        blob.write_bytes(b"garbled")
    site.log.clear()
    again, ctx = crawl(site, tmp_path)
    assert [d.model_dump() for d in again] == [d.model_dump() for d in first] and ctx.covered
    assert site.requests(304) == [] and site.requests(200).count("/a.html") == 1  # asked again without conditions
