"""A hung LLM server (accepts connections, never answers), as a user meets it: `ragline ask` with
the default settings says it is waiting, then fails naming the endpoint well under a minute (it
used to take 497 s: 120 s x 4 attempts, silent); the API fails the query as 503 within the LLM's
``hung_after_seconds``, answers other requests meanwhile, and the next query once the server is back."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, Script, running, write_project
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration  # the API on uvicorn, and `ragline ask` waiting the default 20 s


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json=body, headers=AUTH, timeout=60)


def test_a_hung_llm_fails_the_query_quickly_and_the_api_recovers_with_it(api_project):
    from ragline.flows.serve.app import create_app

    with ScriptedLLM(Script(), hung=True) as llm:
        path = write_project(api_project.parent, llm.base_url, name="hung.yaml")
        path.write_text(path.read_text().replace("timeout_seconds: 10}", "timeout_seconds: 10, hung_after_seconds: 2}"))
        with running(create_app(str(path), token=TOKEN)) as url:
            started = time.perf_counter()
            failed = post(url, {"question": QUESTION})
            assert time.perf_counter() - started < 8, "reported in about hung_after_seconds (2 s)"
            assert failed.status_code == 503, failed.text
            error = failed.json()["error"]
            assert error["code"] == "dependency_unavailable" and failed.headers["x-should-retry"] == "false"
            assert "LLM endpoint" in error["message"] and "has not answered" in error["message"]
            assert "nor its health check" in error["message"]
            # the API itself is not stuck: other requests are answered while the LLM hangs
            assert httpx.get(f"{url}/healthz").status_code == 200
            assert post(url, {"question": QUESTION, "pipeline": "search"}).status_code == 200
            llm.hung = False  # the LLM is back
            answered = post(url, {"question": QUESTION})
            assert answered.status_code == 200, answered.text
            assert answered.json()["answer"]["text"] == Script().answer


def test_ragline_ask_reports_a_hung_llm_well_under_a_minute_by_default(api_project):
    with ScriptedLLM(Script(), hung=True) as llm:
        path = write_project(api_project.parent, llm.base_url, name="hung_defaults.yaml")
        path.write_text(path.read_text().replace(", max_retries: 0, timeout_seconds: 10", ""))  # the defaults
        script = shutil.which("ragline", path=os.path.dirname(sys.executable))
        env = {**os.environ, "RAGLINE_START_LLM": "0"}
        command = subprocess.Popen([script, "ask", "-f", str(path), QUESTION], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while not llm.requests and command.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            first_request = time.monotonic()  # the command has started and is waiting for the LLM
            _, stderr = command.communicate(timeout=120)
            waited = time.monotonic() - first_request
        finally:
            if command.poll() is None:
                command.kill()
                command.wait()
    assert command.returncode == 1, stderr
    assert waited < 30, f"{waited:.0f} s: {stderr}"  # hung_after_seconds: 20
    waiting, error = stderr.index("checking that it is up"), stderr.index("error: ")
    assert waiting < error and stderr.count("checking that it is up") == 1  # once, while the user waits
    assert f"LLM endpoint {llm.base_url} (model 'smollm2') accepted the request" in stderr
    # 20 s (hung_after_seconds) and the health check's own wait: a second more on a loaded machine
    assert re.search(r"has not answered in 2[0-9] s, nor its health check", stderr), stderr
    assert len({json.dumps(r) for r in llm.requests}) == len(llm.requests)  # nothing was retried
