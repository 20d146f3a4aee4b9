"""`ragline serve`'s own uvicorn (issue 16 item 12): the configuration it ships closes half-sent
requests after the header deadline (set here through RAGLINE_HEADER_TIMEOUT_SECONDS, as a user
would) while /healthz answers. A real Prefect server and `ragline serve` in a subprocess."""
from __future__ import annotations

import httpx
import pytest

from tests.helpers.slow_clients import half_sent, healthz_meanwhile, wait_closed
from tests.integration.serving import _start, _stop, served_project

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return served_project(tmp_path_factory.mktemp("served"))


def test_serve_closes_half_sent_requests_and_answers_healthz(project, prefect_api, many_fds, monkeypatch):
    monkeypatch.setenv("RAGLINE_HEADER_TIMEOUT_SECONDS", "2")
    process, url = _start(project, prefect_api, project.parent / "serve-slow.log", api=True)
    try:
        port = int(url.rsplit(":", 1)[1])
        sockets = half_sent(port, 600, b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthoriz")
        latencies = healthz_meanwhile(port, 1.5)
        closed, statuses = wait_closed(sockets, 10)
        assert closed == 600 and statuses == {408: 600}, statuses
        assert max(latencies) < 3.0, latencies
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    finally:
        _stop(process)
    print(f"\nragline serve: 600 half-sent requests closed with 408; /healthz max {max(latencies) * 1000:.0f} ms")
