"""Serving a project, by concern:

- ``app``: the API app (``/v1/query``, health, the chat page), mounting the ``routers/`` (one per
  resource: collections, documents, feedback, metrics, the OpenAI surface, ingestion runs) and the
  MCP server (``mcp``);
- what the surfaces share: the query service (``query_service``), ingestion runs (``ingestion_runs``),
  the query log (``query_log``), paths never shown (``redact``), where served data lives (``layout``),
  connection limits (``connections``), ``ragline report`` (``report``);
- ``auth/``: keys, OIDC tokens, principals and scopes, the request guard;
- ``supervise/``: ``ragline serve`` itself (deployments, runner, warm flow runs, watchers, discovery).

May import everything below it (``ops``, ``run``, ``spec``, ``resources``, base); only the CLI
imports it.
"""
