"""The API's run status reads a PostgreSQL index state (it has no file to look for first)."""
from __future__ import annotations

import datetime
import threading

import pytest

from ragline.flows.resources import clear_cache
from ragline.flows.serve.ingestion_runs import _Runs
from ragline.flows.spec.compile import load_project
from tests.helpers.data import index_and_search_yaml


@pytest.mark.parametrize("state_backend", ["postgres"], indirect=True)
def test_the_writer_and_its_progress_are_read_from_a_database_state(make_project):
    project = load_project(make_project(index_and_search_yaml()))
    runs = _Runs(project)
    since = datetime.datetime.now(datetime.timezone.utc)
    assert runs.lease_holder("index") is None and runs.documents_written_since("index", since) is None  # no schema
    state = project.resource("state")
    state.conn  # a writer created the schema
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with state.lease("a scheduled run"):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        assert runs.lease_holder("index").holder == "a scheduled run"
        assert runs.documents_written_since("index", since) == 0
    finally:
        release.set()
        thread.join()
    assert runs.lease_holder("index") is None
    clear_cache()
