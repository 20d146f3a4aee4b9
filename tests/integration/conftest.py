"""Integration tests (all marked `integration`, so `pytest -m "not integration"` leaves this folder out)
and their real Prefect API server: one of ragline's own serving servers per worker, which in-process
flow runs use for the rest of the session (``prefect_server``) and the modules that serve deployments
find wiped (``prefect_api``)."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Every test under tests/integration/ is an integration test, whatever its module declares."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def prefect_server(worker_prefect_api):
    """This process's Prefect client pointed at this worker's server (``worker_prefect_api``) for the
    rest of the session, as Prefect's test harness points it at a server of its own: one start per
    worker instead of two. In-process flow runs, their logs and events go there; child processes
    get the URL only where a test passes it (``PREFECT_API_URL.value()``)."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ragline.flows.ops.prefect_server import _drain_prefect_workers

    with temporary_settings(updates={PREFECT_API_URL: worker_prefect_api}), \
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
        try:
            yield
        finally:  # what the log and event workers still hold goes out while the server is up
            _drain_prefect_workers(10)


def _start_serving_server(tmp_path_factory):
    """ragline's own `--start-prefect` server (all services, scheduler included; not the test harness,
    which runs no scheduler) on a temporary database of its own, even when the session's test harness
    (whose settings name the harness's database, which the server would inherit) is running. Without
    its basic authentication (``auth=False``): the tests talk to it with plain HTTP, as an operator's
    own `prefect server start` would be reached; tests/integration/test_prefect_api_security.py
    checks the authenticated server `ragline serve --start-prefect` starts."""
    from ragline.flows.ops.prefect_server import database_url
    from ragline.flows.serve.supervise.service import start_prefect_server

    home = tmp_path_factory.mktemp("prefect-home")
    return start_prefect_server(home, database=database_url(home), auth=False)


@pytest.fixture(scope="session")
def worker_prefect_api(tmp_path_factory):
    """One serving Prefect server per pytest(-xdist) worker (30 s to start on an idle 2-core machine,
    100-300 s on a loaded one), shared by the modules that worker runs one after another
    (``prefect_server``, ``prefect_api``)."""
    server = _start_serving_server(tmp_path_factory)
    try:
        yield server.api_url
    finally:
        server.stop()


def forget_everything(api_url: str) -> None:
    """Delete what `ragline serve` and the tests leave on a Prefect server: deployments (with their
    schedules and scheduled runs), flow runs (their task runs and logs go with them), flows and
    global concurrency limits. Events cannot be deleted: a module that reads the Event Feed needs
    ``own_prefect_api``. Prefect answers 503 on a database conflict (its scheduler or a finishing
    run writing at the same moment): each request is retried, a 404 is something already gone, and
    the wipe goes round again until a round finds nothing."""
    import httpx
    from tenacity import retry, retry_if_result, stop_after_attempt, wait_exponential

    @retry(retry=retry_if_result(lambda r: r.status_code in (409, 503)), stop=stop_after_attempt(12),
           wait=wait_exponential(multiplier=0.25, max=5), retry_error_callback=lambda state: state.outcome.result())
    def ask(method: str, path: str, **kwargs) -> httpx.Response:
        return client.request(method, path, **kwargs)

    def listed(kind: str, limit: int = 200) -> list[dict]:
        return ask("POST", f"/{kind}/filter", json={"limit": limit} if kind != "v2/concurrency_limits" else {}
                   ).raise_for_status().json()

    with httpx.Client(base_url=api_url, timeout=60) as client:
        for _round in range(5):
            found = False
            for kind in ("deployments", "flow_runs", "flows", "v2/concurrency_limits"):
                while page := listed(kind):
                    found = True
                    for item in page:
                        response = ask("DELETE", f"/{kind}/{item['id']}")
                        if response.status_code != 404:
                            response.raise_for_status()
                    if kind == "v2/concurrency_limits":
                        break
            if not found:
                return
        left = {kind: listed(kind) for kind in ("deployments", "flow_runs", "flows", "v2/concurrency_limits")}
        assert not any(left.values()), f"the Prefect server at {api_url} kept {left}"


@pytest.fixture(scope="module")
def prefect_api(worker_prefect_api):
    """A real Prefect server with its scheduler, empty when the module starts: this worker's server
    (``worker_prefect_api``), wiped before and after the module (``forget_everything``), so each
    module's project registers its deployments under the same names as another module's, and no
    module sees another's runs."""
    forget_everything(worker_prefect_api)
    yield worker_prefect_api
    forget_everything(worker_prefect_api)


@pytest.fixture(scope="module")
def own_prefect_api(tmp_path_factory):
    """A Prefect server of the module's own (a fresh database): for a module that reads what cannot
    be wiped (the Event Feed)."""
    server = _start_serving_server(tmp_path_factory)
    try:
        yield server.api_url
    finally:
        server.stop()
