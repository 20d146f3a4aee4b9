"""Start and stop a real vLLM OpenAI-compatible server for tests (HTTP only: vLLM lives in its own
venv, .venv-vllm/, because its pins differ from ragline's).

    server = start_vllm()          # runs deploy/vllm/setup.sh if needed, then deploy/vllm/serve.sh
    OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(model=server.model, ...)
    server.stop()

Set RAGLINE_LLM_BASE_URL=http://HOST:PORT/v1 to use a server that is already running (e.g. a GPU
box running `vllm serve MODEL`); nothing is started or stopped then. RAGLINE_LLM_MODEL names its
model (default: the first one it lists). RAGLINE_VLLM_AUTO_SETUP=0 turns the automatic install off.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request

from ragline.flows.ops.llm_server import VllmServer, source_root
from ragline.flows.ops.llm_server import start_vllm as start_packaged

REPO = source_root()


def start_vllm(port: int | None = None, timeout: float = 600) -> VllmServer:
    """The product's own start path (as `ragline quickstart` uses it), or RAGLINE_LLM_BASE_URL's server."""
    external = os.environ.get("RAGLINE_LLM_BASE_URL")
    if external:
        return _external(external.rstrip("/"), timeout)
    if os.environ.get("RAGLINE_VLLM_AUTO_SETUP", "1") == "0" and not (REPO / ".venv-vllm" / "bin" / "python").exists():
        raise RuntimeError("vLLM is not installed: run `bash deploy/vllm/setup.sh` "
                           "(or set RAGLINE_LLM_BASE_URL to a running server)")
    return start_packaged(port, timeout)


def _external(base_url: str, timeout: float) -> VllmServer:
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    deadline = time.monotonic() + timeout
    while True:
        try:
            models = _get_json(base_url + "/models")["data"]
            break
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RAGLINE_LLM_BASE_URL={base_url}: no /models answer") from None
            time.sleep(2.0)
    model = os.environ.get("RAGLINE_LLM_MODEL") or models[0]["id"]
    return VllmServer(base_url, model)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)
