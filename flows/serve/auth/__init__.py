"""Who may do what: API keys (``keys``), OIDC bearer tokens (``oidc``), the principal a credential
becomes and what it may read (``principals``, ``scopes``), and the checks made before FastAPI sees a
request (``guard``: host, origin, size, credentials)."""
