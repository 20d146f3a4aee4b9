"""The `vllm_server` fixture: one real vLLM server (SmolLM2-135M on CPU) for the whole session.

Wire it in from tests/conftest.py with `from tests.llm_conftest import vllm_server  # noqa: F401`.
The first use installs .venv-vllm/ and converts the model (~3 min); starting takes ~45-120 s.
Set RAGLINE_LLM_BASE_URL=http://HOST:PORT/v1 to test against a server that is already running.
"""
from __future__ import annotations

import pytest

from tests.llm_server import VllmServer, start_vllm


@pytest.fixture(scope="session")
def vllm_server() -> VllmServer:
    server = start_vllm()
    try:
        yield server
    finally:
        server.stop()  # no-op for an external server
