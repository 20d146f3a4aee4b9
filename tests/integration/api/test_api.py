"""The HTTP API over real uvicorn on a loopback port, real HTTP, a small indexed SciFact project and a
scripted OpenAI-compatible LLM: JSON and SSE queries, refusals, errors naming the field, the token,
the body limit, readiness per dependency, events, concurrency."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ragline.flows.run import engine
from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, events, running, without_prefect
pytestmark = pytest.mark.integration


def post(url: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json=body, headers=headers, timeout=60, **kwargs)


# ----------------------------------------------------------------------------- queries
def test_search_query_returns_passages_and_step_timings(served):
    response = post(served, {"question": QUESTION, "pipeline": "search", "top_k": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["pipeline"] == "search" and len(body["passages"]) == 3 and "answer" not in body
    assert body["passages"][0]["text"] and body["passages"][0]["score"] > 0
    assert set(body["timings"]) == {"dense", "sparse", "fuse"} and body["latency_ms"] > 0
    assert response.headers["x-request-id"]


def test_ask_query_returns_the_answer_with_sources_and_checks(served, fresh_script):
    response = post(served, {"question": QUESTION, "history": [{"role": "user", "content": "Hi"}],
                             "filters": {"title": {"$ne": "x"}}})
    assert response.status_code == 200, response.text
    body = response.json()
    answer = body["answer"]
    assert answer["text"] == fresh_script.answer and answer["verdict"] == "supported" and not answer["refused"]
    assert answer["citations"] == [1] and answer["sources"][0]["number"] == 1 and answer["sources"][0]["passage"]
    assert answer["confidence"] == pytest.approx(0.905, abs=1e-3)
    assert list(body["timings"]) == ["dense", "sparse", "fuse", "insert", "answer", "check"]


def test_streaming_sends_tokens_in_order_then_exactly_one_answer(served, fresh_script):
    fresh_script.answer = "Diffusion tensor MRI measures white matter anisotropy in newborns [1]."
    response = post(served, {"question": QUESTION, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    received = events(response)
    names = [name for name, _ in received]
    assert names[-1] == "answer" and names.count("answer") == 1 and set(names[:-1]) == {"token"}
    tokens = [data["text"] for name, data in received if name == "token"]
    assert len(tokens) == len(fresh_script.answer.split()) and "".join(tokens) == fresh_script.answer
    final = received[-1][1]
    assert final["replaced_by_refusal"] is False and final["answer"]["text"] == fresh_script.answer
    assert final["pipeline"] == "ask" and "check" in final["timings"]


def test_streamed_draft_replaced_by_refusal_is_flagged(served, fresh_script):
    fresh_script.answer, fresh_script.verdict = "Newborn brains are measured with rulers [1].", "No"
    received = events(post(served, {"question": QUESTION, "stream": True}))
    assert "".join(d["text"] for n, d in received if n == "token") == fresh_script.answer
    name, final = received[-1]
    assert name == "answer" and final["replaced_by_refusal"] is True and "discard" in final["notice"]
    assert final["answer"]["refused"] and final["answer"]["text"] == "I cannot answer this question"
    assert final["answer"]["reason"].startswith("fact check")
    plain = post(served, {"question": QUESTION}).json()
    assert plain["answer"]["refused"] and "replaced_by_refusal" not in plain


# ----------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("body, status, field", [
    ({"question": "   "}, 422, "question"),
    ({"pipeline": "search"}, 422, "question"),
    ({"question": "q", "pipeline": "nope"}, 404, "pipeline"),
    ({"question": "q", "pipeline": "index"}, 400, "pipeline"),
    ({"question": "q", "filters": {"year": {"$between": [1, 2]}}}, 422, "filters"),
    ({"question": "q", "history": [{"role": "robot", "content": "x"}]}, 422, "history[0].role"),
    ({"question": "q", "qestion": "typo"}, 422, "qestion"),
    ({"question": "q", "pipeline": "search", "stream": True}, 400, "stream"),
])
def test_bad_requests_get_a_clear_error_naming_the_field(served, body, status, field):
    response = post(served, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"field '{field}'"), error
    assert "Traceback" not in response.text


def test_malformed_json_wrong_content_type_and_no_body(served):
    url = f"{served}/v1/query"
    bad = httpx.post(url, content=b'{"question": "q",', headers={**AUTH, "Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("malformed JSON body")
    form = httpx.post(url, content=b"question=q", headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "application/json" in form.json()["error"]["message"]
    empty = httpx.post(url, headers={**AUTH, "Content-Type": "application/json"})
    assert empty.status_code == 422 and "body is missing" in empty.json()["error"]["message"]
    missing = httpx.get(f"{served}/v1/nowhere", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


def test_oversized_bodies_are_refused_before_parsing_also_when_chunked(served):
    big = json.dumps({"question": "x" * 1_100_000}).encode()
    declared = httpx.post(f"{served}/v1/query", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert declared.status_code == 413 and "1000000 bytes" in declared.json()["error"]["message"]

    def chunks():
        for start in range(0, len(big), 64_000):
            yield big[start:start + 64_000]

    chunked = httpx.post(f"{served}/v1/query", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


# ----------------------------------------------------------------------------- security
def test_token_is_required_on_every_v1_route_and_only_there(served, api_project):
    body = {"question": QUESTION, "pipeline": "search"}
    missing = post(served, body, headers={})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert post(served, body, headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
    assert post(served, body, headers={"Authorization": TOKEN}).status_code == 401
    assert httpx.get(f"{served}/v1/models").status_code == 401
    assert post(served, {"question": "q", "pipeline": "nope"}, headers={}).status_code == 401  # before the body
    assert httpx.get(f"{served}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{served}/openapi.json").status_code == 401  # with a token the docs need it too (19.2)
    schema = httpx.get(f"{served}/openapi.json", headers=AUTH).json()
    assert {"/v1/query", "/v1/chat/completions", "/v1/models", "/readyz"} <= set(schema["paths"])
    assert "question" in schema["components"]["schemas"]["QueryRequest"]["properties"]
    assert httpx.get(f"{served}/docs", headers=AUTH).status_code == 200


def test_non_loopback_without_token_refuses_to_start(api_project, monkeypatch):
    from ragline.flows.serve.app import ApiConfigError, create_app, is_loopback, serve_api

    monkeypatch.delenv("RAGLINE_API_TOKEN", raising=False)
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(ApiConfigError, match="without a token"):
            serve_api(str(api_project), host=host, port=1)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    with pytest.raises(ValueError, match="empty"):
        create_app(str(api_project), token=" ")


def test_unexpected_errors_are_generic_and_paths_never_leak(served, api_project, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError(f"disk trouble in {api_project.parent}/idx/chroma")

    monkeypatch.setattr(engine, "run", boom)
    response = post(served, {"question": QUESTION, "pipeline": "search"})
    assert response.status_code == 500 and str(api_project.parent) not in response.text
    assert response.headers["x-request-id"] in response.json()["error"]["message"]

    def invalid(*args, **kwargs):
        raise ValueError(f"pipeline 'search' of {api_project}: invalid query")

    monkeypatch.setattr(engine, "run", invalid)
    response = post(served, {"question": QUESTION, "pipeline": "search"})
    assert response.status_code == 422 and "<pipelines file>" in response.json()["error"]["message"]
    assert str(api_project) not in response.text


def test_extra_routers_share_the_token_cors_is_off_unless_given(api_project):
    from fastapi import APIRouter
    from ragline.flows.serve.app import create_app

    def crash():
        raise RuntimeError(f"secret state in {api_project.parent}")

    router = APIRouter(prefix="/v1")
    router.add_api_route("/ping", lambda: {"pong": True})
    router.add_api_route("/crash", crash)
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with running(create_app(str(api_project), token=TOKEN, routers=[router])) as url:
        assert httpx.get(f"{url}/v1/ping").status_code == 401
        assert httpx.get(f"{url}/v1/ping", headers=AUTH).json() == {"pong": True}
        crashed = httpx.get(f"{url}/v1/crash", headers=AUTH)
        assert crashed.status_code == 500 and crashed.json()["error"]["code"] == "internal_error"
        assert crashed.headers["x-request-id"] in crashed.text and "secret" not in crashed.text
        assert "access-control-allow-origin" not in httpx.options(f"{url}/v1/query", headers=preflight).headers
    with running(create_app(str(api_project), cors_origins=["https://app.example"])) as url:
        allowed = httpx.options(f"{url}/v1/query", headers=preflight)
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"


# ----------------------------------------------------------------------------- health and failures
def test_readyz_reports_every_dependency(served, down_project):
    from ragline.flows.serve.app import create_app

    ready = httpx.get(f"{served}/readyz", headers=AUTH)
    assert ready.status_code == 200, ready.text
    checks = ready.json()["checks"]
    assert checks["store"]["status"] == "up" and checks["store"]["detail"]["chunks"] > 0
    assert checks["llm"]["status"] == "up" and checks["prefect"]["status"] == "not_configured"
    with without_prefect():
        down_app = create_app(str(down_project), token=TOKEN)
    with running(down_app) as url:
        anonymous = httpx.get(f"{url}/readyz")  # probes need no token, but see no details
        assert anonymous.status_code == 503 and anonymous.json()["checks"]["llm"]["error"] is None
        down = httpx.get(f"{url}/readyz", headers=AUTH)
        assert down.status_code == 503 and down.json()["status"] == "not_ready"
        checks = down.json()["checks"]
        assert checks["llm"]["status"] == "down" and "unreachable" in checks["llm"]["error"]
        assert checks["store"]["status"] == "up" and checks["prefect"]["status"] == "not_configured"
        assert httpx.get(f"{url}/healthz").status_code == 200
        failed = post(url, {"question": QUESTION})
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
        assert "step 'insert'" in error["message"] or "step 'answer'" in error["message"]
        assert error["type"] == "service_unavailable_error" and failed.headers["x-should-retry"] == "false"
        assert str(down_project.parent) not in failed.text
        streamed = events(post(url, {"question": QUESTION, "stream": True}))
        assert [name for name, _ in streamed] == ["error"]
        assert streamed[0][1]["error"]["code"] == "dependency_unavailable"
        assert post(url, {"question": QUESTION, "pipeline": "search"}).status_code == 200  # no LLM needed


def test_an_index_of_another_embedder_is_a_503_that_says_re_embed(api_project, served):
    """The embedder was changed (e.g. adapted) and ingestion has not re-embedded yet: no silent nonsense."""
    from ragline.flows.serve.app import create_app

    other = api_project.with_name("other-embedder.yaml")
    text = api_project.read_text()
    assert "type: sentence_transformer" in text
    other.write_text(text.replace("type: sentence_transformer", "type: sentence_transformer, normalize: false", 1))
    with running(create_app(str(other), token=TOKEN)) as url:
        failed = post(url, {"question": QUESTION, "pipeline": "search"})
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
        assert error["code"] == "index_needs_reembedding" and "re-embed" in error["message"]
        assert str(api_project.parent) not in failed.text
    assert post(served, {"question": QUESTION, "pipeline": "search"}).status_code == 200  # its own embedder


def test_events_after_each_query_never_block_or_fail_it(api_project, scripted_llm, monkeypatch):
    import prefect.events
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from ragline.flows.serve.app import create_app

    sent: list[dict] = []

    def record(**event):
        sent.append(event)
        return object()

    monkeypatch.setattr(prefect.events, "emit_event", record)
    with temporary_settings(updates={PREFECT_API_URL: scripted_llm.base_url}):  # answers GET .../health
        app = create_app(str(api_project), token=TOKEN)
    with running(app) as url:
        assert post(url, {"question": QUESTION, "pipeline": "search"}).status_code == 200
        post(url, {"question": QUESTION, "pipeline": "nope"})  # refused before running: no event
        deadline = time.monotonic() + 10
        while not sent and time.monotonic() < deadline:
            time.sleep(0.05)
        event = sent[0]
        assert event["event"] == "ragline.query.completed"
        assert event["resource"]["prefect.resource.id"] == "ragline.pipeline.search"
        payload = event["payload"]
        assert payload["status"] == "answered" and payload["question_chars"] == len(QUESTION)
        assert set(payload["timings"]) == {"dense", "sparse", "fuse"} and payload["latency_ms"] > 0
        assert TOKEN not in json.dumps(event) and QUESTION not in json.dumps(event)
        assert "returned" not in payload and "principal" not in payload and payload["returned_count"] >= 1  # 39.2

        def broken(**event):
            raise ConnectionError("no Prefect")

        monkeypatch.setattr(prefect.events, "emit_event", broken)
        assert post(url, {"question": QUESTION, "pipeline": "search"}).status_code == 200
        for _ in range(100):
            ready = httpx.get(f"{url}/readyz", headers=AUTH).json()
            if ready["events"]["failed"]:
                break
            time.sleep(0.05)
        assert ready["events"] == {"emitted": 1, "failed": 1} and ready["checks"]["prefect"]["status"] == "up"
    assert len(sent) == 1


def test_twenty_concurrent_queries_all_succeed(served):
    questions = [f"{QUESTION} ({i})" for i in range(20)]

    def ask(i: int) -> httpx.Response:
        pipeline = "ask" if i % 4 == 0 else "search"
        stream = pipeline == "ask" and i % 8 == 0
        return post(served, {"question": questions[i], "pipeline": pipeline, "stream": stream})

    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(ask, range(20)))
    assert [r.status_code for r in responses] == [200] * 20
    assert all(("answer" in r.text) for r in responses[::4])


def test_server_sent_event_frames_are_exact():
    """The frames both streaming endpoints send (FastAPI's SSE framing since issue 23): compact JSON,
    unescaped text, a comment for keep-alive, and the OpenAI client's ``[DONE]`` sentinel as is."""
    from ragline.flows.serve.query_service import sse

    assert sse("token", {"text": "Ünïcode [1]"}) == 'event: token\ndata: {"text":"Ünïcode [1]"}\n\n'.encode()
    assert sse(None, {"choices": []}) == b'data: {"choices":[]}\n\n'
    assert sse("token", None) == b": keep-alive\n\n"
    assert sse(None, "[DONE]") == b"data: [DONE]\n\n"
