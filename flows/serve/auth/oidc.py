"""OIDC/JWT bearer tokens (issue 19 item 2), verified with joserfc against one issuer's JWKS.

Refused: an algorithm outside the allowlist (``none`` and HS* can never be on it: a JWKS holds
public keys, and HS256 "signed" with a public key is the classic forgery), a token whose ``kid`` the
JWKS does not have (the JWKS is fetched again, at most every 30 s, in case the issuer rotated), a
bad signature, expired (``exp``) or not yet valid (``nbf``) beyond a small leeway, another issuer
or audience. The JWKS comes from a file (re-read when it changes) or a URL (kept 5 minutes).

The token's claims give the principal: ``sub`` its id, the groups claim its groups, the scopes
claim (a space-separated string or a list) its scopes through ``oidc_scope_map`` (without a map,
values that are ragline scope names count as themselves), the collections claim its collections.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from ragline.flows import settings
from ragline.flows.errors import ConfigError, RaglineError

SAFE_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
                             "EdDSA"})
URL_TTL_SECONDS = 300.0
REFETCH_SECONDS = 30.0  # an unknown kid fetches the JWKS again, at most this often


class OidcConfigError(ConfigError, ValueError):
    """The OIDC settings cannot work (no JWKS, no audience, an unsafe algorithm): one line."""


class TokenRefused(RaglineError):
    """Why a JWT is refused: a line for the 401 (never the token itself)."""

    http_status = 401
    error_code = "invalid_api_key"


@dataclass
class OidcConfig:
    issuer: str
    audience: str
    jwks_url: str | None = None
    jwks_file: Path | None = None
    algorithms: list[str] = field(default_factory=lambda: ["RS256", "ES256"])
    groups_claim: str = "groups"
    scopes_claim: str = "scope"
    scope_map: dict[str, list[str]] = field(default_factory=dict)
    collections_claim: str = "ragline_collections"
    default_collections: list[str] = field(default_factory=lambda: ["*"])
    leeway_seconds: int = 30

    def __post_init__(self) -> None:
        if not self.audience:
            raise OidcConfigError("RAGLINE_OIDC_AUDIENCE: set it with RAGLINE_OIDC_ISSUER (a token for another "
                                  "service must not be accepted here)")
        if not (self.jwks_url or self.jwks_file):
            raise OidcConfigError("RAGLINE_OIDC_JWKS_URL or RAGLINE_OIDC_JWKS_FILE: set one with RAGLINE_OIDC_ISSUER")
        unsafe = [a for a in self.algorithms if a not in SAFE_ALGORITHMS]
        if unsafe or not self.algorithms:
            raise OidcConfigError(f"RAGLINE_OIDC_ALGORITHMS: {', '.join(unsafe) or 'empty'} not allowed; "
                                  f"asymmetric algorithms only ({', '.join(sorted(SAFE_ALGORITHMS))})")

    @classmethod
    def from_settings(cls) -> OidcConfig | None:
        """The configuration the environment gives, None when no issuer is set."""
        issuer = settings.auth().oidc_issuer
        if not issuer:
            return None
        return cls(issuer=issuer, audience=settings.auth().oidc_audience or "",
                   jwks_url=settings.auth().oidc_jwks_url, jwks_file=settings.auth().oidc_jwks_file,
                   algorithms=list(settings.auth().oidc_algorithms), groups_claim=settings.auth().oidc_groups_claim,
                   scopes_claim=settings.auth().oidc_scopes_claim, scope_map=dict(settings.auth().oidc_scope_map),
                   collections_claim=settings.auth().oidc_collections_claim,
                   default_collections=list(settings.auth().oidc_default_collections),
                   leeway_seconds=settings.auth().oidc_leeway_seconds)


@dataclass(frozen=True)
class Identity:
    """What a verified token says about its holder."""

    subject: str
    scopes: frozenset[str]
    collections: frozenset[str]
    groups: frozenset[str]


class JwtVerifier:
    """Verifies tokens of one issuer; thread-safe (the guard calls it on worker threads)."""

    def __init__(self, config: OidcConfig, scopes: tuple[str, ...]):
        self.config, self.known_scopes = config, scopes
        self._keys: KeySet | None = None
        self._loaded_at, self._file_seen = 0.0, None
        self._lock = threading.Lock()

    def verify(self, token: str, now: float | None = None) -> Identity:
        try:
            header = json.loads(_b64(token.split(".")[0]))
        except (ValueError, IndexError):
            raise TokenRefused("malformed token") from None
        if not isinstance(header, dict):
            raise TokenRefused("malformed token")
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self.config.algorithms:
            raise TokenRefused(f"token algorithm {str(alg)[:20]!r} is not allowed "
                               f"({', '.join(self.config.algorithms)})")
        if not isinstance(kid, str) or not kid:
            raise TokenRefused("token has no key id (kid)")
        keys = self._key_set(kid)
        try:
            decoded = jwt.decode(token, keys, algorithms=self.config.algorithms)
            registry = jwt.JWTClaimsRegistry(
                now=int(now) if now is not None else None, leeway=self.config.leeway_seconds,
                iss={"essential": True, "value": self.config.issuer},
                aud={"essential": True, "value": self.config.audience},
                exp={"essential": True}, sub={"essential": True})
            registry.validate(decoded.claims)
        except JoseError as exc:
            raise TokenRefused(f"token refused: {exc.error}{': ' + exc.description if exc.description else ''}") \
                from None
        return self._identity(decoded.claims)

    def _identity(self, claims: dict[str, Any]) -> Identity:
        config = self.config
        granted: set[str] = set()
        for value in _words(claims.get(config.scopes_claim)):
            if config.scope_map:
                granted.update(config.scope_map.get(value, ()))
            elif value in self.known_scopes:
                granted.add(value)
        collections = _words(claims.get(config.collections_claim)) if config.collections_claim in claims \
            else list(config.default_collections)
        return Identity(subject=str(claims["sub"]), scopes=frozenset(granted & set(self.known_scopes)),
                        collections=frozenset(collections), groups=frozenset(_words(claims.get(config.groups_claim))))

    # -- the JWKS
    def _key_set(self, kid: str) -> KeySet:
        with self._lock:
            if self._stale():
                self._keys = self._fetch()
            if not self._has(kid) and time.monotonic() - self._loaded_at > REFETCH_SECONDS and self.config.jwks_url:
                self._keys = self._fetch()  # the issuer may have rotated its keys
            if not self._has(kid):
                raise TokenRefused(f"unknown key id {kid[:64]!r} (not in the issuer's JWKS)")
            return KeySet([k for k in self._keys.keys if k.kid == kid])

    def _has(self, kid: str) -> bool:
        return self._keys is not None and any(k.kid == kid for k in self._keys.keys)

    def _stale(self) -> bool:
        if self._keys is None:
            return True
        if self.config.jwks_file is not None:
            try:
                stat = os.stat(self.config.jwks_file)
            except OSError:
                return True
            return (stat.st_ino, stat.st_size, stat.st_mtime_ns) != self._file_seen
        return time.monotonic() - self._loaded_at > URL_TTL_SECONDS

    def _fetch(self) -> KeySet:
        import httpx

        try:
            if self.config.jwks_file is not None:
                path = Path(self.config.jwks_file)
                stat = path.stat()
                data = json.loads(path.read_bytes())
                self._file_seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            else:
                response = httpx.get(self.config.jwks_url, timeout=5.0, follow_redirects=False)
                response.raise_for_status()
                data = response.json()
            keys = KeySet.import_key_set(data)
        except (OSError, ValueError, httpx.HTTPError, JoseError) as exc:
            if self._keys is not None:  # keep the keys we had: an issuer's blip must not lock everyone out
                return self._keys
            raise TokenRefused(f"the issuer's JWKS could not be read ({type(exc).__name__})") from None
        self._loaded_at = time.monotonic()
        return keys


def _words(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [str(v) for v in value if isinstance(v, (str, int))]
    return []


def _b64(part: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def looks_like_jwt(credential: str) -> bool:
    return credential.count(".") == 2 and credential.startswith("eyJ")
