"""What an API credential may do: the scopes of keys and OIDC tokens. A module of its own so the
`ragline keys` parser names them without importing the key store."""
from __future__ import annotations

SCOPES: tuple[str, ...] = ("query", "ingest", "upload", "delete", "admin")
