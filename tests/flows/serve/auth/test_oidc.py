"""OIDC/JWT bearer tokens (issue 19 item 2): keys made here, the JWKS from a file and from a real
local HTTP server; every forgery and mismatch refused."""
from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import time
from collections.abc import Iterator

import pytest
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, RSAKey

from ragline.flows.serve.auth.keys import SCOPES
from ragline.flows.serve.auth.oidc import JwtVerifier, OidcConfig, OidcConfigError, TokenRefused
from tests.helpers.net import serve_in_thread

ISSUER, AUDIENCE = "https://idp.example", "ragline-api"


@pytest.fixture(scope="module")
def rsa() -> RSAKey:
    return RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})


@pytest.fixture(scope="module")
def ec() -> ECKey:
    return ECKey.generate_key("P-256", parameters={"kid": "ec-1"})


def jwks(*keys) -> dict:
    return KeySet(list(keys)).as_dict(private=False)


@pytest.fixture
def jwks_file(tmp_path, rsa, ec):
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks(rsa, ec)))
    return path


@pytest.fixture
def verifier(jwks_file) -> JwtVerifier:
    return JwtVerifier(OidcConfig(issuer=ISSUER, audience=AUDIENCE, jwks_file=jwks_file), SCOPES)


def claims(**changes) -> dict:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300,
            "scope": "query upload openid", "groups": ["hr", "legal"], "ragline_collections": ["alpha"]}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def sign(key, alg: str = "RS256", kid: str | None = "rsa-1", **changes) -> str:
    header = {"alg": alg, **({"kid": kid} if kid else {})}
    return jwt.encode(header, claims(**changes), key, algorithms=[alg])


def test_a_valid_token_gives_its_subject_scopes_groups_and_collections(verifier, rsa, ec):
    identity = verifier.verify(sign(rsa))
    assert identity.subject == "alice" and identity.scopes == {"query", "upload"}
    assert identity.groups == {"hr", "legal"} and identity.collections == {"alpha"}
    assert verifier.verify(sign(ec, "ES256", "ec-1")).subject == "alice"


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_alg_none_is_refused(verifier):
    unsigned = f"{_b64({'alg': 'none', 'kid': 'rsa-1'})}.{_b64(claims())}."
    with pytest.raises(TokenRefused, match="'none' is not allowed"):
        verifier.verify(unsigned)


def hs256_with_public_key(rsa) -> str:
    """The classic forgery, by hand (joserfc itself refuses a public key as an HMAC secret)."""
    signing_input = f"{_b64({'alg': 'HS256', 'kid': 'rsa-1', 'typ': 'JWT'})}.{_b64(claims(scope='admin'))}"
    mac = hmac.new(rsa.as_pem(private=False), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def test_hs256_signed_with_the_public_key_is_refused(verifier, rsa):
    forged = hs256_with_public_key(rsa)
    with pytest.raises(TokenRefused, match="'HS256' is not allowed"):
        verifier.verify(forged)
    with pytest.raises(OidcConfigError, match="HS256"):
        OidcConfig(issuer=ISSUER, audience=AUDIENCE, jwks_url="http://x", algorithms=["RS256", "HS256"])


@pytest.mark.parametrize("changes, reason", [  # times relative to the test's run, not to its collection
    ({"exp": -120}, "expired"),
    ({"nbf": 600}, "not yet valid"),
    ({"iss": "https://evil.example"}, "iss"),
    ({"aud": "another-api"}, "aud"),
    ({"exp": None}, "exp"),
])
def test_expired_early_or_foreign_tokens_are_refused(verifier, rsa, changes, reason):
    now = int(time.time())
    changes = {k: now + v if k in ("exp", "nbf") and v is not None else v for k, v in changes.items()}
    with pytest.raises(TokenRefused, match=reason):
        verifier.verify(sign(rsa, **changes))


def test_unknown_kid_and_bad_signatures_are_refused(verifier, rsa):
    stranger = RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})
    with pytest.raises(TokenRefused, match="unknown key id 'rsa-9'"):
        verifier.verify(sign(rsa, kid="rsa-9"))
    with pytest.raises(TokenRefused, match="no key id"):
        verifier.verify(sign(rsa, kid=None))
    with pytest.raises(TokenRefused, match="signature"):
        verifier.verify(sign(stranger))  # the issuer's kid, another key
    token = sign(rsa)
    head, body, signature = token.split(".")
    with pytest.raises(TokenRefused):
        verifier.verify(f"{head}.{_b64(claims(scope='admin'))}.{signature}")


def test_the_scope_map_translates_the_issuers_values(jwks_file, rsa):
    config = OidcConfig(issuer=ISSUER, audience=AUDIENCE, jwks_file=jwks_file,
                        scope_map={"rag.read": ["query"], "rag.admin": ["admin"]}, default_collections=[])
    identity = JwtVerifier(config, SCOPES).verify(sign(rsa, scope="rag.read query", ragline_collections=None))
    assert identity.scopes == {"query"} and identity.collections == frozenset()


class _Jwks(http.server.BaseHTTPRequestHandler):
    body = b"{}"
    hits = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args):
        pass


@pytest.fixture
def jwks_server() -> Iterator[tuple[str, type[_Jwks]]]:
    handler = type("Handler", (_Jwks,), {"hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve_in_thread(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/jwks.json", handler
    finally:
        server.shutdown()
        server.server_close()


def test_the_jwks_from_a_url_is_fetched_once_and_again_for_a_rotated_key(jwks_server, rsa, monkeypatch):
    url, handler = jwks_server
    handler.body = json.dumps(jwks(rsa)).encode()
    verifier = JwtVerifier(OidcConfig(issuer=ISSUER, audience=AUDIENCE, jwks_url=url), SCOPES)
    assert verifier.verify(sign(rsa)).subject == "alice"
    assert verifier.verify(sign(rsa, sub="bob")).subject == "bob"
    assert handler.hits == 1
    rotated = RSAKey.generate_key(2048, parameters={"kid": "rsa-2"})
    handler.body = json.dumps(jwks(rsa, rotated)).encode()
    monkeypatch.setattr("ragline.flows.serve.auth.oidc.REFETCH_SECONDS", 0.0)
    assert verifier.verify(sign(rotated, kid="rsa-2")).subject == "alice"
    assert handler.hits == 2
