"""Serving a project: the query service shared by every HTTP surface (``query_service``), the API
app (``api``: ``/v1/query``, health, the chat page), the OpenAI surface (``openai_api``),
ingestion runs over HTTP (``runs``), the request guard and connection limits (``guard``,
``connections``), who may do what (``principals``: API keys in ``keys``, JWTs in ``oidc``), paths never shown (``redact``), where served data lives (``layout``) and
``ragline serve`` itself (``service``).

May import everything below it (``ops``, ``run``, ``spec``, ``resources``, base); only the CLI
imports it.
"""
