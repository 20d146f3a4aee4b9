"""Every ``RAGLINE_*`` setting, in pydantic-settings models by area (``project``, ``prefect``, ``llm``,
``documents``, ``auth``, ``connections``, ``mcp``, ``telemetry``, ``query_log``, ``serve``), read by
attribute (``settings.auth().api_token``): the only module that reads them. The variables keep their
flat names (``RAGLINE_API_TOKEN``); each field name is one setting's, whatever its area.

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
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
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
AreaT = TypeVar("AreaT", bound="_Area")


class _Area(BaseSettings):
    """One area of the settings, each field read from ``RAGLINE_<NAME>`` (an empty variable counts as
    unset): flat variable names, read by attribute in groups (``settings.auth().api_token``)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="ignore", frozen=True)


class ConnectionFields(BaseModel):
    """The API's connection limits a user sets (``serve.connections.ConnectionLimits`` adds the rest)."""

    header_timeout_seconds: float = Field(10.0, gt=0, description="for a request line and headers to arrive")
    body_timeout_seconds: float = Field(30.0, gt=0, description="for a whole body to arrive after its headers")
    max_connections: int = Field(1000, ge=1, description="open sockets at most (lowered to fit the fd limit)")
    keep_alive_seconds: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")


class ProjectRunSettings(_Area):
    """How a project is read and run: its tuned overlay, the modules its stages may come from, model exports."""

    tuned: Flag = Field(True, description="apply the overlay `ragline tune` wrote beside the data "
                                          "(0, false, no or off: ignore it; `--no-tuned` sets it)")
    allow_modules: Names = Field(default_factory=list, description="modules user stages may come from, "
                                 "comma-separated (adds to `[tool.ragline] allow_modules` of pyproject.toml)")
    cache_dir: Path = Field(Path("~/.cache/ragline"), description="model exports (ONNX embedders)")
    onnx_queries: Flag = Field(True, description="encode queries with the embedder's ONNX export in onnxruntime, "
                               "without importing torch, where the model has one (0: always the embedder's own "
                               "backend)")
    failpoints: str = Field("", description="crash-safety tests only: `name[:n],...` kills the process the n-th "
                                            "time it reaches a named point")


class PrefectSettings(_Area):
    """ragline's own Prefect API, started by commands when none is configured."""

    home: Path = Field(Path("~/.ragline"), description="ragline's own state: the local Prefect server's "
                                                       "database and logs")
    prefect_idle_seconds: float = Field(600.0, ge=0, description="the local Prefect API that commands start when "
                                        "no `PREFECT_API_URL` is set is kept for the next command and stops after "
                                        "this long unused; 0: each command starts its own and stops it on exit")


class LlmSettings(_Area):
    """The packaged LLM that commands start when a local endpoint is down."""

    start_llm: Flag = Field(True, description="start the packaged LLM on vLLM for a local endpoint that is down "
                                              "(`ragline quickstart`, `ragline serve`)")
    vllm_deploy: Path | None = Field(None, description="the folder with vLLM's setup.sh and serve.sh "
                                                       "(default: deploy/vllm of the checkout)")


class DocumentLimits(_Area):
    """What one document may cost to read: archive members, expansion, text, time."""

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


class AuthSettings(_Area):
    """Who may call the API: its token and the OIDC issuer whose tokens it accepts."""

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


class ConnectionSettings(_Area, ConnectionFields):
    """The API's sockets: slow and half-sent requests bounded, connections capped."""


class McpSettings(_Area):
    """The MCP tools' default pipelines."""

    mcp_search_pipeline: str = Field("search", description="the query pipeline the MCP `search` tool runs when the "
                                     "call names none (`ragline mcp`, `/mcp`): one that returns passages")
    mcp_ask_pipeline: str = Field("ask", description="the query pipeline the MCP `ask` tool runs when the call names "
                                  "none: one that answers (`ask_extractive` needs no LLM)")


class TelemetrySettings(_Area):
    """Metrics, traces and Prefect events: what is recorded and who may read it."""

    metrics: Flag = Field(True, description="record Prometheus metrics and serve them at `/metrics` of the API "
                                            "(0, false, no or off: neither)")
    metrics_public: Flag = Field(False, description="`/metrics` answers without the bearer token (for a scraper "
                                                    "that cannot send one); off: the token of `/v1` is needed")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint traces are exported to, e.g. "
                                                        "http://collector:4318 (`/v1/traces` is appended); unset: "
                                                        "`OTEL_EXPORTER_OTLP_ENDPOINT`, and without either no traces")
    trace_content: Flag = Field(False, description="put question, prompt and answer text on trace spans "
                                                   "(off: sizes, ids, scores and timings only)")
    event_documents: Flag = Field(False, description="Prefect query events name the principal and the ids of the "
                                                     "documents returned (an audit trail readable by every client of "
                                                     "the Prefect API); off: counts only")


class QueryLogSettings(_Area):
    """The served queries' log and the feedback files: on or off, text or not, bounded."""

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


class ServeSettings(_Area):
    """`ragline serve` and the flow runs it starts."""

    serve_jobs: Flag = Field(False, description="`ragline serve` deploys job pipelines (tune, adapt, summarize) that "
                                                "declare no schedule (`--serve-jobs`); off: only scheduled jobs are "
                                                "deployed, so the Prefect API cannot start one")
    triggered_groups: Names = Field(default_factory=list, description="groups whose documents a query run "
                                    "triggered through a Prefect deployment may read besides public ones (it has "
                                    "no principal; comma-separated); `*`: every document. Unset: public only")
    refused_parameters: Names = Field(default_factory=list, description="set by `ragline serve` for a flow run "
                                      "started with top-level parameters the flow does not take: their names "
                                      "(the run ends Failed naming them)")
    served_deployments: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="set by `ragline serve` for its flow runs: what each deployment was "
                                          "created with (JSON)")


AREAS: dict[str, type[_Area]] = {
    "project": ProjectRunSettings,
    "prefect": PrefectSettings,
    "llm": LlmSettings,
    "documents": DocumentLimits,
    "auth": AuthSettings,
    "connections": ConnectionSettings,
    "mcp": McpSettings,
    "telemetry": TelemetrySettings,
    "query_log": QueryLogSettings,
    "serve": ServeSettings,
}


class RaglineSettings(BaseModel):
    """Every setting, by area, as the environment said when it was read (``current()``)."""

    project: ProjectRunSettings
    prefect: PrefectSettings
    llm: LlmSettings
    documents: DocumentLimits
    auth: AuthSettings
    connections: ConnectionSettings
    mcp: McpSettings
    telemetry: TelemetrySettings
    query_log: QueryLogSettings
    serve: ServeSettings


def project() -> ProjectRunSettings:
    return _read(ProjectRunSettings)


def prefect() -> PrefectSettings:
    return _read(PrefectSettings)


def llm() -> LlmSettings:
    return _read(LlmSettings)


def documents() -> DocumentLimits:
    return _read(DocumentLimits)


def auth() -> AuthSettings:
    return _read(AuthSettings)


def connections() -> ConnectionSettings:
    return _read(ConnectionSettings)


def mcp() -> McpSettings:
    return _read(McpSettings)


def telemetry() -> TelemetrySettings:
    return _read(TelemetrySettings)


def query_log() -> QueryLogSettings:
    return _read(QueryLogSettings)


def serve() -> ServeSettings:
    return _read(ServeSettings)


_read_now: dict[type, tuple[tuple[str | None, ...], Any]] = {}  # area -> (its variables' texts, the area read)


def _read(area: type[AreaT]) -> AreaT:
    """An area as the environment says now, read again only when one of its variables changed (metrics
    and traces ask on every request; reading costs ~1 ms); a bad value is an error naming its variable."""
    texts = tuple(os.environ.get(env_name(name)) for name in area.model_fields)
    known = _read_now.get(area)
    if known is not None and known[0] == texts:
        return known[1]
    try:
        value = area()
    except ValidationError as exc:
        raise _named(exc) from None
    _read_now[area] = (texts, value)
    return value


def fields() -> dict[str, tuple[type[_Area], FieldInfo]]:
    """Every setting by its field name: its area and its field (the docs' table, the tests)."""
    return {name: (area, info) for area in AREAS.values() for name, info in area.model_fields.items()}


def export(field: str, value: str | None) -> None:
    """Set (None: unset) a setting for this process and the ones it starts (flow runs, workers)."""
    if value is None:
        os.environ.pop(env_name(field), None)
    else:
        os.environ[env_name(field)] = value


def current() -> RaglineSettings:
    """Every area as the environment says now; a bad value is a ConfigError naming its variable."""
    return RaglineSettings(**{name: _read(area) for name, area in AREAS.items()})


def _named(exc: ValidationError) -> SettingsError:
    problems = "; ".join(f"{PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors())
    return SettingsError(problems, field=f"{PREFIX}{str(exc.errors()[0]['loc'][0]).upper()}")


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
    """Every setting as a Markdown table, area by area: variable, default, what it does."""
    rows = ["| Variable | Default | What it sets |", "|---|---|---|"]
    for name, (_, info) in fields().items():
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
