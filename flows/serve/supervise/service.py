"""`ragline serve`: every pipeline of a file as a Prefect deployment, run by this process.

One deployment per pipeline, all of the flow ``ragline`` (``run_pipeline``), named after the
pipeline and parameterised with the file's absolute path:

- ingestion pipelines carry their ``schedule:`` (cron in its time zone, or an interval) and a
  deployment concurrency limit of 1 with ``CANCEL_NEW``: a run that comes due while another run
  of the same deployment is active is cancelled by the Prefect server ("Deployment concurrency
  limit reached") instead of queueing behind it; the next tick catches up, ingestion being
  incremental. The index's writer lease in the state DB is the second guard (it also covers
  ``ragline index`` and other pipelines writing the same index: those wait for the holder).
- job pipelines (``tune``, ``adapt``, ``summarize``: they change what queries read) are served
  only when they declare a ``schedule:`` or the operator asks for them (``--serve-jobs``,
  ``RAGLINE_SERVE_JOBS``), with the same concurrency limit; what a run publishes is what the
  pipelines file configures (its ``write`` parameters: a deployment run takes no parameters);
- query pipelines have no schedule: they run when triggered (``POST /api/deployments/{id}/
  create_flow_run`` on the Prefect API, or ``prefect deployment run ragline/<pipeline>``).

Results are persisted as JSON (``persist_result=True, result_serializer="json"``) in a folder
ragline owns, ``<data dir>/.ragline/results`` (the data dir is the pipelines file's folder unless
``--data-dir`` moves the indexes), so an API-triggered run's result can be read back: with
Prefect's client (``state.result()``), from the file that ``state.data.storage_key`` names on the
REST API (the value itself, plain JSON; ``state.data.serializer.type`` is ``json``), or through
ragline's ``GET /v1/runs/{id}``. Results older than ``keep_results_days`` (30; ``--keep-results-days``)
are deleted when serve starts and hourly after that; such a run's ``result`` is then null.

This process is the worker: a Prefect ``Runner`` polls the API every ``poll_seconds`` (2 s;
Prefect's default is 10) and starts each flow run in a new Python process (at most ``limit`` at
once, Prefect's ``PREFECT_RUNNER_PROCESS_LIMIT``, 5 by default). Beside it, uvicorn serves the HTTP
API (``flows/serve/app.py``'s app with ``flows/serve/routers/runs.py``'s router) in the same process. Both run in
threads that the main thread supervises: if one of them dies the other is stopped and the process
exits 1; SIGTERM stops both and exits 0, Ctrl-C exits 130, without a traceback (a second signal
exits at once). Runs in flight are cancelled (recorded Cancelled); one still running 5 s later is
killed (ingestion is crash-safe). Idle, it stops in about a second. Flow runs fork from a
forkserver that imported Prefect's engine, ragline's stages and the project's libraries once
(``flows/serve/supervise/warm.py``); with ``warm_runs=False`` (``--cold-runs``) they start as Prefect starts
them, with multiprocessing's ``spawn``, which re-imports ``__main__``: a script that calls
``serve()`` needs the ``if __name__ == "__main__":`` guard (the ``ragline`` command has it).

Before it starts any child process (a Prefect server, the LLM), serve checks every argument, port and
credential and refuses with all the problems in one line: the API's port (default 8080, as
``ragline api``; 8000 is the LLM endpoint's) is bound first, a token is required off loopback, and
the port of an LLM it is to start must be free. The packaged LLM (``flows/ops/llm_server.py``) is started
when the project's LLM endpoint is local, down and names it, and supervised: reported and restarted
with bounded backoff when it exits, its process group ended with it, its state in ``/readyz``.

Each flow-run process dies with serve, ``kill -9`` included (``parent_death.DiesWith``: the parent-
death signal is armed as the spawned child unpickles the flow), and is recorded as its run's
``infrastructure_pid``. At start, runs of this file's deployments still Pending/Running whose
recorded process is gone are marked Crashed: left as they were, they would hold the deployment's
concurrency slot (every new run cancelled, ``/v1/ingest`` 409) for good. (The index's writer lease
needs nothing: a lease whose holder is a dead process on this host is stale, and taken over.)

On shutdown the deployments are **paused** (Prefect's ``pause_on_shutdown``): while nothing serves
them, no scheduled runs pile up as Late to fire in a burst at the next start. Serving again applies
the deployments unpaused, so the schedules resume by themselves at the next tick.

A Prefect API must be configured (``PREFECT_API_URL``, e.g. ``prefect server start --analytics-off``
and ``export PREFECT_API_URL=http://127.0.0.1:4200/api``), or ``start_prefect=True`` starts one
owned by this process (``flows/ops/prefect_server.py``'s local server, here with **all** server
services: the scheduler does not run in an ephemeral server, so schedules would never fire).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragline.flows import settings
from ragline.flows.spec.compile import Project, load_project
from ragline.flows.contracts import PipelineKind
from ragline.flows.errors import EX_USAGE, RaglineError
from ragline.flows.ops.llm_server import PACKAGED_MODEL, ManagedLLM, endpoint_port, port_free, should_start
from ragline.flows.ops.parent_death import DiesWith
from ragline.flows.run.steps import digest_of
from ragline.flows.serve.app import create_app, credentials_configured
from ragline.flows.serve.layout import FLOW_NAME, deployment_name, results_dir
from ragline.flows.serve.supervise.warm import preload_modules, warm_flow_runs
from ragline.flows.serve.routers.documents import documents_router, upload_limit
from ragline.flows.serve.ingestion_runs import ingestion_runs
from ragline.flows.serve.routers.runs import runs_router
from ragline.flows.run.entrypoints import run_pipeline
from ragline.flows.run.steps import pin_file
from ragline.flows.ops.prefect_server import LocalPrefectServer
from ragline.flows.run.entrypoints import served_deployments, unknown_parameters_refused
from ragline.flows.serve.connections import server_limits
from ragline.flows.ops.store_servers import serve_stores
from ragline.flows.ops.prefect_server import _drain_prefect_workers, _point_prefect_at
from ragline.flows.processes import pid_alive
from ragline.flows.resources import close_resources
from ragline.flows.net import is_loopback
from ragline.flows.ops.prefect_server import auth_string_path, configured_api_url
from ragline.flows.serve.supervise.discovery import published
from ragline.flows.serve.supervise.watch import start_watchers

logger = logging.getLogger("ragline.serve")

DEFAULT_POLL_SECONDS = 2.0
DEFAULT_PORT = 8080  # the HTTP API's, as `ragline api`'s: the LLM endpoint (vLLM) has 8000
KEEP_RESULTS_DAYS = 30.0
PRUNE_EVERY = 3600.0  # seconds between prunings of old results
STOP_GRACE = 5.0  # seconds runs in flight get to stop when cancelled (Prefect waits 30) before they are killed
STOP_TIMEOUT = 10.0  # seconds each component then gets to finish stopping before the process exits anyway
START_TIMEOUT = 120.0  # seconds to apply the deployments and start the API
API_CHECK_EVERY = 5.0  # seconds between health checks of the Prefect API
API_DEAD_AFTER = 60.0  # seconds without an answer from the Prefect API before serve gives up (exit 1)

PREFECT_HOWTO = ("no Prefect API is configured. Start a server in another terminal:\n"
                 "    prefect server start --analytics-off\n"
                 "and point ragline at it:\n"
                 "    export PREFECT_API_URL=http://127.0.0.1:4200/api\n"
                 "or let `ragline serve --start-prefect` start one for this process.")


class ServeError(RaglineError, RuntimeError):
    """ragline serve cannot start (no Prefect API, a port in use, ...): one clear line."""

    error_code = "serve_failed"
    exit_code = EX_USAGE


# ----------------------------------------------------------------------------- deployments
def prune_results(folder: Path, keep_days: float | None, now: float | None = None) -> int:
    """Delete result files older than ``keep_days`` (None: keep all); returns how many went."""
    if keep_days is None or not folder.is_dir():
        return 0
    cutoff = (time.time() if now is None else now) - keep_days * 86400
    removed = 0
    for path in folder.iterdir():
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # removed meanwhile (another serve of the same data)
            continue
    return removed


def served_flow(project: Project):
    """``run_pipeline`` with results persisted as JSON in ragline's results folder."""

    folder = results_dir(project)
    folder.mkdir(parents=True, exist_ok=True)
    # A Path (not an unsaved block, which Flow refuses) becomes a local file system there, and the
    # result's storage key is the file's absolute path: readable by any client on this host.
    flow = run_pipeline.with_options(persist_result=True, result_serializer="json", result_storage=folder)
    flow.ragline_dies_with = DiesWith(os.getpid())  # each flow-run process dies with this one (kill -9 too)
    return flow


def served_pipelines(project: Project, serve_jobs: bool | None = None) -> list[str]:
    """The pipelines ``ragline serve`` deploys: every ingestion and query pipeline; a job only when
    it declares a schedule or ``serve_jobs`` (None: the ``serve_jobs`` setting) asks for it, since
    anyone who may reach the Prefect API could otherwise re-tune or re-summarise the served index."""
    if serve_jobs is None:
        serve_jobs = settings.serve().serve_jobs
    return [name for name, pipeline in project.pipelines.items()
            if pipeline.spec.kind != PipelineKind.JOB or serve_jobs or pipeline.spec.schedule is not None]


def deployment_options(project: Project, data_dir: Path | None = None,
                       serve_jobs: bool | None = None) -> dict[str, dict[str, Any]]:
    """For each served pipeline (``served_pipelines``), the keyword arguments of
    ``run_pipeline.to_deployment`` (and of ``Runner.add_flow``, which calls it): name, parameters,
    schedules, concurrency limit."""
    from prefect.client.schemas.objects import (
        ConcurrencyLimitConfig,
        ConcurrencyLimitStrategy,
    )
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron, Interval

    options: dict[str, dict[str, Any]] = {}
    for name in served_pipelines(project, serve_jobs):
        pipeline = project.pipelines[name]
        parameters: dict[str, Any] = {"pipeline": name, "file": str(project.path.resolve())}
        if data_dir is not None:
            parameters["data_dir"] = str(Path(data_dir).resolve())
        if project.source is not None:  # the pinned copy (steps.pin_file) the runs read, as the API does
            parameters["digest"] = digest_of(project.source)
        spec = pipeline.spec
        entry: dict[str, Any] = {"name": deployment_name(project, name, full=False), "parameters": parameters,
                                 "tags": ["ragline", spec.kind],
                                 "description": spec.description or f"ragline {spec.kind} pipeline '{name}'",
                                 "entrypoint_type": EntrypointType.MODULE_PATH}
        if spec.kind in (PipelineKind.INGESTION, PipelineKind.JOB):  # a job (`tune`) is scheduled like an ingestion
            schedules = []
            # Each schedule is named (its slug, what the dashboard shows) after what it does; a cron and
            # an interval never share a name, so the slugs stay unique within the deployment.
            if spec.schedule is not None and spec.schedule.cron:
                timezone = spec.schedule.timezone or "UTC"
                schedules.append(Cron(spec.schedule.cron, timezone=spec.schedule.timezone,
                                      slug=f"{spec.schedule.cron} ({timezone})"))
            if spec.schedule is not None and spec.schedule.interval_seconds:
                schedules.append(Interval(spec.schedule.interval_seconds, timezone=spec.schedule.timezone,
                                          slug=f"every {spec.schedule.interval_seconds:g} s"))
            entry["schedules"] = schedules
            entry["concurrency_limit"] = ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
        options[name] = entry
    return options


def _refuse_foreign_deployments(project: Project, options: dict[str, dict[str, Any]]) -> None:
    """Refuse to take over deployments another pipelines file registered under the same names:
    Prefect would update them in place, and both files' runners would then run this file's pipelines."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    mine = str(project.path.resolve())
    with get_client(sync_client=True) as client:
        for name in options:
            full = deployment_name(project, name)
            try:
                deployment = client.read_deployment_by_name(full)
            except ObjectNotFound:
                continue
            theirs = (deployment.parameters or {}).get("file")
            if theirs and theirs != mine:
                raise ServeError(f"the Prefect deployment '{full}' serves {theirs}, not {mine}: give this file its "
                                 f"own names with `settings: {{deployment_prefix: <name>-}}`, or, if that file is "
                                 f"gone, delete its deployments (`prefect deployment delete {full}`)")


def build_deployments(project_path: str | Path, data_dir: str | Path | None = None) -> list[Any]:
    """One ``RunnerDeployment`` per pipeline (``run_pipeline.to_deployment``), not yet applied:
    what ``serve`` registers, for ``prefect.serve(*build_deployments(...))`` or inspection. (That
    path runs flows from the module entrypoint; ``serve`` keeps the JSON result settings.)"""
    project = _project(project_path, data_dir)
    flow = served_flow(project)
    return [flow.to_deployment(**options) for options in deployment_options(project, data_dir).values()]


def _project(project_path: str | Path, data_dir: str | Path | None) -> Project:
    """The file as pinned now (``steps.pin_file``): the deployments and the API compile the same text."""

    project = load_project(project_path, source=pin_file(project_path, data_dir))
    return project.relocated(Path(data_dir)) if data_dir else project


# ----------------------------------------------------------------------------- the Prefect API
def _serving_server_class():
    """ragline's local Prefect server, with every server service (scheduler included)."""

    class ServingPrefectServer(LocalPrefectServer):
        def _environment(self) -> dict[str, str]:
            env = super()._environment()
            env.pop("PREFECT__SERVER_EPHEMERAL", None)  # an ephemeral server never schedules runs
            # the dashboard too, at the server's root, talking to this server's API
            env.update(PREFECT_UI_ENABLED="1", PREFECT_UI_API_URL=self.api_url,
                       PREFECT_UI_URL=self.api_url.removesuffix("/api"))
            return env

    return ServingPrefectServer


def start_prefect_server(home: Path | None = None, database: str | None = None, auth: bool = True):
    """Start a local Prefect server owned by this process (stopped with it); returns the server.
    ``auth``: it requires the secret kept beside its database (``prefect_server.auth_string``)."""
    server = _serving_server_class()(home, database, auth=auth)
    server.start()
    return server


def use_prefect_api(url: str, stack: contextlib.ExitStack, auth: str | None = None) -> None:
    """Point every reader of Prefect's settings at ``url`` (with ``auth``, the secret of a server
    this process started, as ``PREFECT_API_AUTH_STRING``): this context, the process-global one
    (threads), and os.environ (flow-run processes). Undone when ``stack`` closes."""
    _point_prefect_at(url, stack, auth)


def _api_state(url: str, timeout: float = 5.0) -> str:
    """``answers``, ``busy`` (it took the connection but gave no healthy answer in time: SQLite busy
    under Prefect's scheduler on a loaded machine) or ``absent`` (nothing listens there)."""
    import httpx

    try:
        ok = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout, trust_env=False).status_code == 200
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol):
        return "absent"
    except httpx.HTTPError:
        return "busy"
    return "answers" if ok else "busy"


def _check_api(url: str, say: Callable[[str], None], absent_for: float = 10.0, busy_for: float = 120.0,
               request_timeout: float = 5.0) -> None:
    """Wait for the Prefect API: ``absent_for`` s while nothing listens (a server still starting),
    ``busy_for`` s once a server took the connection, since a loaded server answers late, not never;
    ``say`` tells the user when the longer wait begins."""
    started = time.monotonic()
    waited_for = absent_for
    while True:
        state = _api_state(url, request_timeout)
        if state == "answers":
            return
        if state == "busy" and waited_for < busy_for:
            waited_for = busy_for
            say(f"ragline serve: the Prefect API at {url} is slow to answer; waiting up to {busy_for:g} s")
        if time.monotonic() - started > waited_for:
            hint = ("it took the connection but gave no healthy answer" if state == "busy"
                    else "is `prefect server start` running?")
            raise ServeError(f"the Prefect API at {url} does not answer within {waited_for:g} s; {hint}")
        time.sleep(0.5)


# ----------------------------------------------------------------------------- the HTTP API
def api_app(project_path: str | Path, *, token: str | None = None, data_dir: str | Path | None = None,
            source: str | Path | None = None):
    """``flows/serve/app.py``'s app (query, OpenAI-compatible and health routes) with the runs router
    (``/v1/ingest``, ``/v1/runs/{id}``) and the document API (``/v1/documents``) mounted under the same token and error shapes; ``source``:
    the pinned copy of the file the deployments run (``steps.pin_file``)."""
    runs = ingestion_runs(project_path, data_dir=data_dir, source=source)
    limit = upload_limit(runs)
    return create_app(str(project_path), token=token, routers=[runs_router(project_path, runs=runs),
                                                               documents_router(runs)],
                      data_dir=str(data_dir) if data_dir else None, source=source,
                      body_limits={"/v1/documents": limit} if limit else None)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


# ----------------------------------------------------------------------------- the service
class ServeSupervisor:
    """The runner and the HTTP API of one pipelines file, each in a thread of this process.

    ``start()`` returns once the deployments are applied and the API listens; ``wait()`` blocks
    until ``stop()`` is called or a component ends (its name is returned); ``stop()`` stops both
    (cancelling runs in flight, pausing the schedules unless ``pause_on_shutdown=False``) and the
    Prefect server it started, if any."""

    def __init__(self, project_path: str | Path, *, api: bool = True, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, token: str | None = None, start_prefect: bool = False,
                 data_dir: str | Path | None = None, poll_seconds: float = DEFAULT_POLL_SECONDS,
                 limit: int | None = None, pause_on_shutdown: bool = True, prefect_home: Path | None = None,
                 log: Callable[[str], None] | None = None, keep_results_days: float | None = KEEP_RESULTS_DAYS,
                 start_llm: bool = False, warm_runs: bool = True, serve_jobs: bool | None = None):
        self.project_path = Path(project_path).resolve()
        self.serve_jobs = serve_jobs  # None: the serve_jobs setting
        self.start_llm = start_llm
        self.warm_runs = warm_runs  # flow runs fork from a forkserver with their imports done (flows/serve/supervise/warm.py)
        self.runs_start_warm = False  # whether they do (warm_flow_runs said so)
        self._llms: list[ManagedLLM] = []  # the packaged LLMs this process supervises
        self.api, self.host, self.port, self.token = api, host, port, token
        self.start_prefect, self.data_dir = start_prefect, data_dir
        self.poll_seconds, self.limit, self.pause_on_shutdown = poll_seconds, limit, pause_on_shutdown
        self.keep_results_days = keep_results_days
        self._results: Path | None = None
        self._stores: list[Any] = []
        self.prefect_home = prefect_home
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.deployment_ids: dict[str, Any] = {}
        self.prefect_api_url: str | None = None
        self.api_url: str | None = None
        self._stack = contextlib.ExitStack()
        self._prefect_server = None
        self._runner = None
        self._runner_loop: asyncio.AbstractEventLoop | None = None
        self._uvicorn = None
        self._threads: dict[str, threading.Thread] = {}
        self._ready = threading.Event()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._errors: dict[str, BaseException] = {}
        self._api_gone: str | None = None

    # -- start
    def start(self) -> ServeSupervisor:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        project = _project(self.project_path, self.data_dir)
        options = deployment_options(project, self.data_dir, self.serve_jobs)
        self._results = results_dir(project)
        self._prune()
        llms = self._llms_to_start(project)
        sock = self._check_everything(options, llms)  # before any child process (LLM, Prefect server) starts
        self._stack.callback(lambda: sock is not None and sock.close())
        self._serve_stores(project)
        for watcher in start_watchers(project, self.log):
            self._stack.callback(watcher.stop)
        self._connect_prefect()
        for base_url in llms:
            self.log(f"ragline serve: starting the packaged LLM ({PACKAGED_MODEL} on vLLM) at {base_url} in the "
                     f"background (--no-start-llm to skip); /readyz reports it until it answers")
            self._llms.append(ManagedLLM(base_url, say=lambda line: self.log(f"ragline serve: {line}")).start())
        _refuse_foreign_deployments(project, options)

        self._stack.enter_context(served_deployments(
            {deployment_name(project, name): opts["parameters"] for name, opts in options.items()}))
        self._stack.enter_context(unknown_parameters_refused())
        flow = served_flow(project)
        if self.warm_runs:
            self.runs_start_warm = self._stack.enter_context(warm_flow_runs(preload_modules(project)))
        context = contextvars.copy_context()  # the Prefect settings chosen above, for the threads
        self._spawn("runner", lambda: context.run(self._run_runner, flow, options))
        self._await_ready(self._ready.is_set, "runner", "the deployments were not applied")
        if sock is not None:
            import uvicorn

            app = api_app(self.project_path, token=self.token, data_dir=self.data_dir, source=project.source)
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=3, **server_limits())
            self._uvicorn = uvicorn.Server(config)
            host, port = sock.getsockname()[:2]
            self.api_url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            context = contextvars.copy_context()
            self._spawn("api", lambda: context.run(self._uvicorn.run, sockets=[sock]))
            self._await_ready(lambda: self._uvicorn.started, "api", "the HTTP API did not start")

            self._stack.enter_context(published(app.state.service.project, host, port, self.token,
                                                self.data_dir))  # a terminal search or ask uses this API
        served = ", ".join(f"{opts['name']} ({self._describe(opts)})" for opts in options.values())
        self.log(f"ragline serve: {len(options)} deployment(s) of flow '{FLOW_NAME}': {served}")
        unserved = [name for name in project.pipelines if name not in options]
        if unserved:
            self.log(f"ragline serve: job pipeline(s) {', '.join(unserved)} not deployed: they declare no schedule "
                     f"(--serve-jobs or RAGLINE_SERVE_JOBS=1 deploys them; `ragline tune` etc. run them here)")
        self.log(f"ragline serve: Prefect API {self.prefect_api_url}; runner polls every {self.poll_seconds:g} s"
                 + (f"; HTTP API {self.api_url}" if self.api_url else ""))

    def _serve_stores(self, project: Project) -> None:
        """One server per embedded store (a Chroma folder, a milvus-lite file), before any flow run or
        query opens it: the API and every flow-run process then read and write through it
        (flows/ops/chroma_server.py and milvus_server.py say why)."""

        try:
            self._stores = serve_stores(project, self._stack, self.log)
        except RuntimeError as exc:
            raise ServeError(str(exc)) from None

    @staticmethod
    def _describe(options: dict[str, Any]) -> str:
        """The deployment's schedules by the names the dashboard shows (``deployment_options``)."""
        schedules = options.get("schedules") or []
        if not schedules:
            return "on demand"
        parts = [f"cron '{s.slug}'" if s.cron else s.slug for s in schedules]
        return ", ".join(parts) + ", one run at a time"

    def _llms_to_start(self, project: Project) -> list[str]:
        """The local LLM endpoints that are down and name the packaged model: ours to start."""
        if not self.start_llm:
            return []
        endpoints = {(spec.base_url, spec.model) for spec in project.spec.resources.values()
                     if getattr(spec, "type", None) == "openai_compatible"}
        say = lambda line: self.log(f"ragline serve: {line}")  # noqa: E731
        return [base_url for base_url, model in sorted(endpoints) if should_start(base_url, model, say=say)]

    def _check_everything(self, options: dict[str, dict[str, Any]], llms: list[str]) -> socket.socket | None:
        """Every argument, port and credential, checked at once: all the problems in one line (a
        refusal never waits for an LLM to load). Returns the API's bound socket."""
        problems: list[str] = []
        if not options:
            problems.append(f"{self.project_path.name} defines no pipeline to serve")
        if self.api and not is_loopback(self.host) and \
                not credentials_configured(str(self.project_path), self.token, self.data_dir):
            problems.append(f"serving the API on {self.host} (not loopback) needs a token: pass --token "
                            f"(or RAGLINE_API_TOKEN), create an API key (`ragline keys create`), or listen on "
                            f"127.0.0.1")
        clash = [url for url in llms if self.api and endpoint_port(url) == self.port]
        for url in clash:
            problems.append(f"the API's port {self.port} is the LLM endpoint's ({url}), where the packaged LLM "
                            f"would start: pass another --port (the default is {DEFAULT_PORT})")
        sock = None
        if self.api and not clash:
            try:
                sock = _bind(self.host, self.port)
            except ServeError as exc:
                problems.append(str(exc))
        for url in llms:
            if url not in clash and not port_free(endpoint_port(url)):
                problems.append(f"the LLM endpoint {url} does not answer, but its port {endpoint_port(url)} is "
                                f"in use by another program, so the packaged LLM cannot start there: stop that "
                                f"program, or point the endpoint elsewhere (RAGLINE_LLM_BASE_URL)")
        url = configured_api_url()
        if url is None and not self.start_prefect:
            problems.append(PREFECT_HOWTO)
        elif url is not None:
            try:
                _check_api(url, self.log)
            except ServeError as exc:
                problems.append(str(exc))
        if problems:
            if sock is not None:
                sock.close()
            raise ServeError("; ".join(problems))
        return sock

    def _connect_prefect(self) -> None:
        url = configured_api_url()
        if url is None:
            self.log("ragline serve: starting a local Prefect server (with its scheduler) ...")
            self._prefect_server = start_prefect_server(self.prefect_home)
            url = self._prefect_server.api_url
            self.log(f"ragline serve: Prefect server on {url} (pid {self._prefect_server.pid}); dashboard: "
                     f"{url.removesuffix('/api')}; it requires the secret in "
                     f"{auth_string_path(self._prefect_server.home)}")
        use_prefect_api(url, self._stack, self._prefect_server.auth_string if self._prefect_server else None)
        self.prefect_api_url = url

    def _spawn(self, name: str, target: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - reported by wait()
                self._errors.setdefault(name, exc)
            finally:
                self._wake.set()

        self._threads[name] = threading.Thread(target=run, name=f"ragline-serve-{name}", daemon=True)
        self._threads[name].start()

    def _await_ready(self, ready: Callable[[], bool], name: str, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if not self._threads[name].is_alive() or time.monotonic() > deadline:
                error = self._errors.get(name)
                detail = f": {type(error).__name__}: {error}" if error is not None else ""
                raise ServeError(f"{what}{detail}")
            time.sleep(0.05)

    def _run_runner(self, flow: Any, options: dict[str, dict[str, Any]]) -> None:
        async def main() -> None:
            from prefect.runner import Runner

            self._runner_loop = asyncio.get_running_loop()
            runner = Runner(name=f"ragline-{socket.gethostname()}-{os.getpid()}", query_seconds=self.poll_seconds,
                            limit=self.limit if self.limit is not None else _default_limit(),
                            pause_on_shutdown=self.pause_on_shutdown)
            for name, kwargs in options.items():
                if self._stopping.is_set():
                    break
                self.deployment_ids[name] = await runner.aadd_flow(flow, **kwargs)
            if self._stopping.is_set():  # stopped while starting: leave things as a stopped runner does
                await self._pause_deployments()
                return
            await self._crash_orphaned_runs()
            started = asyncio.ensure_future(runner.start())
            while not runner.started and not started.done():
                await asyncio.sleep(0.05)
            self._runner = runner
            self._ready.set()
            recorder = asyncio.ensure_future(self._record_flow_run_processes(runner))
            if self._stopping.is_set() and runner.started:
                await runner.astop()
            try:
                await started
            finally:
                recorder.cancel()

        asyncio.run(main())

    # -- run
    def wait(self, timeout: float | None = None) -> str | None:
        """Block until ``stop()`` or until a component ends; returns its name ("runner", "api", or
        "Prefect API" when the Prefect server this started exited, or a configured one has not
        answered for ``API_DEAD_AFTER`` seconds). None when stopped, or at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_answer = next_check = time.monotonic()
        next_prune = last_answer + PRUNE_EVERY
        while not self._stopping.is_set():
            for name, thread in self._threads.items():
                if not thread.is_alive():
                    return name
            now = time.monotonic()
            server = self._prefect_server
            if server is not None and server.process is not None and server.process.poll() is not None:
                self._api_gone = f"the Prefect server this process started exited ({server.process.returncode})"
                return "Prefect API"
            if self.prefect_api_url and now >= next_check:
                next_check = now + API_CHECK_EVERY
                if _api_state(self.prefect_api_url) == "answers":
                    last_answer = now
                elif now - last_answer > API_DEAD_AFTER:
                    self._api_gone = f"{self.prefect_api_url} has not answered for {API_DEAD_AFTER:g} s"
                    return "Prefect API"
            if now >= next_prune:
                next_prune = now + PRUNE_EVERY
                self._prune()
            if deadline is not None and now > deadline:
                return None
            self._wake.wait(0.5)
            self._wake.clear()
        return None

    def _prune(self) -> None:
        if self._results is None:
            return
        try:
            removed = prune_results(self._results, self.keep_results_days)
        except OSError as exc:  # never a reason to stop serving
            self.log(f"ragline serve: could not prune old results in {self._results}: {exc}")
            return
        if removed:
            self.log(f"ragline serve: removed {removed} result file(s) older than {self.keep_results_days:g} days")

    def failure(self, name: str) -> str:
        if name == "Prefect API" and self._api_gone:
            return self._api_gone
        error = self._errors.get(name)
        return f"{type(error).__name__}: {error}" if error is not None else "it stopped"

    # -- stop
    def stop(self, grace: float = STOP_GRACE, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the API and the runner (idempotent), then the Prefect server this started. Runs in
        flight are cancelled (Prefect records them Cancelled); one still running ``grace`` seconds
        later (a step inside a long native call) is killed: ingestion is built to survive that."""
        self._stopping.set()
        self._wake.set()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        loop = self._runner_loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self._stop_runner(), loop)
        if self._api_gone:  # nothing can be recorded or paused: do not wait for the runner's retries
            grace, timeout = 0.0, 2.0
        runner = self._threads.get("runner")
        if runner is not None:
            runner.join(grace)
            if runner.is_alive():
                _kill_flow_run_processes()
        deadline = time.monotonic() + timeout
        for name, thread in list(self._threads.items()):
            thread.join(max(0.1, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("ragline serve: the %s did not stop in time", name)
        if any(thread.is_alive() for thread in self._threads.values()):
            _kill_flow_run_processes()  # never leave a flow run behind this process
        close_resources()  # the API's models and store clients, before the stores' servers stop
        self._stack.close()
        while self._llms:
            self._llms.pop().stop()  # its whole process group: SIGTERM, SIGKILL after a grace
        if self._prefect_server is not None:
            server, self._prefect_server = self._prefect_server, None
            with contextlib.suppress(Exception):

                _drain_prefect_workers(3.0)
            server.stop()

    async def _stop_runner(self) -> None:
        runner = self._runner
        if runner is not None and runner.started:
            await runner.astop()  # cancels runs in flight, then start() returns (pausing schedules)
        # else: still starting; the runner thread sees the stop flag once the runner has started

    async def _record_flow_run_processes(self, runner: Any) -> None:
        """Record each flow-run process as its run's ``infrastructure_pid`` (``host:pid``, as
        Prefect's process worker does): what a later serve checks to tell a run whose process is
        gone from one still running (``_crash_orphaned_runs``)."""
        from prefect.client.orchestration import get_client

        recorded: set[Any] = set()
        async with get_client() as client:
            while True:
                pids = _flow_run_pids(runner)
                for run_id, pid in pids.items():
                    if run_id in recorded:
                        continue
                    recorded.add(run_id)
                    try:
                        await client.update_flow_run(run_id, infrastructure_pid=f"{socket.gethostname()}:{pid}")
                    except Exception as exc:  # noqa: BLE001 - only the clean-up after a kill -9 needs it
                        logger.warning("ragline serve: could not record flow run %s's process: %s", run_id, exc)
                recorded &= set(pids)
                await asyncio.sleep(0.5)

    async def _crash_orphaned_runs(self) -> None:
        """Mark Crashed the active runs of this file's deployments whose flow-run process is gone
        (a serve killed with -9 took its runs along): left Running, they would hold the deployment's
        concurrency slot, so every new run would be cancelled and /v1/ingest would answer 409, for
        good. Runs that recorded no process, or one on another host, are left alone."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.states import Crashed

        if not self.deployment_ids:
            return
        active = FlowRunFilterState(type=FlowRunFilterStateType(any_=["PENDING", "RUNNING", "CANCELLING"]))
        try:
            async with get_client() as client:
                runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    deployment_id=FlowRunFilterDeploymentId(any_=list(self.deployment_ids.values())), state=active))
                for run in runs:
                    if not process_gone(run.infrastructure_pid, run.start_time):
                        continue
                    message = (f"its flow-run process ({run.infrastructure_pid}) is gone: the ragline serve that "
                               f"ran it stopped without ending it (kill -9?)")
                    await client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                    self.log(f"ragline serve: flow run {run.name} ({run.id}) marked Crashed: {message}")
        except Exception as exc:  # noqa: BLE001 - serving goes on; the run stays as it was
            self.log(f"ragline serve: could not check for runs left behind by a previous serve: {exc}")

    async def _pause_deployments(self) -> None:
        """What the runner does on shutdown, for a stop before it started."""
        if not self.pause_on_shutdown or not self.deployment_ids:
            return
        from prefect.client.orchestration import get_client

        with contextlib.suppress(Exception):
            async with get_client() as client:
                for deployment_id in self.deployment_ids.values():
                    await client.pause_deployment(deployment_id)


def _flow_run_pids(runner: Any) -> dict[Any, int]:
    """The runner's flow-run processes by flow run id (Prefect 3.8's process manager; read only)."""
    handles = getattr(getattr(runner, "_process_manager", None), "_process_map", None) or {}
    return {run_id: handle.pid for run_id, handle in list(handles.items()) if getattr(handle, "pid", None)}


def process_gone(infrastructure_pid: str | None, started: Any = None) -> bool:
    """Whether a run's recorded process (``host:pid``) is gone: on this host, with no such process,
    or with a process that started after the run did (its pid reused). Unknown: not gone."""
    host, _, pid_text = (infrastructure_pid or "").rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        import psutil

        created = psutil.Process(int(pid_text)).create_time()
    except ImportError:

        return not pid_alive(int(pid_text))
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. access denied: it exists
        return False
    return started is not None and created > started.timestamp() + 1.0


def _kill_flow_run_processes() -> None:
    """SIGKILL the flow-run processes the runner started (multiprocessing children of this one)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()


def _default_limit() -> int | None:
    from prefect.settings import get_current_settings

    return get_current_settings().runner.process_limit


# ----------------------------------------------------------------------------- the command
def serve(project_path: str | Path, *, api: bool = True, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          token: str | None = None, start_prefect: bool = False, data_dir: str | Path | None = None,
          poll_seconds: float = DEFAULT_POLL_SECONDS, limit: int | None = None,
          pause_on_shutdown: bool = True, keep_results_days: float | None = KEEP_RESULTS_DAYS,
          start_llm: bool = False, warm_runs: bool = True, serve_jobs: bool | None = None) -> int:
    """Serve a pipelines file until SIGTERM (exit 0) or Ctrl-C (exit 130); 1 if the runner or the
    API stopped by itself, 2 if it cannot start (no Prefect API, port in use, invalid file: the
    message says why). Call it from the main thread: it handles SIGTERM and SIGINT itself."""
    service = ServeSupervisor(project_path, api=api, host=host, port=port, token=token, start_prefect=start_prefect,
                      data_dir=data_dir, poll_seconds=poll_seconds, limit=limit,
                      pause_on_shutdown=pause_on_shutdown, keep_results_days=keep_results_days,
                      start_llm=start_llm, warm_runs=warm_runs, serve_jobs=serve_jobs)
    received: list[int] = []

    def on_signal(signum, frame) -> None:
        if received:  # a second signal: stop waiting for the components
            os._exit(130 if signum == signal.SIGINT else 0)
        received.append(signum)
        service._stopping.set()
        service._wake.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    code = 0
    try:
        try:
            service.start()
        except ServeError as exc:
            if not received:  # (a signal during start-up is a stop, not an error)
                print(f"error: {exc}", file=sys.stderr)
                code = exc.exit_code
        else:
            died = service.wait()
            if died is not None and not received:
                print(f"error: ragline serve: the {died} stopped ({service.failure(died)}); stopping",
                      file=sys.stderr)
                code = 1
    finally:
        if received:
            service.log("ragline serve: stopping (runs in flight are cancelled; schedules "
                        + ("paused" if pause_on_shutdown else "kept") + ")")
        service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        service.log("ragline serve: stopped")
        return _exit_code(received)
    return code


def _exit_code(received: list[int]) -> int:
    return 130 if received and received[0] == signal.SIGINT else 0
