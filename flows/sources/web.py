"""``web``: pages crawled from start URLs or a sitemap, through httpx.

Safe by default: only http(s) pages on the start URLs' own origin are fetched (a link to file://,
to 169.254.169.254 or to any other host is never requested), redirects leaving the origin are not
followed, robots.txt is honoured, and depth, page and byte limits bound the crawl. A page is asked
for with If-None-Match / If-Modified-Since, so an unchanged page costs one 304 and is read from the
item cache. Ids are canonical URLs (fragment dropped, ``<link rel=canonical>`` on the same origin).

The listing is complete only when the crawl ended by itself: a page limit reached, robots.txt
unreadable (5xx, timeout) or a failed page whose links are not known from an earlier crawl leaves it
incomplete, so a page is deleted only when a whole crawl no longer finds it.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Literal
from urllib.parse import urldefrag, urljoin, urlsplit
from urllib.robotparser import RobotFileParser

from pydantic import BaseModel, Field, field_validator, model_validator
from ragline.flows.sources.base import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
)
from ragline.flows.sources.local import AccessRules, NonEmpty, RootName

PAGE_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "text/markdown", "application/pdf")
REDIRECTS = (301, 302, 303, 307, 308)
GONE = (404, 410)
MAX_HOPS = 5
# links to these are not pages: never requested
NOT_PAGES = frozenset(".png .jpg .jpeg .gif .svg .webp .ico .css .js .mjs .map .woff .woff2 .ttf .eot .zip .gz .tgz "
                      ".bz2 .xz .7z .tar .mp3 .mp4 .webm .avi .mov .wav .ogg .exe .dmg .iso .deb .rpm .whl".split())


class WebSpec(BaseModel):
    """A crawl of one web origin."""

    model_config = {"extra": "forbid"}

    type: Literal["web"]
    start: list[NonEmpty] = Field([], description="URLs the crawl starts from (one origin)")
    sitemap: NonEmpty | None = Field(None, description="a sitemap.xml whose pages are crawled (same origin)")
    name: RootName | None = Field(None, description="sources are '<name>/<path>' (default: their canonical URL)")
    access: AccessRules = []
    max_depth: int = Field(3, ge=0, le=100, description="links followed from a start page")
    max_pages: int = Field(1000, ge=1, le=1_000_000, description="pages fetched at most; reaching it makes the "
                                                                 "crawl incomplete (nothing deleted)")
    max_total_bytes: int = Field(500_000_000, ge=1, description="bytes downloaded at most in one crawl")
    timeout_seconds: float = Field(10.0, gt=0, le=600, description="for each request")
    delay_seconds: float = Field(0.0, ge=0, le=60, description="pause between requests (politeness)")
    user_agent: NonEmpty = Field("ragline", description="sent with every request and matched in robots.txt")
    robots: bool = Field(True, description="honour robots.txt")

    @field_validator("start")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            _check_http(url)
        return value

    @field_validator("sitemap")
    @classmethod
    def _http_sitemap(cls, value: str | None) -> str | None:
        return _check_http(value) if value else value

    @model_validator(mode="after")
    def _one_origin(self) -> WebSpec:
        urls = self.start + ([self.sitemap] if self.sitemap else [])
        if not urls:
            raise ValueError("a web root needs `start` URLs or a `sitemap`")
        origins = {origin(u) for u in urls}
        if len(origins) > 1:
            raise ValueError(f"a web root crawls one origin; these URLs span {sorted(origins)}: give each its own root")
        return self

    def __str__(self) -> str:
        return ", ".join(self.start) or str(self.sitemap)


def _check_http(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} must be an http:// or https:// URL")
    if parts.password is not None or parts.username is not None:
        raise ValueError("URLs must not hold credentials")
    return url


def origin(url: str) -> str:
    """scheme://host[:port], lower-cased, default ports dropped."""
    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    port = parts.port
    if ":" in host:
        host = f"[{host}]"
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port and port != default else "")


def canonical(url: str) -> str:
    """A URL as an id: fragment dropped, origin normalised, an empty path made '/'."""
    url, _ = urldefrag(url)
    parts = urlsplit(url)
    return origin(url) + (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class WebSource(DocumentSource):
    Spec = WebSpec
    by_name = False

    def __init__(self, spec: WebSpec, max_bytes: int):
        super().__init__(spec, max_bytes)
        self.origin = origin((spec.start or [spec.sitemap])[0])
        self._client: Any = None
        self._robots: RobotFileParser | None = None
        self._spent = 0
        self._seen: set[str] = set()  # URLs this crawl has queued: a redirect to one of them is not followed again
        self.requests: dict[str, int] = {}  # status -> count, for reports and benchmarks

    @property
    def location(self) -> str:
        return self.origin

    def url(self, key: str) -> str | None:
        return f"{self.origin}/{key}"

    def key(self, url: str) -> str:
        return canonical(url)[len(self.origin) + 1:]

    def allowed(self, url: str) -> bool:
        """Only http(s) on this origin, and what robots.txt allows."""
        if urlsplit(url).scheme.lower() not in ("http", "https") or origin(url) != self.origin:
            return False
        return self._robots is None or self._robots.can_fetch(self.spec.user_agent, url)

    def list(self, cache: ItemCache, wanted: Callable[[str], bool]) -> Listing:
        import httpx

        with httpx.Client(timeout=self.spec.timeout_seconds, follow_redirects=False,
                          headers={"User-Agent": self.spec.user_agent}) as self._client:
            try:
                if self.spec.robots and (problem := self._read_robots()):
                    return Listing(complete=False, reason=problem)
                seeds = list(self.spec.start)
                if self.spec.sitemap:
                    seeds += self._sitemap(self.spec.sitemap)
                return self._crawl(seeds, cache, wanted)
            except SourceError as exc:  # the sitemap: without it the crawl does not know its pages
                return Listing(complete=False, reason=f"{exc}: nothing deleted")
            finally:
                self._client = None

    def _crawl(self, seeds: list[str], cache: ItemCache, wanted: Callable[[str], bool]) -> Listing:
        listing = Listing()
        queue = deque((canonical(u), 0) for u in seeds if self.allowed(u))
        seen = self._seen = {u for u, _ in queue}
        listed: set[str] = set()
        while queue:
            url, depth = queue.popleft()
            if len(listed) >= self.spec.max_pages or self._spent > self.spec.max_total_bytes:
                return Listing(listing.items, False, f"crawl of {self.origin} stopped at its limit "
                                                     f"({self.spec.max_pages} pages, {self.spec.max_total_bytes} "
                                                     f"bytes): nothing is deleted", listing.failed)
            page = self._page(url, cache)
            if isinstance(page, SourceError) and page.permanent:  # a loop, a link off the origin: not a page
                listing.failed.append((self.key(url), str(page), True))
                continue
            if isinstance(page, SourceError):  # an outage: its links come from the last crawl, else it is partial
                listing.failed.append((self.key(url), str(page), False))
                previous = cache.cached(self.key(url))
                if previous is None:
                    listing.complete, listing.reason = False, f"{url}: {page}"
                    continue
                declared, links = _parse(url, previous.data, previous.media_type)
            elif page is None:  # gone (404/410) or not a page: not listed, so removed after a complete crawl
                continue
            else:
                item, final = page
                body, media_type = (item.data if item.data is not None else (cache.cached(item.key) or
                                                                             Fetched(b"")).data), item.media_type
                declared, links = _parse(final, body, media_type)
                final = declared if declared and self.allowed(declared) else canonical(final)
                key = self.key(final)
                if key not in listed and wanted(key):
                    listed.add(key)
                    listing.items.append(Item(key, item.signal, item.size, item.modified, item.media_type, item.data))
                seen.add(final)
            if depth < self.spec.max_depth:
                for link in links:
                    if link not in seen and self.allowed(link) and _suffix(link) not in NOT_PAGES:
                        seen.add(link)
                        queue.append((link, depth + 1))
        return listing

    def _page(self, url: str, cache: ItemCache) -> tuple[Item, str] | SourceError | None:
        """One page, asked for conditionally: (item, final URL), None when gone or not a page, or why it failed."""
        def conditional(target: str) -> dict[str, str]:
            previous = cache.cached(self.key(target))
            return _conditional(previous.signal) if previous and previous.signal else {}

        try:
            response, final = self._get(url, conditional)
        except SourceError as exc:
            return exc
        if response is None:  # a redirect to a page this crawl reads anyway
            return None
        if response.status_code == 304 and (previous := cache.cached(self.key(final))) is not None:
            return Item(self.key(final), previous.signal, media_type=previous.media_type), final
        if response.status_code in GONE:
            return None
        if response.status_code != 200:  # 5xx, 429: an outage; 401, 403: not a page for us
            transient = response.status_code >= 500 or response.status_code == 429
            return SourceError(f"HTTP {response.status_code}", permanent=not transient)
        media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type not in PAGE_TYPES:
            return None
        data = response.content
        return Item(self.key(final), _signal(response.headers), len(data), _modified(response.headers),
                    media_type, data), final

    def _get(self, url: str, headers: Callable[[str], dict[str, str]] = lambda url: {},
             any_type: bool = False) -> tuple[Any, str]:
        """GET with redirects followed by hand: only on this origin, at most MAX_HOPS."""
        import httpx

        chain = [url]
        for _ in range(MAX_HOPS + 1):
            if self.spec.delay_seconds:
                time.sleep(self.spec.delay_seconds)
            try:
                with self._client.stream("GET", url, headers=headers(url)) as response:
                    data = b""
                    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                    for chunk in response.iter_bytes() if any_type or kind in PAGE_TYPES else ():  # not a page: body unread
                        data += chunk
                        if len(data) > self.max_bytes:
                            raise SourceError(f"page is over the max_bytes limit of {self.max_bytes}")
                    self._spent += len(data)
                    response._content = data  # read once, bounded
            except httpx.TimeoutException:
                raise SourceError(f"timed out after {self.spec.timeout_seconds:g} s") from None
            except httpx.HTTPError as exc:
                raise SourceError(f"cannot fetch: {type(exc).__name__}: {exc}") from None
            self.requests[str(response.status_code)] = self.requests.get(str(response.status_code), 0) + 1
            if response.status_code not in REDIRECTS:
                return response, url
            target = canonical(urljoin(url, response.headers.get("location", "")))
            if not self.allowed(target):
                raise SourceError(f"redirects to {target}, off this origin or disallowed: not followed", permanent=True)
            if target in chain:
                raise SourceError(f"redirect loop: {' -> '.join(chain + [target])}", permanent=True)
            if target in self._seen:
                return None, target
            self._seen.add(target)
            chain.append(target)
            url = target
        raise SourceError(f"more than {MAX_HOPS} redirects (a loop?)", permanent=True)

    def fetch(self, item: Item) -> Fetched:
        """A page read again without conditions (its cached copy was lost or damaged)."""
        import httpx

        with httpx.Client(timeout=self.spec.timeout_seconds, headers={"User-Agent": self.spec.user_agent}) as client:
            self._client, self._seen = client, set()
            try:
                response, _ = self._get(self.url(item.key))
            finally:
                self._client = None
        if response.status_code != 200:
            raise SourceError(f"HTTP {response.status_code}")
        return Fetched(response.content, _modified(response.headers), _signal(response.headers),
                       response.headers.get("content-type"))

    def _read_robots(self) -> str | None:
        """Load robots.txt; None when the crawl may go on. Missing (4xx): everything allowed;
        unreachable or 5xx: nothing is crawled (RFC 9309), and the listing is incomplete."""
        try:
            response, _ = self._get(f"{self.origin}/robots.txt", any_type=True)
        except SourceError as exc:
            return f"robots.txt of {self.origin} unreadable ({exc}): not crawled, nothing deleted"
        if response.status_code >= 500:
            return f"robots.txt of {self.origin} answered HTTP {response.status_code}: not crawled, nothing deleted"
        self._robots = RobotFileParser()
        self._robots.parse(response.text.splitlines() if response.status_code == 200 else [])
        return None

    def _sitemap(self, url: str, nested: bool = True) -> list[str]:
        """Page URLs of a sitemap (and of the sitemaps a sitemap index names, one level)."""
        from lxml import etree

        try:
            response, _ = self._get(url, any_type=True)
            root = etree.fromstring(response.content, parser=etree.XMLParser(resolve_entities=False, no_network=True))
        except (SourceError, etree.XMLSyntaxError) as exc:
            raise SourceError(f"sitemap {url} unreadable: {exc}") from None
        locs = [(e.text or "").strip() for e in root.iter("{*}loc")]
        if root.tag.endswith("sitemapindex") and nested:
            return [page for loc in locs if self.allowed(loc) for page in self._sitemap(loc, nested=False)]
        return [loc for loc in locs if loc]


def _parse(url: str, body: bytes, media_type: str | None) -> tuple[str | None, list[str]]:
    """An HTML page's <link rel=canonical> (absolute) and its links (a, area, frames), canonical and
    each once, from one parse; nothing for other types. In-page anchors and non-http schemes are
    dropped before joining (API docs have thousands)."""
    if media_type not in ("text/html", "application/xhtml+xml") or not body:
        return None, []
    from lxml import html

    try:
        tree = html.fromstring(body)
    except Exception:  # noqa: BLE001 - lxml raises several types on broken markup
        return None, []
    declared = tree.xpath("//link[@rel='canonical']/@href")
    base = urljoin(url, (tree.xpath("//base/@href") or [url])[0])
    hrefs = {h.strip().split("#", 1)[0] for h in tree.xpath("//a/@href | //area/@href | //frame/@src | //iframe/@src")}
    links = sorted({canonical(urljoin(base, h)) for h in hrefs
                    if h and not h.lower().startswith(("mailto:", "javascript:", "data:", "tel:"))})
    return (canonical(urljoin(url, declared[0].strip())) if declared else None), links


def _suffix(url: str) -> str:
    path = urlsplit(url).path
    name = path.rsplit("/", 1)[-1]
    return name[name.rfind("."):].lower() if "." in name else ""


def _conditional(signal: str) -> dict[str, str]:
    kind, _, value = signal.partition(":")
    return {"If-None-Match": value} if kind == "etag" else {"If-Modified-Since": value} if kind == "modified" else {}


def _signal(headers: Any) -> str | None:
    if etag := headers.get("etag"):
        return f"etag:{etag}"
    if modified := headers.get("last-modified"):
        return f"modified:{modified}"
    return None


def _modified(headers: Any) -> float | None:
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(headers["last-modified"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None
