"""A flow run's progress labels (``entrypoints.RunProgress``) against a real HTTP server that plays
Prefect's API: the label writes a CLI command makes on every run must not wait out Prefect's
client back-off when the server's SQLite answers 503 (issue 22 item 5: per-command overhead)."""
from __future__ import annotations

import json
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.net import serve_in_thread


class _LabelsAPI(BaseHTTPRequestHandler):
    """PATCH /api/flow_runs/{id}/labels: 503 (what Prefect's server answers on SQLITE_BUSY_SNAPSHOT, a
    write that met another in its transaction) for the first ``busy`` calls, then 204."""

    busy = 1
    seen: list[dict] = []

    def do_PATCH(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        self.send_response(503 if len(type(self).seen) <= type(self).busy else 204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802 - /csrf-token: 404, an API without CSRF protection
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def labels_api():
    _LabelsAPI.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LabelsAPI)
    serve_in_thread(server)
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


def test_a_label_write_that_meets_a_busy_database_is_sent_again_at_once(labels_api, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ragline.flows.run.entrypoints import PROGRESS_LABEL, RunProgress

    pauses: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda seconds: (pauses.append(seconds), real_sleep(min(seconds, 0.01))))
    with temporary_settings(updates={PREFECT_API_URL: labels_api}):
        RunProgress(uuid.uuid4()).phase("listing")
    assert _LabelsAPI.seen == [{PROGRESS_LABEL + "phase": "listing"}] * 2  # written, on the second attempt
    assert pauses and max(pauses) < 0.5, f"waited {pauses} s before writing the label again"


def test_a_label_write_gives_up_quietly_when_the_server_stays_busy(labels_api, monkeypatch):
    """Each of Prefect's attempts (its own back-off between them) is a burst of quick ones; then the
    label is given up without failing the run."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from ragline.flows.run.entrypoints import BUSY_RETRY_PAUSES, RunProgress

    _LabelsAPI.busy = 1000
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    try:
        with temporary_settings(updates={PREFECT_API_URL: labels_api}):
            RunProgress(uuid.uuid4()).start(3)  # best effort: no exception
            attempts = (len(BUSY_RETRY_PAUSES) + 1) * (PREFECT_CLIENT_MAX_RETRIES.value() + 1)
    finally:
        _LabelsAPI.busy = 1
    assert len(_LabelsAPI.seen) == attempts
