"""The API test harness: a small indexed project with a scripted LLM, served by real uvicorn."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tests.helpers.data import REPO, index_and_search_yaml

TOKEN = "s3cret-api-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTION = "How is cerebral white matter development measured in newborns?"
ASK = """
  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 10}}
      - {id: sparse, task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 3}}
      - {id: insert, task: insert, with: {max_tokens: 1500}}
      - {id: answer, task: generate}
      - {id: check,  task: verify}
"""


class Script:
    """What the scripted LLM says: the answer, and the fact check's verdict (Yes keeps it)."""

    def __init__(self) -> None:
        self.answer, self.verdict = "Diffusion tensor imaging measures it [1].", "Yes"

    def __call__(self, prompt: str) -> str:
        return self.verdict if "Statement:" in prompt else self.answer


def write_project(folder: Path, llm_url: str, name: str = "pipelines.yaml") -> Path:
    """index/search over docs/ plus an ask pipeline whose LLM is ``llm_url``; the repo's prompts."""
    llm = f'  llm: {{type: openai_compatible, base_url: "{llm_url}", max_retries: 0, timeout_seconds: 10}}\n'
    text = index_and_search_yaml().replace("resources:\n", "resources:\n" + llm, 1) + ASK
    if not (folder / "prompts").exists():
        shutil.copytree(REPO / "prompts", folder / "prompts")
    path = folder / name
    path.write_text(text)
    return path


@contextmanager
def without_prefect() -> Iterator[None]:
    """No Prefect API configured while an app is created (its query service reads the URL then): the
    session's ``prefect_server`` fixture points this process at a server once any test on the worker
    used it, which would otherwise leak into apps whose tests expect none."""
    import os

    from prefect.settings import PREFECT_API_URL, temporary_settings

    saved = os.environ.pop("PREFECT_API_URL", None)
    try:
        with temporary_settings(restore_defaults={PREFECT_API_URL}):
            yield
    finally:
        if saved is not None:
            os.environ["PREFECT_API_URL"] = saved


@contextmanager
def running(app) -> Iterator[str]:
    """The app on real uvicorn, on a free loopback port, in a thread; its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    """Server-sent events as (name, data); comments skipped."""
    out = []
    for block in response.text.split("\n\n"):
        lines = [line for line in block.splitlines() if line and not line.startswith(":")]
        if lines:
            name = next((line[7:] for line in lines if line.startswith("event: ")), "message")
            data = "".join(line[6:] for line in lines if line.startswith("data: "))
            out.append((name, json.loads(data)))
    return out
