"""Where a running ``ragline api`` or ``ragline serve`` answers for a project (issue 24.5).

Why: a terminal ``ragline search`` or ``ask`` loaded the embedder (and torch) on every call, ~25 s
on a loaded machine, while a local API that has them loaded answers in milliseconds. So the API
publishes itself in ``<data dir>/.ragline/api.server.json`` (the data dir is ``--data-dir`` or
the pipelines file's folder, as for ``steps.served_copy``): host, port, pid and its start time,
the pipelines file and its digest, the tuned overlay it applied, and whether it needs a token.
The CLI uses it only when it serves the same text (the file's digest and the overlay's still
match) from a live process on this machine, and sends the token it would give the server itself
(``RAGLINE_API_TOKEN``, the place ``ragline api`` reads it from). Otherwise it runs in-process.

This module imports only the standard library: the CLI reads the file before anything heavy loads.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ragline.flows.files import write_atomic
from ragline.flows.net import is_loopback
from ragline.flows.processes import same_process, start_time

FILE = Path(".ragline") / "api.server.json"
TUNED_SUFFIX = ".tuned.yaml"  # overlay.SUFFIX


@dataclass(frozen=True)
class Service:
    url: str
    pid: int
    token_required: bool
    tuned: bool


def discovery_file(project_file: str | Path, data_dir: str | Path | None = None) -> Path:
    return Path(data_dir or Path(project_file).resolve().parent).resolve() / FILE


def digest_of(path: str | Path | None) -> str:
    """steps.digest_of: the first 16 hex digits of the file's SHA-256; "" when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else ""
    except OSError:
        return ""


def default_overlay(project_file: str | Path, data_dir: str | Path | None) -> Path:
    """overlay.overlay_path without an explicit path: ``<stem>.tuned.yaml`` in the data folder."""
    path = Path(project_file).resolve()
    return (Path(data_dir).resolve() if data_dir else path.parent) / f"{path.stem}{TUNED_SUFFIX}"


@contextlib.contextmanager
def published(project, host: str, port: int, token: str | None, data_dir: str | Path | None) -> Iterator[Path | None]:
    """Publish the API of ``project`` (a compiled ``Project``) at ``host:port`` while the block runs;
    the file is removed at the end when it is still this process's. Port 0 is not published."""
    if not port:
        yield None
        return
    overlay = getattr(project.overlay, "path", None) if project.overlay is not None else None
    target = discovery_file(project.path, data_dir)
    info = {"host": _reachable(host), "port": port, "pid": os.getpid(), "started": start_time(os.getpid()),
            "hostname": socket.gethostname(), "file": str(Path(project.path).resolve()),
            "digest": digest_of(project.path), "overlay": str(overlay) if overlay else None,
            "overlay_digest": digest_of(overlay), "token": bool(token)}
    try:
        write_atomic(target, json.dumps(info))
    except OSError:  # a read-only data folder: the API serves, the CLI runs in-process
        yield None
        return
    try:
        yield target
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(target.read_text()).get("pid") == os.getpid():
                target.unlink()


def find(project_file: str | Path, data_dir: str | Path | None = None) -> tuple[Service | None, str | None]:
    """The live API serving this very project, or (None, why not: None when there is none at all)."""
    try:
        info = json.loads(discovery_file(project_file, data_dir).read_text())
        url, pid = f"http://{info['host']}:{int(info['port'])}", int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    if info.get("hostname") != socket.gethostname() or not same_process(pid, info.get("started")):
        return None, None  # a stale file (the API was killed) or another machine's
    if not is_loopback(str(info["host"])):  # the CLI's token goes to this machine's loopback only
        return None, f"the ragline API record names {url}, not a loopback address: the token is not sent there"
    if info.get("file") != str(Path(project_file).resolve()):
        return None, None  # another pipelines file beside the same data
    if info.get("digest") != digest_of(project_file):
        return None, f"the ragline API at {url} (pid {pid}) serves another version of {Path(project_file).name}"
    overlay = info.get("overlay")
    if digest_of(overlay) != (info.get("overlay_digest") or "") or \
            (not overlay and default_overlay(project_file, data_dir).is_file()):
        return None, f"the ragline API at {url} (pid {pid}) serves an older tuned overlay"
    return Service(url, pid, bool(info.get("token")), bool(overlay)), None


def _reachable(host: str) -> str:
    """The address a local client connects to (a wildcard listens on loopback too)."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host



