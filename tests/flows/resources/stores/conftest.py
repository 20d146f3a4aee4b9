"""Fixtures of the store tests."""
from __future__ import annotations

import pytest

from ragline.flows.resources.stores.state import IndexState, StateSpec
from tests.helpers.postgres import new_schema


@pytest.fixture(params=["sqlite", "postgres"])
def state(request, tmp_path):
    """A state a writer has opened (the file and its schema exist), as ingestion opens it: the
    embedded SQLite file, and the PostgreSQL backend (a schema of its own on the session's server)."""
    spec = StateSpec(type="index_state", path="s.sqlite")
    if request.param == "postgres":
        spec = StateSpec(type="index_state", url=request.getfixturevalue("postgres").url, schema_name=new_schema())
    st = IndexState(spec, base_dir=tmp_path)
    st.conn
    yield st
    st.close()
