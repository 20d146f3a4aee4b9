"""API keys of one project (issue 19 item 2): ``<data dir>/.ragline/keys.json``.

A key is ``rl_<id>_<secret>``: the id finds its record, the secret (32 random bytes) proves it.
Only the secret's SHA-256 is stored: a key is high-entropy, so a fast hash cannot be brute-forced,
and the file (mode 0600, replaced atomically) never holds a usable key. The key is shown once, by
``create`` and ``rotate``; nothing lists, logs or returns it again.

Every key expires (90 days by default, a year at most): a forgotten key stops working by itself.
A running server reads the file again when its inode, size or mtime changed, so a key created,
revoked or rotated by ``ragline keys`` counts from the next request, without a restart. Writers
(two ``ragline keys create`` at once) take a lock file, so neither loses the other's key.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from filelock import FileLock
from pydantic import BaseModel, Field, ValidationError

from ragline.flows.errors import InputError
from ragline.flows.files import write_atomic
from ragline.flows.serve.auth.scopes import SCOPES

log = logging.getLogger("ragline.api")

Scope = Literal["query", "ingest", "upload", "delete", "admin"]
PREFIX = "rl_"
DEFAULT_LIFETIME = datetime.timedelta(days=90)
MAX_LIFETIME = datetime.timedelta(days=365)
_KEY = re.compile(r"^rl_([0-9a-f]{12})_([A-Za-z0-9_\-]{20,100})$")
_LIFETIME = re.compile(r"^(\d{1,4})([hdw])$")
_UNITS = {"h": "hours", "d": "days", "w": "weeks"}


class KeyStoreError(InputError):
    """A ``ragline keys`` request that cannot be done (unknown id, bad lifetime): one line."""


class ApiKey(BaseModel):
    """One key's record: everything but the secret."""

    id: str
    name: str
    hash: str = Field(description="sha256 of the secret, hex")
    scopes: list[Scope]
    collections: list[str] = Field(description="Chroma collection names, or '*' for all")
    groups: list[str] = Field(default_factory=list)
    created: datetime.datetime
    expires: datetime.datetime
    revoked: datetime.datetime | None = None
    rotated: datetime.datetime | None = None

    def status(self, now: datetime.datetime) -> str:
        return "revoked" if self.revoked else "expired" if self.expires <= now else "active"


class KeyFile(BaseModel):
    version: Literal[1] = 1
    keys: list[ApiKey] = Field(default_factory=list)


def keys_file(data_dir: str | Path) -> Path:
    """Where the keys of the project whose data dir is ``data_dir`` live."""
    return Path(data_dir) / ".ragline" / "keys.json"


def parse_lifetime(text: str) -> datetime.timedelta:
    """``90d``, ``12h``, ``4w``: at least an hour, at most a year."""
    found = _LIFETIME.match(text.strip())
    if not found:
        raise KeyStoreError(f"--expires {text!r}: a number and h, d or w (e.g. 90d)")
    lifetime = datetime.timedelta(**{_UNITS[found[2]]: int(found[1])})
    if not datetime.timedelta(hours=1) <= lifetime <= MAX_LIFETIME:
        raise KeyStoreError(f"--expires {text!r}: between 1h and {MAX_LIFETIME.days}d")
    return lifetime


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """The keys of one file: written by the CLI, read (and re-read when changed) by the server."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the file last read
        self._keys: dict[str, ApiKey] = {}
        self._error: str | None = None
        self._read_lock = threading.Lock()

    # -- reading (the server, every request: one stat)
    def _current(self) -> dict[str, ApiKey]:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._keys, self._error = None, {}, None
            return self._keys
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen != self._seen:
            with self._read_lock:
                if seen != self._seen:
                    try:
                        self._keys, self._error = {k.id: k for k in self._load().keys}, None
                    except KeyStoreError as exc:  # fail closed: no key counts until the file is repaired
                        log.error("%s", exc)
                        self._keys, self._error = {}, str(exc)
                    self._seen = seen
        return self._keys

    def _load(self) -> KeyFile:
        try:
            return KeyFile.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return KeyFile()
        except ValidationError as exc:
            first = exc.errors()[0]
            raise KeyStoreError(f"{self.path}: not a keys file ({'.'.join(map(str, first['loc']))}: {first['msg']}); "
                            f"no key is accepted until it is repaired") from None

    def configured(self) -> bool:
        """Whether the file holds any key, in any state (a server with only revoked keys still
        asks every caller for a credential)."""
        return bool(self._current()) or self._error is not None

    def authenticate(self, presented: str, now: datetime.datetime | None = None) -> ApiKey | str:
        """The key's record, or why it is refused (a line for a 401; it never repeats the secret)."""
        found = _KEY.match(presented)
        if not found:
            return "not a ragline API key"
        record = self._current().get(found[1])
        if record is None or not hmac.compare_digest(_digest(found[2]), record.hash):
            return "unknown API key"
        now = now or _now()
        if record.revoked:
            return f"API key {record.id} was revoked"
        if record.expires <= now:
            return f"API key {record.id} expired at {record.expires.isoformat()}"
        return record

    # -- writing (``ragline keys``): read, change and write under the lock
    def _change(self, change) -> tuple[ApiKey, str | None]:
        with FileLock(str(self.path) + ".lock", timeout=30):
            keys = self._load()
            result = change(keys)
            write_atomic(self.path, keys.model_dump_json(indent=2) + "\n")
        os.chmod(self.path, 0o600)
        return result

    def list(self) -> list[ApiKey]:
        return sorted(self._load().keys, key=lambda k: k.created)

    def create(self, name: str, scopes: Iterable[str], collections: Iterable[str], groups: Iterable[str] = (),
               lifetime: datetime.timedelta = DEFAULT_LIFETIME) -> tuple[ApiKey, str]:
        """A new key: its record and the key itself (shown once)."""
        scopes, collections = sorted(set(scopes)), sorted(set(collections))
        if not name.strip():
            raise KeyStoreError("--name: a key needs a name (who or what uses it)")
        if not scopes:
            raise KeyStoreError(f"--scope: give at least one of {', '.join(SCOPES)}")
        if not collections:
            raise KeyStoreError("--collection: give a collection name, or '*' for all")
        if lifetime > MAX_LIFETIME:
            raise KeyStoreError(f"--expires: at most {MAX_LIFETIME.days} days")
        secret, key_id = secrets.token_urlsafe(32), secrets.token_hex(6)
        created = _now()
        record = ApiKey(id=key_id, name=name.strip(), hash=_digest(secret), scopes=scopes, collections=collections,
                        groups=sorted(set(groups)), created=created, expires=created + lifetime)

        def add(keys: KeyFile) -> tuple[ApiKey, str]:
            keys.keys.append(record)
            return record, f"{PREFIX}{key_id}_{secret}"

        return self._change(add)

    def revoke(self, key_id: str) -> ApiKey:
        def revoke(keys: KeyFile) -> tuple[ApiKey, None]:
            record = self._find(keys, key_id)
            record.revoked = record.revoked or _now()
            return record, None

        return self._change(revoke)[0]

    def rotate(self, key_id: str, lifetime: datetime.timedelta | None = None) -> tuple[ApiKey, str]:
        """A new secret for the same id and rights; the old key is refused from now. The new one
        lives as long as the old one was made to (or ``lifetime``)."""
        secret = secrets.token_urlsafe(32)

        def rotate(keys: KeyFile) -> tuple[ApiKey, str]:
            record = self._find(keys, key_id)
            if record.revoked:
                raise KeyStoreError(f"key {key_id} is revoked: create a new one")
            now = _now()
            record.expires = now + min(lifetime or (record.expires - record.created), MAX_LIFETIME)
            record.created, record.rotated, record.hash = now, now, _digest(secret)
            return record, f"{PREFIX}{record.id}_{secret}"

        return self._change(rotate)

    @staticmethod
    def _find(keys: KeyFile, key_id: str) -> ApiKey:
        record = next((k for k in keys.keys if k.id == key_id), None)
        if record is None:
            known = ", ".join(k.id for k in keys.keys) or "none"
            raise KeyStoreError(f"no key {key_id!r}; keys: {known}")
        return record


def describe(record: ApiKey, now: datetime.datetime | None = None) -> dict:
    """A key's record for ``ragline keys list``: no hash, no secret."""
    shown = json.loads(record.model_dump_json(exclude={"hash"}))
    return {**shown, "status": record.status(now or _now())}
