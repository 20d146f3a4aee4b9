"""Integration tests (all marked `integration`, so `pytest -m "not integration"` leaves this folder out)
and their real Prefect API servers: the test harness's for the whole integration session, and for the
modules that serve deployments, one of ragline's own servers per module."""
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
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real Prefect server with its scheduler (not the ephemeral test harness, which runs no
    scheduler): ragline's own `--start-prefect` server, on a temporary database. One per module:
    each module's project registers its deployments under the same names."""
    from ragline.flows.ops.prefect_server import database_url
    from ragline.flows.serve.service import start_prefect_server

    home = tmp_path_factory.mktemp("prefect-home")
    # its own database even when the session's test harness (whose settings name the harness's
    # database, which the server would inherit) is running: one module's deployments are not another's
    server = start_prefect_server(home, database=database_url(home))
    try:
        yield server.api_url
    finally:
        server.stop()
