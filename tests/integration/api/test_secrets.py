"""Secrets (issue 9): no secret (the LLM's API key, the API's bearer token) appears in logs, errors,
flow-run parameters or events.

The LLM key is configured the way a deployment does it, ``api_key: "${RAGLINE_TEST_LLM_KEY}"`` in
pipelines.yaml, and checked by a scripted OpenAI-compatible server that answers 401 to any other
key. Faults are provoked (the LLM down, refusing the key, failing with 5xx) through every API
surface, with every logger at DEBUG (httpx, openai, uvicorn, ragline); the responses, the log
records with their tracebacks and the process output are searched for each secret. Orchestrated
runs go through a real Prefect API: flow runs, task runs, logs and events are read back from it.
The API's token comparison is checked by its behaviour: every wrong token, whatever its length or
shared prefix, gets the same 401, and the comparison sees equal-length digests."""
from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from pathlib import Path

import httpx
import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.api_harness import QUESTION, running, write_project
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

LLM_KEY = "sk-ragline-LLMKEY-0d1e2f3a4b5c6d7e8f9a"  # the LLM's API key, from the environment
WRONG_KEY = "sk-ragline-WRONGKEY-77aa88bb99cc00dd"  # a key the LLM refuses: a secret too
API_TOKEN = "tok-ragline-APITOKEN-5e6f7a8b9c0d1e2f"  # the ragline API's bearer token
SECRETS = (LLM_KEY, WRONG_KEY, API_TOKEN)
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
ANSWER = "Diffusion tensor imaging measures it [1]."


class KeyedLLM(ScriptedLLM):
    """The scripted LLM behind a key: a request without ``Bearer <key>`` gets 401 (and says nothing
    of the key it got); ``auth`` lists the Authorization header of every request."""

    def __init__(self, key: str, **kwargs):
        super().__init__(lambda p: "Yes" if "Statement:" in p else ANSWER, **kwargs)
        self.auth: list[str | None] = []
        server, handler = self, self.httpd.RequestHandlerClass

        class Checked(handler):
            def do_POST(self):
                server.auth.append(self.headers.get("Authorization"))
                if self.headers.get("Authorization") != f"Bearer {key}":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self._send(401, {"error": {"message": "Incorrect API key provided.",
                                               "type": "invalid_request_error", "code": "invalid_api_key"}})
                    return
                super().do_POST()

        self.httpd.RequestHandlerClass = Checked


@pytest.fixture(scope="module")
def keyed_llm():
    with KeyedLLM(LLM_KEY, chunk_delay=0.002) as llm:
        yield llm


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("RAGLINE_TEST_LLM_KEY", LLM_KEY)
    monkeypatch.setenv("RAGLINE_TEST_WRONG_KEY", WRONG_KEY)


def keyed_project(folder: Path, url: str, name: str, variable: str = "RAGLINE_TEST_LLM_KEY") -> Path:
    """The session's indexed project (same indexes) with its LLM at ``url`` and the key from the environment."""
    path = write_project(folder, url, name=name)
    text = path.read_text().replace("max_retries: 0,", f'max_retries: 1, api_key: "${{{variable}}}",', 1)
    assert f"${{{variable}}}" in text
    path.write_text(text)
    return path


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            at = text.find(secret)
            assert at < 0, f"a secret ({secret[:14]}...) leaked: ...{text[max(0, at - 300):at + 60]}..."
            assert secret[8:] not in text  # nor most of it


def exchange(url: str) -> list[httpx.Response]:
    """Every API surface once: ask (JSON, SSE), chat (JSON, SSE), search, readiness with and
    without the token, and wrong tokens (one of them the LLM's key)."""
    ask, chat = {"question": QUESTION}, {"model": "ask", "messages": [{"role": "user", "content": QUESTION}]}
    post = lambda path, body, headers=AUTH: httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
    responses = [post("/v1/query", ask), post("/v1/query", {**ask, "stream": True}),
                 post("/v1/chat/completions", chat), post("/v1/chat/completions", {**chat, "stream": True}),
                 post("/v1/query", {**ask, "pipeline": "search"}),
                 httpx.get(f"{url}/readyz", headers=AUTH, timeout=30), httpx.get(f"{url}/readyz", timeout=30)]
    for wrong in (API_TOKEN[:-1], API_TOKEN + "x", API_TOKEN.upper(), LLM_KEY):
        responses.append(post("/v1/query", ask, {"Authorization": f"Bearer {wrong}"}))
    return responses


def dump(response: httpx.Response) -> str:
    return f"{response.status_code} {json.dumps(dict(response.headers))} {response.text}"


# ----------------------------------------------------------------------------- logs and errors
FAULTS = ["answers", "llm_down", "llm_refuses_the_key", "llm_5xx"]


@pytest.mark.parametrize("fault", FAULTS)
def test_no_secret_in_responses_logs_or_output_whatever_fails(api_project, keyed_llm, keys, caplog, capfd, fault):
    from ragline.flows.serve.app import create_app

    url = {"llm_down": f"http://127.0.0.1:{closed_port()}/v1"}.get(fault, keyed_llm.base_url)
    variable = "RAGLINE_TEST_WRONG_KEY" if fault == "llm_refuses_the_key" else "RAGLINE_TEST_LLM_KEY"
    path = keyed_project(api_project.parent, url, f"secret_{fault}.yaml", variable)
    keyed_llm.auth.clear()
    keyed_llm.status = 500 if fault == "llm_5xx" else 200
    caplog.set_level(logging.DEBUG)  # every logger: httpx, httpcore, openai, uvicorn, ragline
    try:
        with running(create_app(str(path), token=API_TOKEN)) as served:
            responses = exchange(served)
    finally:
        keyed_llm.status = 200
    out, err = capfd.readouterr()
    assert_no_secret(*map(dump, responses), caplog.text, out, err)

    # the fault really happened, was logged, and the key was really configured and sent
    statuses = [r.status_code for r in responses]
    assert statuses[4] == 200 and statuses[-4:] == [401] * 4  # search needs no LLM; wrong tokens refused
    ask_status = {"answers": 200, "llm_down": 503, "llm_refuses_the_key": 500, "llm_5xx": 503}[fault]
    assert statuses[0] == statuses[2] == ask_status, [r.text[:300] for r in responses[:4]]
    logged = caplog.text
    if fault == "answers":
        assert responses[0].json()["answer"]["text"] == ANSWER and responses[5].json()["status"] == "ready"
    elif fault == "llm_down":
        assert "did not answer after 2 attempts" in logged and "APIConnectionError" in logged
    elif fault == "llm_refuses_the_key":
        assert "refused the request" in logged and "(HTTP 401)" in logged and "Incorrect API key provided" in logged
    else:
        assert "InternalServerError" in logged and "retrying in" in logged
    if fault != "llm_down":
        sent = {f"Bearer {WRONG_KEY if fault == 'llm_refuses_the_key' else LLM_KEY}"}
        assert set(keyed_llm.auth) == sent  # every request carried the configured key
    assert "ragline.api" in {r.name for r in caplog.records} or fault == "answers"
    assert any(r.name.startswith(("httpx", "httpcore", "openai")) for r in caplog.records)  # DEBUG was on


def test_no_secret_in_command_line_errors(api_project, keyed_llm, keys, capsys, caplog):
    """``ragline ask`` with the LLM refusing the key, then down: one clear line, no key."""
    from ragline.flows.cli import main

    refused = keyed_project(api_project.parent, keyed_llm.base_url, "secret_cli.yaml", "RAGLINE_TEST_WRONG_KEY")
    down = keyed_project(api_project.parent, f"http://127.0.0.1:{closed_port()}/v1", "secret_cli_down.yaml")
    caplog.set_level(logging.DEBUG)
    assert main(["ask", QUESTION, "-f", str(refused)]) == 1
    first = capsys.readouterr()
    assert "HTTP 401" in first.err
    assert main(["ask", QUESTION, "-f", str(down)]) == 1
    second = capsys.readouterr()
    assert "did not answer" in second.err
    assert_no_secret(first.out, first.err, second.out, second.err, caplog.text)


def test_a_key_that_is_not_a_string_is_not_echoed_by_validate(tmp_path, capsys):
    """YAML reads ``api_key: 271828182845904523`` as a number: the error names the field, not the value
    (it said "Input should be a valid string (got 271828182845904523)")."""
    from ragline.flows.cli import main

    numeric = "271828182845904523"
    (tmp_path / "pipelines.yaml").write_text(f"""
resources:
  llm: {{type: openai_compatible, base_url: "http://127.0.0.1:9/v1", api_key: {numeric}}}
pipelines:
  ask:
    kind: query
    steps:
      - {{id: answer, task: generate}}
""")
    assert main(["validate", "-f", str(tmp_path / "pipelines.yaml")]) == 2  # bad configuration (issue 24)
    err = capsys.readouterr().err
    assert "field 'resources.llm.api_key': Input should be a valid string" in err
    assert numeric not in err and numeric[5:] not in err


# ----------------------------------------------------------------------------- the token comparison
def test_every_wrong_token_gets_the_same_401_and_a_constant_time_comparison(api_project, monkeypatch):
    """Tokens of every length from 0 to twice the real one's, and tokens sharing a prefix of every
    length with it, all get byte-identical 401s; each request is one comparison of two equal-length
    digests, whatever was sent (so its time says nothing of how much of the token was right)."""
    from ragline.flows.serve.app import create_app

    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    wrong = [("x" * n) for n in range(1, 2 * len(API_TOKEN) + 1)]
    wrong += [API_TOKEN[:n] + "#" + API_TOKEN[n + 1:] for n in range(len(API_TOKEN))]  # one character wrong
    wrong += [API_TOKEN[:n] for n in range(1, len(API_TOKEN))] + [API_TOKEN + "x", " " + API_TOKEN, API_TOKEN.lower()]
    bodies, headers = set(), set()
    with running(create_app(str(api_project), token=API_TOKEN)) as url, httpx.Client(timeout=30) as client:
        for token in wrong:
            response = client.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 401, token
            bodies.add(response.content)
            headers.add(tuple(sorted((k, v) for k, v in response.headers.items() if k not in ("x-request-id", "date"))))
        compared_wrong = list(compared)
        assert client.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert len(bodies) == 1 and len(headers) == 1
    assert API_TOKEN.encode() not in next(iter(bodies))
    assert len(compared_wrong) == len(wrong) and set(compared_wrong) == {(32, 32)}


# ----------------------------------------------------------------------------- Prefect: parameters, runs, logs, events
@pytest.fixture(scope="module")
def prefect_api(prefect_server):
    """The session's test-harness server (tests/integration/conftest.py): no second one for this module."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value().rstrip("/")


@pytest.fixture
def captured_events(monkeypatch):
    """Every event this process emits (Prefect's task-run events, ragline's query events), kept by
    Prefect's asserting client, which also sends them on to the API; a flow run's end stops the
    worker, the next event starts another."""
    from prefect.events.clients import AssertingPassthroughEventsClient
    from prefect.events.worker import EventsWorker

    instance = EventsWorker.instance
    AssertingPassthroughEventsClient.reset()
    monkeypatch.setattr(EventsWorker, "instance", lambda *args, **kwargs: instance(AssertingPassthroughEventsClient))

    def events() -> list:
        instance(AssertingPassthroughEventsClient).drain()
        return [event for client in AssertingPassthroughEventsClient.all for event in getattr(client, "events", [])]

    yield events
    instance(AssertingPassthroughEventsClient).drain()
    AssertingPassthroughEventsClient.reset()


def read_back(api: str, since: str) -> dict[str, list]:
    """What the Prefect API stores since ``since``: flow runs, task runs, logs, events, deployments."""
    with httpx.Client(base_url=api, timeout=30) as client:
        got = {"flow_runs": client.post("/flow_runs/filter", json={}).json(),
               "task_runs": client.post("/task_runs/filter", json={}).json(),
               "logs": client.post("/logs/filter", json={"logs": {"timestamp": {"after_": since}}}).json(),
               "deployments": client.post("/deployments/filter", json={}).json()}
        page = client.post("/events/filter", json={"filter": {"occurred": {"since": since}}, "limit": 50}).json()
        got["events"] = list(page["events"])
        while page.get("next_page") and len(got["events"]) < 1000:
            page = client.get(page["next_page"]).json()
            got["events"] += page["events"]
    return got


def test_no_secret_in_flow_run_parameters_task_runs_logs_or_events(api_project, keyed_llm, keys, prefect_api,
                                                                   captured_events, caplog):
    """An orchestrated ask run that answers, one whose LLM refuses the key, and the API's query
    events: the key is in none of what Prefect records; a flow run carries the file path only."""
    import datetime

    from ragline.flows.serve.app import create_app
    from ragline.flows.serve.supervise.service import build_deployments, deployment_options

    since = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)).isoformat()
    good = keyed_project(api_project.parent, keyed_llm.base_url, "secret_flow.yaml")
    refused = keyed_project(api_project.parent, keyed_llm.base_url, "secret_flow_401.yaml", "RAGLINE_TEST_WRONG_KEY")
    caplog.set_level(logging.DEBUG)
    keyed_llm.auth.clear()
    answer = engine.run(load_project(good).pipeline("ask"), {"query": QUESTION})  # a flow run of run_pipeline
    assert answer.text == ANSWER and keyed_llm.auth and set(keyed_llm.auth) == {f"Bearer {LLM_KEY}"}
    with pytest.raises(engine.StepFailed, match=r"HTTP 401"):
        engine.run(load_project(refused).pipeline("ask"), {"query": QUESTION})
    app = create_app(str(good), token=API_TOKEN)
    with running(app) as url:  # its query events go to this Prefect API
        assert httpx.post(f"{url}/v1/query", json={"question": QUESTION}, headers=AUTH, timeout=60).status_code == 200
    events, deadline = app.state.service.events, time.monotonic() + 60
    while events.emitted + events.failed == 0 and time.monotonic() < deadline:  # sent on a background thread
        time.sleep(0.1)
    assert (events.emitted, events.failed) == (1, 0)

    # what `ragline serve` would deploy: every pipeline's parameters are the file path (no key)
    project = load_project(good)
    options = deployment_options(project)
    assert {name: set(o["parameters"]) for name, o in options.items()} == \
        {name: {"pipeline", "file"} for name in project.pipelines}
    deployments = [d.model_dump(mode="json") for d in build_deployments(good)]
    clear_cache()

    deadline = time.monotonic() + 120
    while True:  # the server records events and logs a moment after they arrive (later on a loaded machine)
        stored = read_back(prefect_api, since)
        recorded = any(e["event"] == "prefect.flow-run.Failed" for e in stored["events"]) and stored["logs"]
        if (recorded and stored["task_runs"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ours = [r for r in stored["flow_runs"] if r["parameters"].get("file") in (str(good), str(refused))]
    assert {r["state_type"] for r in ours} == {"COMPLETED", "FAILED"}
    for run in ours:
        assert set(run["parameters"]) <= {"pipeline", "inputs", "file", "overrides", "resources", "data_dir",
                                          "digest"}
        assert run["parameters"]["resources"] == {}  # no resource setting travels as a parameter
    failed = next(r for r in ours if r["state_type"] == "FAILED")
    assert "HTTP 401" in json.dumps(stored["task_runs"]) + json.dumps(failed)  # the error is recorded...
    events = [e.model_dump(mode="json") for e in captured_events()]
    names = {e["event"] for e in events}
    assert "ragline.query.completed" in names and any(n.startswith("prefect.task-run.") for n in names)
    assert stored["logs"] and stored["task_runs"]
    assert {"prefect.flow-run.Completed", "prefect.flow-run.Failed"} <= {e["event"] for e in stored["events"]}
    assert_no_secret(json.dumps(stored), json.dumps(events), json.dumps(deployments, default=str),
                     json.dumps(options, default=str), caplog.text)  # ...without the key
