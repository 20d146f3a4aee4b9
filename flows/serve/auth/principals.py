"""Who sends a request, and what they may do (issue 19 item 2).

The guard (``api.Guard``) turns the request's credential into a ``Principal`` and puts it on the
request (``principal_of(request)``); every route then asks ``require`` for a scope on the
collections its pipeline reads or writes. Credentials, in the order tried:

- the legacy ``RAGLINE_API_TOKEN``: ``admin`` on every collection (as before: it could do everything);
- an API key ``rl_<id>_<secret>`` (``ragline keys``, ``keys.KeyStore``): its scopes, collections, groups;
- an OIDC/JWT bearer token when ``RAGLINE_OIDC_ISSUER`` is set (``oidc.JwtVerifier``).

With none of them configured the API answers on loopback only, to a ``local`` principal that is
``admin`` on every collection (unchanged). Once any is configured (a keys file with any key in it
counts, even revoked ones), every protected route needs a credential.

A "collection" is a Chroma collection name: those of the ``chroma`` resources a pipeline uses, plus,
for a BM25 or index-state resource, the collection of the index it belongs to (so a BM25-only
pipeline over collection B is B's). ``admin`` implies every other scope. A named collection
(pipelines.yaml ``collections``) is the Chroma collection of its name; a query pipeline over several
searches those a request names, by default all the principal may query (``query_collections``).
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ragline.flows.contracts import PipelineKind
from ragline.flows.run.check import indexes
from ragline.flows.serve.auth.keys import SCOPES, KeyStore, keys_file
from ragline.flows.serve.auth.oidc import JwtVerifier, OidcConfig, TokenRefused, looks_like_jwt
from ragline.flows.serve.query_service import ApiError, access_for

ALL = "*"
Kind = Literal["key", "jwt", "legacy-token", "local"]


@dataclass(frozen=True)
class Principal:
    """The caller of one request. ``groups`` is what document-level ACLs read."""

    id: str
    kind: Kind
    scopes: frozenset[str]
    collections: frozenset[str]  # Chroma collection names, or "*"
    groups: frozenset[str] = field(default_factory=frozenset)
    name: str = ""

    def may(self, scope: str, collections: Iterable[str] = ()) -> bool:
        return self.missing(scope, collections) is None

    def missing(self, scope: str, collections: Iterable[str] = ()) -> str | None:
        """What ``scope`` on ``collections`` lacks, in words (None: nothing): the scope on all of
        them, or the scope on the collections not granted."""
        wanted = sorted(set(collections))
        if scope not in self.scopes and "admin" not in self.scopes:
            lacking = wanted
        elif ALL in self.collections:
            return None
        else:
            lacking = [c for c in wanted if c not in self.collections]
            if not lacking:
                return None
        on = f" on collection{'s' if len(lacking) > 1 else ''} {', '.join(repr(c) for c in lacking)}" if lacking else ""
        return f"scope '{scope}'{on}"


LOCAL = Principal(id="local", kind="local", scopes=frozenset({"admin"}), collections=frozenset({ALL}))
LEGACY = Principal(id="legacy-token", kind="legacy-token", scopes=frozenset({"admin"}), collections=frozenset({ALL}))


def principal_of(request: Any) -> Principal:
    """The principal the guard authenticated for this request (a Starlette ``Request``). A route
    reached without the guard has none: refused, never treated as anyone."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise ApiError(401, "no credential: send `Authorization: Bearer <key or token>`", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return principal


def collections_of(pipeline: Any, fanned_out: bool = True) -> frozenset[str]:
    """The Chroma collections a compiled pipeline reads (query) or writes (ingestion); without
    ``fanned_out``, only those of its steps that do not search named collections (e.g. FLARE's store)."""
    project = pipeline.project
    specs = project.spec.resources
    tied: dict[str, set[str]] = {}  # a BM25 / index-state resource -> the store of its index
    for index in indexes(project):
        for member in (index.sparse, index.state):
            if member:
                tied.setdefault(member, set()).add(index.store)
    # a template's index is never written once collections exist: a stage bound to it (FLARE's store)
    # reads the collections the query searches instead (tasks.collection_index), checked as those
    templated = {resource for c in project.collections.values() for resource in c.resources}
    found = set()
    for step in pipeline.steps if fanned_out else [s for s in pipeline.steps if not s.collections]:
        for name in {n for bound in (step.collections.values() or [step.resources]) for n in bound.values()} \
                - templated:
            for resource in {name, *tied.get(name, ())}:
                spec = specs.get(resource)
                if spec is not None and spec.type in ("chroma", "milvus"):
                    found.add(spec.collection)
    return frozenset(found)


def require(request: Any, scope: str, pipeline: Any) -> Principal:
    """The request's principal, or a 403 ``forbidden`` naming what it lacks on ``pipeline``."""
    principal = principal_of(request)
    missing = principal.missing(scope, collections_of(pipeline))
    if missing:
        raise ApiError(403, f"forbidden: this credential lacks {missing} (pipeline '{pipeline.name}')",
                       "permission_error", code="forbidden")
    return principal


def query_collections(request: Any, pipeline: Any, requested: list[str] | None) -> tuple[Principal, list[str] | None]:
    """The request's principal and the named collections its query searches (None: the pipeline
    searches none, it is checked as a whole by ``require``): those ``requested`` (400 for a name
    the pipeline does not search, 403 naming one it may not query), by default all it may query
    (403 when none)."""
    known = pipeline.collections
    if not known:
        if requested is not None:
            raise ApiError(400, f"field 'collections': pipeline '{pipeline.name}' searches no named collections "
                                f"(pipelines.yaml declares none)", param="collections")
        return require(request, "query", pipeline), None
    principal = principal_of(request)
    missing = principal.missing("query", collections_of(pipeline, fanned_out=False))
    if missing:  # a step that reads one index whatever the request names (FLARE's store, say)
        raise ApiError(403, f"forbidden: this credential lacks {missing} (pipeline '{pipeline.name}')",
                       "permission_error", code="forbidden")
    if requested is not None:
        unknown = [name for name in requested if name not in known]
        if unknown:
            raise ApiError(400, f"field 'collections': unknown collection {', '.join(repr(n) for n in unknown)}; "
                                f"pipeline '{pipeline.name}' searches {', '.join(known)}", param="collections")
        missing = principal.missing("query", requested)
        if missing:
            raise ApiError(403, f"forbidden: this credential lacks {missing} (pipeline '{pipeline.name}')",
                           "permission_error", code="forbidden")
        return principal, list(dict.fromkeys(requested))
    readable = [name for name in known if principal.may("query", [name])]
    if not readable:
        raise ApiError(403, f"forbidden: this credential lacks {principal.missing('query', known)} (pipeline "
                            f"'{pipeline.name}')", "permission_error", code="forbidden")
    return principal, readable


def scope_query(request: Any, pipeline: Any, query: dict[str, Any], requested: list[str] | None) -> Principal:
    """The request's principal, with what it may read set on ``query``: its document access and the
    named collections it searches (``query_collections``). Every surface that runs a query (``/v1/query``,
    the OpenAI route, MCP) scopes it here, and only here: a body can never carry ``access``."""
    principal, searched = query_collections(request, pipeline, requested)
    query["access"] = access_for(reading_groups(principal))
    if searched is not None:
        query["collections"] = searched  # what was asked, within what the principal may query
    return principal


def may_query(principal: Principal, pipeline: Any) -> bool:
    """Whether a principal may query ``pipeline`` at all: one of its named collections, or all it reads."""
    if pipeline.collections:
        return any(principal.may("query", [name]) for name in pipeline.collections) and \
            principal.may("query", collections_of(pipeline, fanned_out=False))
    return principal.may("query", collections_of(pipeline))


def may_read(principal: Principal, pipeline: Any) -> bool:
    """Whether a principal may see what ``pipeline`` reads or writes (its documents, its runs): the
    query scope, or for an ingestion pipeline the ingest scope too (who started a run may follow it)."""
    collections = collections_of(pipeline)
    return principal.may("query", collections) or \
        (pipeline.kind == PipelineKind.INGESTION and principal.may("ingest", collections))


# ----------------------------------------------------------------------------- authentication
@dataclass
class Verdict:
    """What the guard learnt from a request's credential."""

    principal: Principal | None
    refusal: str | None = None  # why a credential that was sent is refused
    required: bool = True  # False: nothing is configured, every (loopback) caller is local


class Authenticator:
    """Legacy token, API keys and JWTs of one server."""

    def __init__(self, token: str | None, data_dir: str | Path | None, oidc: OidcConfig | None = None):
        self._expected = hashlib.sha256(f"Bearer {token}".encode()).digest() if token else None
        self.keys = KeyStore(keys_file(data_dir)) if data_dir is not None else None
        self.jwt = JwtVerifier(oidc, SCOPES) if oidc is not None else None

    def required(self) -> bool:
        """Whether callers must bring a credential (else: loopback only, and every caller is local)."""
        return self._expected is not None or self.jwt is not None or (self.keys is not None and self.keys.configured())

    def needs_thread(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A JWT may need its issuer's JWKS fetched: verified off the event loop."""
        return self.jwt is not None and looks_like_jwt(_bearer(headers))

    def authenticate(self, headers: list[tuple[bytes, bytes]]) -> Verdict:
        if not self.required():
            return Verdict(LOCAL, required=False)
        given = next((v for k, v in headers if k == b"authorization"), None)
        if given is None:
            return Verdict(None)
        if self._expected is not None and hmac.compare_digest(hashlib.sha256(given).digest(), self._expected):
            return Verdict(LEGACY)
        credential = _bearer(headers)
        if self.keys is not None and credential.startswith("rl_"):
            record = self.keys.authenticate(credential)
            if isinstance(record, str):
                return Verdict(None, record)
            return Verdict(Principal(id=f"key:{record.id}", kind="key", scopes=frozenset(record.scopes),
                                     collections=frozenset(record.collections), groups=frozenset(record.groups),
                                     name=record.name))
        if self.jwt is not None and looks_like_jwt(credential):
            try:
                identity = self.jwt.verify(credential)
            except TokenRefused as exc:
                return Verdict(None, str(exc))
            return Verdict(Principal(id=f"jwt:{identity.subject}", kind="jwt", scopes=identity.scopes,
                                     collections=identity.collections, groups=identity.groups))
        return Verdict(None)  # the same 401 as no credential: nothing told about what was sent


def _bearer(headers: list[tuple[bytes, bytes]]) -> str:
    value = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
    scheme, _, credential = value.partition(" ")
    return credential.strip() if scheme.lower() == "bearer" else ""


def reading_groups(principal: Principal) -> frozenset[str] | None:
    """The groups whose documents a principal reads besides public ones (``Query.access``); None
    reads every document. The legacy token and the loopback user are the operator, as before
    keys existed; a key or a token reads what its groups may, whatever its scopes (admin
    manages keys and runs, it does not widen reading)."""
    return None if principal.kind in ("legacy-token", "local") else principal.groups
