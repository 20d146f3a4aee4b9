"""Every ``RAGLINE_*`` setting in one pydantic-settings model: the only module that reads them.

Why: the variables were read in fourteen modules, each with its own parsing ("0/false/no/off"
three times); one model gives each a type, a default, a description (docs/configuration.md's
table is made from it: ``python -m ragline.flows.settings --doc docs/configuration.md``) and one
error naming the variable. Settings are read when asked for (``current()``), not frozen at
import: a test, or ``ragline --no-tuned``, changes the environment and the next read sees it.
``[tool.ragline]`` of a project's pyproject.toml is read by ``pyproject_table`` (what it may set:
``allow_modules``).

Variables of other tools (``PREFECT_*``, ``HF_*``, ``OMP_*``) and those a pipelines file names
itself (``${RAGLINE_LLM_BASE_URL}``, ``token_env``) are not settings of ragline's and are read where used.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, NoDecode, PyprojectTomlConfigSettingsSource, SettingsConfigDict

from ragline.flows.errors import ConfigError

PREFIX = "RAGLINE_"
FALSE_WORDS = ("0", "false", "no", "off")
TABLE_START, TABLE_END = "<!-- settings:start -->", "<!-- settings:end -->"


def flag(value: Any) -> bool:
    """An on/off setting: off only for 0, false, no or off (any case); anything else set is on."""
    return value if isinstance(value, bool) else str(value).strip().lower() not in FALSE_WORDS


def _names(value: Any) -> Any:
    return [m.strip() for m in value.split(",") if m.strip()] if isinstance(value, str) else value


Flag = Annotated[bool, BeforeValidator(flag)]
Names = Annotated[list[str], NoDecode, BeforeValidator(_names)]


class RaglineSettings(BaseSettings):
    """ragline's settings, from ``RAGLINE_<NAME>`` (an empty variable counts as unset)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="ignore")

    home: Path = Field(Path("~/.ragline"), description="ragline's own state: the local Prefect server's "
                                                       "database and logs")
    prefect_idle_seconds: float = Field(600.0, ge=0, description="the local Prefect API that commands start when "
                                        "no `PREFECT_API_URL` is set is kept for the next command and stops after "
                                        "this long unused; 0: each command starts its own and stops it on exit")
    cache_dir: Path = Field(Path("~/.cache/ragline"), description="model exports (ONNX embedders)")
    onnx_queries: Flag = Field(True, description="encode queries with the embedder's ONNX export in onnxruntime, "
                               "without importing torch, where the model has one (0: always the embedder's own backend)")
    tuned: Flag = Field(True, description="apply the overlay `ragline tune` wrote beside the data "
                                          "(0, false, no or off: ignore it; `--no-tuned` sets it)")
    allow_modules: Names = Field(default_factory=list, description="modules user stages may come from, "
                                 "comma-separated (adds to `[tool.ragline] allow_modules` of pyproject.toml)")
    api_token: str | None = Field(None, repr=False, description="the bearer token of `ragline api` and "
                                                               "`ragline serve`, admin on every collection "
                                                               "(off loopback: it, API keys or an OIDC issuer)")
    oidc_issuer: str | None = Field(None, description="accept OIDC/JWT bearer tokens of this issuer (`iss`) on the "
                                                      "API, beside API keys (`ragline keys`); unset: no JWTs")
    oidc_audience: str | None = Field(None, description="the `aud` a JWT must carry (required with the issuer)")
    oidc_jwks_url: str | None = Field(None, description="the issuer's JWKS URL (kept 5 minutes; fetched again "
                                                        "for an unknown `kid`)")
    oidc_jwks_file: Path | None = Field(None, description="the issuer's JWKS as a file (re-read when it changes), "
                                                          "instead of the URL")
    oidc_algorithms: Names = Field(default_factory=lambda: ["RS256", "ES256"], description="JWT algorithms "
                                   "accepted, comma-separated; asymmetric only (`none` and HS* are refused)")
    oidc_groups_claim: str = Field("groups", description="the JWT claim holding the caller's groups")
    oidc_scopes_claim: str = Field("scope", description="the JWT claim holding the caller's scopes (space-separated "
                                                        "or a list)")
    oidc_scope_map: dict[str, list[str]] = Field(
        default_factory=dict, description="JSON: a value of the scopes claim -> ragline scopes, e.g. "
                                          '`{"rag.read": ["query"]}`; unset: values named query, ingest, upload, '
                                          "delete or admin count as themselves")
    oidc_collections_claim: str = Field("ragline_collections", description="the JWT claim listing the collections "
                                                                            "the caller may use")
    oidc_default_collections: Names = Field(default_factory=lambda: ["*"], description="collections of a JWT "
                                            "without that claim, comma-separated (`*`: all; scopes still apply)")
    oidc_leeway_seconds: int = Field(30, ge=0, le=300, description="clock skew allowed on a JWT's `exp` and `nbf`")
    header_timeout_seconds: float = Field(10.0, gt=0, description="for a request line and headers to arrive")
    body_timeout_seconds: float = Field(30.0, gt=0, description="for a whole body to arrive after its headers")
    max_connections: int = Field(1000, ge=1, description="open sockets at most (lowered to fit the fd limit)")
    keep_alive_seconds: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    start_llm: Flag = Field(True, description="start the packaged LLM on vLLM for a local endpoint that is down "
                                              "(`ragline quickstart`, `ragline serve`)")
    vllm_deploy: Path | None = Field(None, description="the folder with vLLM's setup.sh and serve.sh "
                                                       "(default: deploy/vllm of the checkout)")
    document_max_member_bytes: int = Field(64_000_000, ge=1, description="one member of a DOCX, PPTX, XLSX, ODT "
                                           "or EPUB package (or any zip-based format), or one PDF stream, may inflate "
                                           "to this many bytes; a document with a larger one is skipped with the "
                                           "member's name, before any parser reads it")
    document_max_expanded_bytes: int = Field(256_000_000, ge=1, description="the members of one package together "
                                             "may inflate to this many bytes (else the document is skipped)")
    document_max_expansion_ratio: float = Field(100.0, gt=1, description="a member, or a package as a whole, "
                                                "inflating to over 1 MB may inflate at most this many times its "
                                                "compressed size (a zip bomb: skipped with the member's name)")
    document_max_chars: int = Field(16_000_000, ge=1, description="characters of text one document may have "
                                    "(what bounds a document's memory through convert and chunk): a longer one is "
                                    "skipped with the reason, checked while it is converted")
    document_max_seconds: float = Field(300.0, gt=0, description="seconds one file may take to be read and "
                                        "converted (checked between pages, slides, paragraphs, rows), and one "
                                        "document to be chunked (checked between chunks); past it the document is "
                                        "skipped with the reason and the run goes on")
    mcp_search_pipeline: str = Field("search", description="the query pipeline the MCP `search` tool runs when the "
                                     "call names none (`ragline mcp`, `/mcp`): one that returns passages")
    mcp_ask_pipeline: str = Field("ask", description="the query pipeline the MCP `ask` tool runs when the call names "
                                  "none: one that answers (`ask_extractive` needs no LLM)")
    failpoints: str = Field("", description="crash-safety tests only: `name[:n],...` kills the process the n-th "
                                            "time it reaches a named point")
    metrics: Flag = Field(True, description="record Prometheus metrics and serve them at `/metrics` of the API "
                                            "(0, false, no or off: neither)")
    metrics_public: Flag = Field(False, description="`/metrics` answers without the bearer token (for a scraper "
                                                    "that cannot send one); off: the token of `/v1` is needed")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint traces are exported to, e.g. "
                                                        "http://collector:4318 (`/v1/traces` is appended); unset: "
                                                        "`OTEL_EXPORTER_OTLP_ENDPOINT`, and without either no traces")
    trace_content: Flag = Field(False, description="put question, prompt and answer text on trace spans "
                                                   "(off: sizes, ids, scores and timings only)")
    query_log: Flag = Field(False, description="write one JSON line per served query (answer id, pipeline, retrieved "
                                               "ids and scores, citations, verification, latency) to "
                                               "`<data dir>/.ragline/query-log/queries.jsonl`, off the event loop")
    query_log_text: Flag = Field(True, description="put question, rewritten queries, answer text and feedback "
                                                   "comments in the query log and feedback file (off: ids, scores "
                                                   "and outcomes only)")
    query_log_max_mb: float = Field(100.0, gt=0, description="the query log's files together stay under this many "
                                                             "MB (rotated by size; the oldest file goes)")
    query_log_retention_days: float = Field(30.0, gt=0, description="query log entries older than this are "
                                                                    "deleted (within 1/30 of it)")
    feedback_max_mb: float = Field(50.0, gt=0, description="`POST /v1/feedback`'s files together stay under this "
                                                           "many MB (rotated by size; the oldest file goes)")
    triggered_groups: Names = Field(default_factory=list, description="groups whose documents a query run "
                                    "triggered through a Prefect deployment may read besides public ones (it has "
                                    "no principal; comma-separated); `*`: every document. Unset: public only")
    serve_jobs: Flag = Field(False, description="`ragline serve` deploys job pipelines (tune, adapt, summarize) that "
                                                "declare no schedule (`--serve-jobs`); off: only scheduled jobs are "
                                                "deployed, so the Prefect API cannot start one")
    event_documents: Flag = Field(False, description="Prefect query events name the principal and the ids of the "
                                                     "documents returned (an audit trail readable by every client of "
                                                     "the Prefect API); off: counts only")
    refused_parameters: Names = Field(default_factory=list, description="set by `ragline serve` for a flow run "
                                      "started with top-level parameters the flow does not take: their names "
                                      "(the run ends Failed naming them)")
    served_deployments: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="set by `ragline serve` for its flow runs: what each deployment was "
                                          "created with (JSON)")


_parsed: dict[str, tuple[str, Any]] = {}  # field -> (its variable's text, the value read from it)


def get(field: str) -> Any:
    """One setting: its default without building the model when its variable is unset (a
    failpoint is checked on hot paths), else as ``current()`` reads it, once per text of the
    variable (metrics and traces ask on every request: building the model costs ~1 ms)."""
    raw = os.environ.get(env_name(field))
    if not raw:
        info = RaglineSettings.model_fields[field]
        return info.default if info.default_factory is None else info.get_default(call_default_factory=True)
    known = _parsed.get(field)
    if known is not None and known[0] == raw:
        return known[1]
    value = getattr(current(), field)
    if value is None or isinstance(value, (bool, int, float, str, Path)):  # a list or dict could be changed
        _parsed[field] = (raw, value)
    return value


def export(field: str, value: str | None) -> None:
    """Set (None: unset) a setting for this process and the ones it starts (flow runs, workers)."""
    if value is None:
        os.environ.pop(env_name(field), None)
    else:
        os.environ[env_name(field)] = value


def current() -> RaglineSettings:
    """The settings as the environment says now; a bad value is a ConfigError naming its variable."""
    try:
        return RaglineSettings()
    except ValidationError as exc:
        problems = "; ".join(f"{PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors())
        raise SettingsError(problems, field=f"{PREFIX}{str(exc.errors()[0]['loc'][0]).upper()}") from None


class SettingsError(ConfigError, ValueError):
    """An environment variable ragline cannot use; the message names it."""


def env_name(field: str) -> str:
    return PREFIX + field.upper()


class _ToolTable(BaseSettings):
    model_config = SettingsConfigDict(pyproject_toml_table_header=("tool", "ragline"))


def pyproject_table(pyproject: Path) -> dict[str, Any] | None:
    """``[tool.ragline]`` of one pyproject.toml, unvalidated (its reader reports problems with
    lines); None when ``tool.ragline`` is there but not a table."""
    try:
        return PyprojectTomlConfigSettingsSource(_ToolTable, toml_file=pyproject).toml_data
    except (AttributeError, TypeError):  # pydantic-settings takes the table for a mapping
        return None


# ----------------------------------------------------------------------------- the docs' table
def settings_table() -> str:
    """Every setting as a Markdown table: variable, default, what it does."""
    rows = ["| Variable | Default | What it sets |", "|---|---|---|"]
    for name, info in RaglineSettings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = "unset" if default in (None, "", [], {}) else ("1" if default is True else str(default))
        rows.append(f"| `{env_name(name)}` | {shown} | {info.description} |")
    return "\n".join(rows)


def with_table(page: str) -> str:
    """A page's text (docs/configuration.md) with its settings table (between the markers) regenerated."""
    start, end = page.index(TABLE_START) + len(TABLE_START), page.index(TABLE_END)
    return page[:start] + "\n" + settings_table() + "\n" + page[end:]


if __name__ == "__main__":  # python -m ragline.flows.settings [--doc docs/configuration.md]
    if sys.argv[1:2] in (["--doc"], ["--readme"]):  # --readme: its name from when the table was in the README
        path = Path(sys.argv[2])
        path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(settings_table())
