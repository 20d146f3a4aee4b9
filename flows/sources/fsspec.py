"""``fsspec``: objects under a URL prefix (``s3://``, ``gs://``, ``az://``, ``sftp://``, ...) through
fsspec and its maintained backends, one extra each: s3fs (``ragline[s3]``), gcsfs (``ragline[gcs]``),
adlfs (``ragline[azure]``), sshfs on asyncssh (``ragline[sftp]``).

The change signal is the listing field that changes when an object's bytes do, read from the listing
itself (no request per object): S3's ETag; GCS's ``generation`` (a new one per write of the bytes;
its etag also moves on metadata-only updates); Azure's blob ETag (moves on every write, metadata
included: a spare download, never a stale index); SFTP has no version, so size and mtime (whole
seconds in SFTP v3: a same-size rewrite within the second of the last download is missed until the
file changes again). A backend not named here: the first version-like field, else size and mtime.

Credentials never come from pipelines.yaml: the backend's own environment (AWS_ACCESS_KEY_ID,
GOOGLE_APPLICATION_CREDENTIALS, ...) or ``secrets``, which maps a storage option to the name of an
environment variable holding it. A secret-looking option or a password in the URL is refused when
the file is checked, and secret values are scrubbed from every message.
"""
from __future__ import annotations

import os
import re
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Iterable, Iterator, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from ragline.flows.sources.base import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
)
from ragline.flows.sources.local import AccessRules, NonEmpty, PublicUrl, RootName

SECRET_OPTION = re.compile(r"(?:^|_)(?:key|secret|password|passwd|passphrase|token|credentials?|sas|sig|signature|"
                           r"connection_string)(?:$|_)", re.I)
TOKEN_METHODS = ("anon", "google_default", "cloud")  # gcsfs `token` values that name a method, not a credential
SIGNAL_FIELDS = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "content_md5", "checksum")
SIGNAL_FIELDS_BY_PROTOCOL = {  # the field that changes exactly when the bytes do, per backend (see above)
    **dict.fromkeys(("s3", "s3a"), ("ETag", "VersionId")),
    **dict.fromkeys(("gs", "gcs"), ("generation",)),
    **dict.fromkeys(("az", "abfs", "abfss"), ("etag",)),
    **dict.fromkeys(("sftp", "ssh"), ()),
}
MTIME_FIELDS = ("LastModified", "last_modified", "mtime", "updated", "modified")
HTTP_SCHEMES = ("http", "https")
PAGED = frozenset(("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"))  # backends whose listing `page_size` sets
EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure", "sftp": "sftp",
          "ssh": "sftp"}


class FsspecSpec(BaseModel):
    """Objects under a URL prefix, read through fsspec."""

    model_config = {"extra": "forbid"}

    type: Literal["fsspec"]
    url: NonEmpty = Field(..., description="prefix to list recursively, e.g. s3://bucket/docs/")
    name: RootName | None = Field(None, description="what its sources are identified by: '<name>/<key below the "
                                                    "prefix>' (default: the URL itself)")
    url_prefix: PublicUrl | None = Field(None, description="public http(s) URL a source links to, followed by its key")
    access: AccessRules = []
    options: dict[str, Any] = Field({}, description="storage options of the backend that are not secrets "
                                                    "(endpoint_url, region_name, anon, ...)")
    secrets: dict[str, NonEmpty] = Field({}, description="storage option -> name of the environment variable "
                                                         "holding it (key, secret, token, password, ...)")
    manifest: NonEmpty | None = Field(None, description="http(s):// prefixes only (HTTP cannot list a folder): "
                                                        "a file below `url` naming one key per line; the listing "
                                                        "is the manifest, so a key taken out of it is deleted")
    concurrency: int = Field(16, ge=1, le=256, description="objects downloaded at once; those started ahead "
                                                           "of loading hold at most 64 MiB together (one larger "
                                                           "object runs alone)")
    hard_links: bool = Field(False, description="index files with more than one hard link, on a backend that "
                                                "reports the count (file://; off: skipped with a reason, as on a "
                                                "local root)")
    page_size: int | None = Field(None, ge=1, le=5000, description="objects per listing request on s3://, gs:// "
                                                                   "and az:// (default: the store's own, 1,000 on S3 "
                                                                   "and GCS, 5,000 on Azure)")

    @field_validator("url")
    @classmethod
    def _plain_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if not re.match(r"^[a-z][a-z0-9+.-]*$", parts.scheme or "", re.I) or "://" not in value:
            raise ValueError("url must be a URL with a scheme, e.g. s3://bucket/prefix/")
        if parts.password is not None:
            raise ValueError("url must not hold a password: name an environment variable in `secrets`")
        if parts.query or parts.fragment:
            raise ValueError("url must not have a query or fragment: put storage options in `options`")
        return value

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in _keys(value):
            if name == "token" and value.get(name) in TOKEN_METHODS:
                continue
            if SECRET_OPTION.search(name):
                raise ValueError(f"option {name!r} looks like a credential: set it in the environment and name the "
                                 f"variable under `secrets` ({name}: MY_ENV_VAR), never in pipelines.yaml")
        return value

    @field_validator("secrets")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for option, env in value.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
                raise ValueError(f"secrets.{option} must name an environment variable (letters, digits, '_')")
        return value

    @field_validator("page_size")
    @classmethod
    def _paged_store(cls, value: int | None, info: ValidationInfo) -> int | None:
        scheme = urlsplit(str(info.data.get("url", ""))).scheme.lower()
        if value is not None and scheme not in PAGED:
            raise ValueError(f"page_size is for the stores that list in pages (s3://, gs://, az://), not {scheme}://")
        return value

    @model_validator(mode="after")
    def _manifest_for_http(self) -> FsspecSpec:
        web = urlsplit(self.url).scheme.lower() in HTTP_SCHEMES
        if web and self.manifest is None:
            raise ValueError("an http(s):// prefix cannot be listed: name a `manifest` file below it (one key per "
                             "line), or crawl the site with `type: web`")
        if self.manifest is not None and not web:
            raise ValueError("`manifest` is for http(s):// prefixes; other stores list their objects themselves")
        if self.manifest is not None and not _safe_key(self.manifest):
            raise ValueError(f"manifest {self.manifest!r} must be a path below `url` (no '..', query or scheme)")
        return self

    def __str__(self) -> str:
        return self.url


def _keys(options: dict[str, Any]) -> list[str]:
    return [k for key, value in options.items() for k in [str(key), *(_keys(value) if isinstance(value, dict) else [])]]


class FsspecSource(DocumentSource):
    Spec = FsspecSpec

    def __init__(self, spec: FsspecSpec, max_bytes: int):
        super().__init__(spec, max_bytes)
        self._fs: Any = None
        self._secrets: list[str] = []

    @property
    def location(self) -> str:
        return self.spec.url.rstrip("/")

    @property
    def protocol(self) -> str:
        return urlsplit(self.spec.url).scheme.lower()

    def filesystem(self) -> Any:
        """The backend, made fresh (no listing cache, no shared instance: every run sees the store as it is)."""
        if self._fs is None:
            import fsspec

            secrets = {}
            for option, env in self.spec.secrets.items():
                value = os.environ.get(env)
                if not value:
                    raise SourceError(f"environment variable {env} (storage option {option!r}) is not set")
                secrets[option] = value
            self._secrets = [v for v in secrets.values() if len(v) >= 4]
            try:
                self._fs = fsspec.filesystem(self.protocol, skip_instance_cache=True,
                                             **self._options(fsspec.get_filesystem_class(self.protocol)), **secrets)
            except ImportError as exc:
                hint = f"pip install 'ragline[{EXTRAS[self.protocol]}]'" if self.protocol in EXTRAS else "install it"
                raise SourceError(f"no fsspec backend for {self.protocol}:// ({exc}); {hint}") from None
            except Exception as exc:  # noqa: BLE001 - each backend raises its own types
                raise SourceError(self.scrub(f"cannot open {self.protocol}:// ({type(exc).__name__}: {exc})")) from None
        return self._fs

    def _options(self, backend: type) -> dict[str, Any]:
        """What the URL says (an SFTP host, port and user) under the configured options. SFTP checks
        the server's host key against ~/.ssh/known_hosts (sshfs's own default checks nothing):
        `known_hosts` names another file, or null to skip the check knowingly."""
        options = {**backend._get_kwargs_from_urls(self.spec.url), **self.spec.options}
        if self.protocol in ("sftp", "ssh"):  # sshfs keeps no listings and hands every option to asyncssh
            options.setdefault("known_hosts", ())  # asyncssh's default: ~/.ssh/known_hosts, none trusted without it
        else:
            options["use_listings_cache"] = False
        if self.protocol in ("s3", "s3a"):  # botocore keeps 10 connections: as many as objects fetched at once
            config = options.get("config_kwargs") or {}
            if isinstance(config, dict) and self.spec.concurrency > 10 and "max_pool_connections" not in config:
                options["config_kwargs"] = {**config, "max_pool_connections": self.spec.concurrency}
        return options

    def scrub(self, text: str) -> str:
        """A message with every secret value blanked (a backend may echo what it was given)."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _root(self) -> str:
        return self.filesystem()._strip_protocol(self.spec.url).rstrip("/")

    def list(self, cache: ItemCache, wanted: Callable[[str], bool]) -> Listing:
        if self.spec.manifest is not None:
            return self._manifest_listing(wanted)
        try:
            root = self._root()
            fs = self.filesystem()
            if self.spec.page_size is not None:
                found = _paged(fs, self.protocol, root, self.spec.page_size)
            else:
                found = _walk(fs, root) if _walks(fs) else fs.find(root, detail=True)
        except Exception as exc:  # noqa: BLE001 - a listing that fails anywhere is incomplete, whatever raised
            reason = exc if isinstance(exc, SourceError) else f"{type(exc).__name__}: {exc}"
            return Listing(complete=False, reason=self.scrub(f"cannot list {self.location}: {reason}"))
        items = []
        failed: list[tuple[str, str, bool]] = []
        for path, info in sorted(found.items()):
            if info.get("type", "file") != "file" or not path.startswith(root + "/"):
                continue
            key = path[len(root) + 1:]
            if not wanted(key):
                continue
            if (refused := self._hard_linked(info)) is not None:
                failed.append((key, refused, True))
                continue
            items.append(Item(key=key, signal=_signal(info, self.protocol), size=info.get("size"),
                              modified=_mtime(info)))
        if not found:  # a prefix cannot be told from a typo of one: like a missing folder, it deletes nothing
            return Listing(complete=False, reason=f"no objects under {self.location}")
        return Listing(items, failed=failed)

    def _hard_linked(self, info: dict[str, Any]) -> str | None:
        """Why a file with more than one hard link is skipped (a backend that reports ``nlink``: a
        local folder read as file://), as ``load`` skips one on a local root; None when it is read."""
        links = info.get("nlink")
        if self.spec.hard_links or not isinstance(links, int) or links <= 1:
            return None
        return (f"file has {links} hard links (its content may be a file outside the root): skipped (set "
                f"hard_links: true on the root to index it)")

    def _manifest_listing(self, wanted: Callable[[str], bool]) -> Listing:
        """The keys the manifest names, each with its headers' change signal (one HEAD each). An
        unreadable manifest is an incomplete listing; a named key that cannot be reached is that
        item's failure (its indexed chunks kept); a key outside the prefix is refused, never fetched."""
        root = self._root()
        manifest = f"{root}/{self.spec.manifest.lstrip('/')}"
        try:
            text = self.filesystem().cat_file(manifest, start=0, end=self.max_bytes + 1).decode("utf-8")
        except Exception as exc:  # noqa: BLE001 - any failure to read it leaves the listing incomplete
            return Listing(complete=False, reason=self.scrub(f"cannot read the manifest {manifest}: "
                                                             f"{type(exc).__name__}: {exc}"))
        items: list[Item] = []
        failed: list[tuple[str, str, bool]] = []
        for key in dict.fromkeys(line.strip() for line in text.splitlines()):
            if not key or key.startswith("#"):
                continue
            if not _safe_key(key):  # reported even when `include` would skip it: a manifest that reaches out
                failed.append((key, "a manifest entry must be a path below the prefix (no '..', query or scheme)",
                               True))
                continue
            if not wanted(key):
                continue
            try:
                info = self.filesystem().info(f"{root}/{key}")
            except Exception as exc:  # noqa: BLE001 - 404, refused, timed out: this item only
                failed.append((key, self.scrub(f"named in the manifest but unreadable: {type(exc).__name__}: "
                                               f"{exc}"), False))
                continue
            if (refused := self._hard_linked(info)) is not None:
                failed.append((key, refused, True))
                continue
            items.append(Item(key=key, signal=_signal(info, self.protocol), size=info.get("size"),
                              modified=_mtime(info)))
        return Listing(items, failed=failed)

    def fetch(self, item: Item) -> Fetched:
        if item.size is not None and item.size > self.max_bytes:
            raise SourceError(f"object is {item.size} bytes, over the max_bytes limit of {self.max_bytes}")
        try:
            data = self.filesystem().cat_file(f"{self._root()}/{item.key}", start=0, end=self.max_bytes + 1)
        except FileNotFoundError:
            raise SourceError("object disappeared after it was listed") from None
        except Exception as exc:  # noqa: BLE001
            raise SourceError(self.scrub(f"cannot read object: {type(exc).__name__}: {exc}")) from None
        if len(data) > self.max_bytes:
            raise SourceError(f"object is over the max_bytes limit of {self.max_bytes}")
        return Fetched(data, item.modified, item.signal)

    @property
    def fetch_concurrency(self) -> int:
        return self.spec.concurrency

    def fetch_all(self, items: Iterable[Item]) -> Iterator[tuple[Item, Fetched | SourceError]]:
        try:
            self.filesystem()  # opened once, before the fetching threads share it
        except SourceError:
            pass  # each fetch reports it as its item's failure
        return super().fetch_all(items)

    def url(self, key: str) -> str | None:
        if self.spec.url_prefix:
            from urllib.parse import quote

            return self.spec.url_prefix.rstrip("/") + "/" + quote(key)
        return None


def _safe_key(key: str) -> bool:
    """A relative path that stays below the prefix once a server normalises it."""
    parts = urlsplit(key)
    return not (parts.scheme or parts.netloc or parts.query or parts.fragment or key.startswith("/")
                or ".." in key.replace("\\", "/").split("/") or any(ord(c) < 32 for c in key))


def _walks(fs: Any) -> bool:
    """Whether the backend's find() is fsspec's folder-by-folder walk (SFTP): that walk leaves out a
    sub-folder it cannot read (its on_error reaches the top folder only), so `_walk` lists instead."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    if isinstance(fs, AsyncFileSystem):
        return type(fs)._find is AsyncFileSystem._find
    return type(fs).find is AbstractFileSystem.find


def _walk(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """Every file below ``root``, one listing per folder; a folder that cannot be read raises, so
    the listing is incomplete rather than short. Links are not followed (each folder is read once)."""
    found: dict[str, dict[str, Any]] = {}
    folders, seen = [root], {root}
    while folders:
        folder = folders.pop()
        for info in fs.ls(folder, detail=True):
            name = info["name"].rstrip("/")
            if info.get("type") == "directory":
                if name not in seen and name.startswith(root + "/"):
                    seen.add(name)
                    folders.append(name)
            elif name.startswith(root + "/"):
                found[name] = info
    return found


def _paged(fs: Any, protocol: str, root: str, size: int) -> dict[str, dict[str, Any]]:
    """Every object below ``root``, listed ``size`` keys a request through the backend's own listing
    call (fsspec's find() takes no page size). The infos are the ones find() gives: the same change
    signals, so setting page_size downloads nothing again. Any page that fails raises."""
    from fsspec.asyn import sync

    if protocol in ("s3", "s3a"):
        return _s3_pages(fs, root, size)
    if protocol in ("gs", "gcs"):
        items, _ = sync(fs.loop, fs._do_list_objects, root, delimiter="", items_per_call=size)
        return {info["name"]: info for info in items}
    return sync(fs.loop, _azure_pages, fs, root, size)


def _s3_pages(fs: Any, root: str, size: int) -> dict[str, dict[str, Any]]:
    bucket, key, _ = fs.split_path(root)
    request = {"Bucket": bucket, "Prefix": key.rstrip("/") + "/" if key else "", "MaxKeys": size, **fs.req_kw}
    found: dict[str, dict[str, Any]] = {}
    while True:
        page = fs.call_s3("list_objects_v2", **request)
        for entry in page.get("Contents", []):
            name = f"{bucket}/{entry['Key']}"
            found[name] = {**entry, "Key": name, "name": name, "size": entry["Size"], "type": "file"}
        if not page.get("IsTruncated"):
            return found
        request["ContinuationToken"] = page["NextContinuationToken"]


async def _azure_pages(fs: Any, root: str, size: int) -> dict[str, dict[str, Any]]:
    container, path, _ = fs.split_path(root + "/")
    async with fs.service_client.get_container_client(container=container) as client:
        blobs = [b async for b in client.list_blobs(include=["metadata"], name_starts_with=path,
                                                    results_per_page=size)]
    return {info["name"]: info for info in await fs._details(blobs) if info.get("type") == "file"}


def _signal(info: dict[str, Any], protocol: str = "") -> str | None:
    """The backend's own version marker (ETag, generation), else size and mtime."""
    for name in SIGNAL_FIELDS_BY_PROTOCOL.get(protocol, SIGNAL_FIELDS):
        if info.get(name):
            return f"{name}:{info[name]}"
    mtime = _mtime(info)
    return f"size:{info.get('size')}:{mtime}" if mtime is not None and info.get("size") is not None else None


def _http_date(value: str) -> float | None:
    """A Last-Modified header as a timestamp (an HTTP server's mtime), or None when malformed."""
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _mtime(info: dict[str, Any]) -> float | None:
    for name in MTIME_FIELDS:
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return _http_date(info["Last-Modified"]) if isinstance(info.get("Last-Modified"), str) else None
