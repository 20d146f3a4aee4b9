"""A real Prefect API server (temporary SQLite database) for the whole integration session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
