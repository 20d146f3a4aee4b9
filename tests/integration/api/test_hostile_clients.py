"""Hostile clients over real HTTP (issue 16 items 6, 10, 13; issue 15 item 6): DNS rebinding
against the tokenless loopback API, filter bombs, bodies that are client errors (lone surrogates,
NaN, deep nesting, invalid UTF-8, huge numbers), and one error shape on every route. Real uvicorn,
the session's indexed SciFact project, the scripted LLM."""
from __future__ import annotations

import gc
import json
import time

import httpx
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, running

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenless(api_project):
    """The API as `ragline api` serves it by default: loopback, no token; /v1/ingest mounted."""
    from ragline.flows.serve.app import create_app
    from ragline.flows.serve.routers.runs import runs_router

    with running(create_app(str(api_project), routers=[runs_router(str(api_project))])) as url:
        yield url


@pytest.fixture(scope="module")
def with_ingest(api_project):
    """The token-protected API with /v1/ingest and /v1/runs mounted, as `ragline serve` has them."""
    from ragline.flows.serve.app import create_app
    from ragline.flows.serve.routers.runs import runs_router
    from tests.helpers.api_harness import TOKEN
    with running(create_app(str(api_project), token=TOKEN, routers=[runs_router(str(api_project))])) as url:
        yield url


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def assert_error_shape(response: httpx.Response, status: int, code: str | None = None,
                       param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}, body  # nothing beside it: no `detail`
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"], error
    assert error["type"] == ("server_error" if status >= 500 and status != 503 else
                             "service_unavailable_error" if status == 503 else "invalid_request_error")
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ----------------------------------------------------------------------------- item 6: Host and Origin
SEARCH = {"question": QUESTION, "pipeline": "search", "top_k": 1}


@pytest.mark.parametrize("host", [
    "attacker.example:{port}", "attacker.example", "127.0.0.1.attacker.example:{port}", "localhost.attacker.example",
    "localhost:{port}.attacker.example", "evil@127.0.0.1:{port}", "0.0.0.0:{port}", "10.0.0.1", "[::2]:{port}",
    "[::ffff:10.0.0.1]", "2130706433", "127.1", "", "localhost:{port}:{port}",
])
def test_a_foreign_host_is_refused_without_a_token(tokenless, host):
    """DNS rebinding: the page's name re-resolved to 127.0.0.1 arrives as the Host header."""
    host = host.format(port=port_of(tokenless))
    for method, path, body in (("POST", "/v1/query", SEARCH), ("GET", "/v1/models", None), ("GET", "/", None)):
        response = httpx.request(method, f"{tokenless}{path}", json=body, headers={"Host": host}, timeout=60)
        error = assert_error_shape(response, 403, "host_not_allowed")
        assert "RAGLINE_API_TOKEN" in error["message"] and "passages" not in response.text


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "127.0.0.1", "127.8.9.10:{port}", "localhost:{port}",
                                  "LocalHost", "[::1]:{port}", "[::ffff:127.0.0.1]:{port}"])
def test_loopback_hosts_are_served_without_a_token(tokenless, host):
    response = httpx.post(f"{tokenless}/v1/query", json=SEARCH, timeout=60,
                          headers={"Host": host.format(port=port_of(tokenless))})
    assert response.status_code == 200 and response.json()["passages"], response.text[:300]


@pytest.mark.parametrize("origin, allowed", [
    ("http://attacker.example", False), ("https://attacker.example:{port}", False), ("null", False),
    ("http://127.0.0.1.attacker.example", False), ("file://", False), ("http://localhost:{port}", True),
    ("http://127.0.0.1:{port}", True), ("http://[::1]:{port}", True),
])
def test_browser_requests_need_a_loopback_origin_without_a_token(tokenless, origin, allowed):
    """The chat page (served at / from 127.0.0.1) sends its own origin: it keeps working."""
    origin = origin.format(port=port_of(tokenless))
    response = httpx.post(f"{tokenless}/v1/query", json=SEARCH, headers={"Origin": origin}, timeout=60)
    if allowed:
        assert response.status_code == 200, response.text[:300]
    else:
        assert_error_shape(response, 403, "origin_not_allowed")


def test_the_chat_page_loads_and_queries_from_its_own_loopback_origin(tokenless):
    origin = tokenless  # http://127.0.0.1:PORT, as the browser sends it
    page = httpx.get(f"{tokenless}/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    models = httpx.get(f"{tokenless}/v1/models", headers={"Origin": origin, "Referer": f"{origin}/"})
    assert models.status_code == 200 and {"ask", "search"} <= {m["id"] for m in models.json()["data"]}
    asked = httpx.post(f"{tokenless}/v1/query", json={"question": QUESTION, "stream": True},
                       headers={"Origin": origin}, timeout=60)
    assert asked.status_code == 200 and "event: answer" in asked.text


def test_two_host_or_origin_headers_are_refused_without_a_token(tokenless):
    """Sent raw: HTTP clients refuse to send a Host twice, a hostile one does not."""
    import socket

    port = port_of(tokenless)
    for extra in (f"Host: 127.0.0.1:{port}\r\nHost: attacker.example", f"Host: 127.0.0.1:{port}\r\n"
                  f"Origin: http://127.0.0.1:{port}\r\nOrigin: http://attacker.example"):
        with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as sock:
            sock.sendall(f"GET /v1/models HTTP/1.1\r\n{extra}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 403") and b'"code": "host_not_allowed"' in answer, answer[:300]


def test_an_origin_allowed_by_cors_is_served_without_a_token(api_project):
    from ragline.flows.serve.app import create_app

    with running(create_app(str(api_project), cors_origins=["https://app.example"])) as url:
        allowed = httpx.post(f"{url}/v1/query", json=SEARCH, headers={"Origin": "https://app.example"}, timeout=60)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.post(f"{url}/v1/query", json=SEARCH, headers={"Origin": "https://other.example"}, timeout=60)
        assert_error_shape(other, 403, "origin_not_allowed")


def test_with_a_token_any_host_and_origin_are_served_as_before(served):
    response = httpx.post(f"{served}/v1/query", json=SEARCH, timeout=60,
                          headers={**AUTH, "Host": "rag.example.com", "Origin": "https://rag.example.com"})
    assert response.status_code == 200 and response.json()["passages"]
    assert httpx.post(f"{served}/v1/query", json=SEARCH, headers={"Host": "attacker.example"}).status_code == 401


# ----------------------------------------------------------------------------- item 10: filter bombs
def or_clauses(n: int) -> dict:
    return {"$or": [{"a": i} for i in range(n)]}


def nested_and(depth: int) -> dict:
    where: dict = {"title": {"$ne": "x"}}
    for _ in range(depth):
        where = {"$and": [where, {"title": {"$ne": "y"}}]}
    return where


BOMBS = {
    "or-8500": (or_clauses(8500), "more than 100 $and/$or branches"),
    "or-1000": (or_clauses(1000), "more than 100 $and/$or branches"),
    "or-101": (or_clauses(101), "more than 100 $and/$or branches"),
    "and-100-deep": (nested_and(100), "nested more than"),  # beyond the JSON body's 64 levels, in 'filters'
    "and-20-deep": (nested_and(20), "nested more than 8 deep"),
    "and-9-deep": (nested_and(9), "nested more than 8 deep"),
    "in-100000": ({"a": {"$in": list(range(100_000))}}, "more than 1,000 values"),
    "nin-split": ({"$or": [{"a": {"$nin": list(range(600))}}, {"b": {"$in": list(range(600))}}]},
                  "more than 1,000 values"),
    "empty-branches": ({"$or": [{}] * 101}, "more than 100 $and/$or branches"),
    "many-fields": ({f"f{i}": i for i in range(150)}, "more than 100 clauses"),
    "many-operators": ({"a": {"$gt": 1}, **{f"f{i}": {"$ne": i} for i in range(120)}}, "more than 100 clauses"),
    "big-int": ({"a": 2**70}, "fit in 64 bits"),
    "list-value": ({"a": {"$eq": [1, 2]}}, "needs a string, number or boolean"),
}


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_a_filter_bomb_is_refused_naming_filters_before_any_store(served, bomb):
    where, said = BOMBS[bomb]
    for path, body, status in (
            ("/v1/query", {"question": QUESTION, "pipeline": "search", "filters": where}, 422),
            ("/v1/query", {"question": QUESTION, "filters": where, "stream": True}, 422),
            ("/v1/chat/completions", {"model": "search", "messages": [{"role": "user", "content": QUESTION}],
                                      "filters": where}, 400)):
        started = time.perf_counter()
        response = httpx.post(f"{served}{path}", json=body, headers=AUTH, timeout=60)
        error = assert_error_shape(response, status)
        assert error["param"].startswith("filters"), error  # 'filters.a' when the body check names the value
        assert error["message"].startswith("field 'filters") and said in error["message"], error
        assert time.perf_counter() - started < 5
    assert httpx.get(f"{served}/healthz").status_code == 200  # the process lives


def test_filters_at_the_limits_are_answered(served):
    """100 clauses, 8 levels, 1,000 $in values: answered as any filter (a real user never nears them)."""
    at_limits = {"$and": [nested_and(7), {"$or": [{"title": {"$ne": f"t{i}"}} for i in range(80)]},
                          {"title": {"$nin": [f"x{i}" for i in range(1000)]}}]}
    response = httpx.post(f"{served}/v1/query", json={"question": QUESTION, "pipeline": "search", "filters": at_limits},
                          headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["passages"], response.text[:500]


def test_the_cli_refuses_a_filter_bomb_in_one_line_with_exit_2(api_project, capsys):
    from ragline.flows.cli import main

    for where in (or_clauses(10_000), nested_and(100), {"a": float("nan")}):
        text = json.dumps(where)  # NaN is written as NaN, as a user could
        assert main(["search", "q", "-f", str(api_project), "--where", text]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "filters" in lines[0], err[:500]
    deep = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser goes
    with pytest.raises(SystemExit) as exited:
        main(["search", "q", "-f", str(api_project), "--where", deep])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ragline search: error: argument --where") and "nested" in err[-1]
    assert not any("Traceback" in line for line in err)


# ----------------------------------------------------------------------------- item 13: client errors
DEEP = b'{"question": ' + b"[" * 1000 + b"]" * 1000 + b"}"
SURFACES = {
    "query": ("/v1/query", {"question": QUESTION, "pipeline": "search"}, 422),
    "chat": ("/v1/chat/completions", {"model": "search", "messages": [{"role": "user", "content": QUESTION}]}, 400),
    "ingest": ("/v1/ingest", {"pipeline": "index"}, 422),
}


def raw(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60)


def with_value(body: dict, where: str, value_json: str) -> bytes:
    """``body`` as JSON with ``value_json`` (raw JSON text) at field ``where``."""
    marker = "\u2603MARK\u2603"
    if where == "question":
        body = {**body, "question": marker} if "question" in body else body
    elif where == "filters":
        body = {**body, "filters": {"year": {"$gt": marker}}}
    elif where == "content":
        body = {**body, "messages": [{"role": "user", "content": marker}]}
    elif where == "pipeline":
        body = {**body, "pipeline": marker}
    return json.dumps(body).replace(json.dumps(marker), value_json).encode()


@pytest.mark.parametrize("surface", list(SURFACES))
def test_body_level_problems_are_a_400_naming_the_problem(with_ingest, surface):
    path, body, _ = SURFACES[surface]
    text = json.dumps(body).encode()
    cases = {
        "deep": (text[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "json_too_deep", "nested"),
        "deep-900": (text[:-1] + b', "x": ' + b"[" * 900 + b"]" * 900 + b"}", "json_too_deep", "nested"),
        "deep-70": (text[:-1] + b', "x": ' + b"[" * 70 + b"]" * 70 + b"}", "json_too_deep", "nested"),
        "utf8": (text[:-1] + b', "x": "caf\xe9"}', "invalid_utf8", "not valid UTF-8: byte 0xe9"),
        "utf8-overlong": (text[:-1] + b', "x": "\xc0\xaf"}', "invalid_utf8", "not valid UTF-8"),
        "utf8-surrogate-bytes": (text[:-1] + b', "x": "\xed\xa0\x80"}', "invalid_utf8", "not valid UTF-8"),
    }
    for name, (content, code, said) in cases.items():
        response = raw(with_ingest, path, content)
        if code == "json_too_deep" and name != "deep":  # parsed, then found too deep in field 'x'
            error = assert_error_shape(response, SURFACES[surface][2], code, param="x")
        else:
            error = assert_error_shape(response, 400, code)
        assert said in error["message"], (name, error)
        assert "There was an error parsing the body" not in error["message"]


VALUE_CASES = [  # (field to put it in, raw JSON value, code, words in the message)
    ("question", '"why \\ud800?"', "invalid_unicode", "lone surrogate (\\ud800"),
    ("question", '"\\udfff"', "invalid_unicode", "lone surrogate (\\udfff"),
    ("filters", "NaN", "invalid_number", "NaN"),
    ("filters", "Infinity", "invalid_number", "Infinity"),
    ("filters", "-Infinity", "invalid_number", "Infinity"),
    ("filters", "1e999", "invalid_number", "Infinity"),
    ("filters", "1" * 5000, "number_too_large", "5,000 digits"),
    ("filters", "-" + "9" * 25, "number_too_large", "25 digits"),
    ("filters", str(2**64), "number_too_large", "64 bits"),
]


@pytest.mark.parametrize("field, value, code, said", VALUE_CASES,
                         ids=[f"{f}-{c}-{i}" for i, (f, _, c, _) in enumerate(VALUE_CASES)])
def test_a_bad_value_is_a_4xx_naming_its_field_on_query_and_chat(served, scripted_llm, field, value, code, said):
    sent = len(scripted_llm.requests)
    for surface in ("query", "chat"):
        path, body, status = SURFACES[surface]
        where = "content" if surface == "chat" and field == "question" else field
        expected = {"question": "question", "content": "messages[0].content",
                    "filters": "filters.year.$gt"}[where]
        error = assert_error_shape(raw(served, path, with_value(body, where, value)), status, code, param=expected)
        assert error["message"].startswith(f"field '{expected}'") and said in error["message"], error
    assert len(scripted_llm.requests) == sent


def test_a_bad_value_in_an_ingest_request_names_its_field(with_ingest):
    for value, code in (('"\\ud83d"', "invalid_unicode"), ("1" * 5000, "number_too_large"), ("NaN", "invalid_number")):
        error = assert_error_shape(raw(with_ingest, "/v1/ingest", with_value({}, "pipeline", value)), 422, code,
                                   param="pipeline")
        assert error["message"].startswith("field 'pipeline'")


def cpu_costs(*calls, rounds: int = 5) -> list[float]:
    """Each call's least CPU time over interleaved rounds, in this thread only and with the
    collector paused: the machine is shared (a starved worker's wall clock says nothing) and a
    full collection of a test worker's heap lands on whichever call happens to trigger it."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for index, call in enumerate(calls):
            gc.collect()
            gc.disable()
            try:
                started = time.thread_time()
                call()
                best[index] = min(best[index], time.thread_time() - started)
            finally:
                gc.enable()
    return best


def test_the_body_check_costs_about_a_parse_not_a_walk():
    """Every JSON body is checked on the event loop: a 1 MB body of numbers or strings must cost
    about what parsing it does (a Python walk of every value took 1.6 s: a way to stall the server)."""
    from ragline.flows.serve.auth.guard import check_json

    for body in (json.dumps({"question": "q", "x": list(range(150_000))}).encode(),
                 json.dumps({"question": "q", "x": ["ab"] * 180_000, "y": "\U0001F9E0" * 1000}).encode(),
                 json.dumps({"question": "q", "x": [[{"a": [1, 2]}] * 3] * 20_000}).encode()):
        assert len(body) > 500_000
        parse, check = cpu_costs(lambda: json.loads(body), lambda: check_json(body))
        assert check < 10 * parse + 0.1, (check, parse)  # the walk of every value: 40x


def test_a_surrogate_pair_and_a_big_float_that_is_finite_are_answered(served):
    body = with_value(SURFACES["query"][1], "question", json.dumps(QUESTION + " \U0001F9E0", ensure_ascii=True))
    assert b"\\ud83e\\udde0" in body  # the escaped pair, as JSON clients send it
    assert raw(served, "/v1/query", body).status_code == 200
    finite = with_value({**SURFACES["query"][1]}, "filters", "1e300")
    assert raw(served, "/v1/query", finite).status_code == 200


# ----------------------------------------------------------------------------- issue 15 item 6: one error shape
def test_every_error_of_every_route_has_the_one_shape_with_a_code(with_ingest):
    url = with_ingest

    def post(path: str, body: dict, headers: dict = AUTH) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)

    assert_error_shape(post("/v1/query", {"question": "q"}, headers={}), 401, "invalid_api_key")
    assert_error_shape(post("/v1/query", {"question": " "}), 422, "invalid_value", "question")
    assert_error_shape(post("/v1/query", {"pipeline": "search"}), 422, "invalid_value", "question")
    assert_error_shape(post("/v1/query", {"question": "q", "pipeline": "nope"}), 404, "pipeline_not_found")
    assert_error_shape(post("/v1/query", {"question": "q", "pipeline": "index"}), 400, "not_a_query_pipeline")
    assert_error_shape(post("/v1/query", {"question": "q", "pipeline": "search", "stream": True}), 400,
                       "stream_not_supported", "stream")
    assert_error_shape(post("/v1/query", {"question": "q", "filters": {"a": {"$x": 1}}}), 422, "invalid_filter",
                       "filters")
    assert_error_shape(raw(url, "/v1/query", b'{"question": "q",'), 400, "invalid_json")
    assert_error_shape(httpx.post(f"{url}/v1/query", content=b"q=1", headers={
        **AUTH, "Content-Type": "application/x-www-form-urlencoded"}), 415, "unsupported_media_type")
    assert_error_shape(httpx.get(f"{url}/v1/query", headers=AUTH), 405, "method_not_allowed")
    assert_error_shape(httpx.get(f"{url}/v1/nowhere", headers=AUTH), 404, "not_found")
    assert_error_shape(post("/v1/query", {"question": "x" * 1_100_000}), 413, "request_too_large")
    assert_error_shape(post("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "q"}]}),
                       404, "model_not_found", "model")
    assert_error_shape(post("/v1/chat/completions", {"model": "ask", "messages": [{"role": "assistant",
                                                                                   "content": "q"}]}),
                       400, "invalid_messages", "messages")
    assert_error_shape(post("/v1/chat/completions", {"model": "ask", "messages": []}), 400, "invalid_value",
                       "messages")
    assert_error_shape(httpx.get(f"{url}/v1/models/nope", headers=AUTH), 404, "model_not_found")
    assert_error_shape(post("/v1/ingest", {"pipeline": "nope"}), 404, "pipeline_not_found", "pipeline")
    assert_error_shape(post("/v1/ingest", {"pipeline": "search"}), 400, "not_an_ingestion_pipeline", "pipeline")
    assert_error_shape(post("/v1/ingest", {"pipelin": "index"}), 422, "invalid_value", "pipelin")
    assert_error_shape(httpx.get(f"{url}/v1/runs/not-a-run", headers=AUTH), 404, "run_not_found")
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    for path in ("/v1/ingest", "/v1/runs/{run_id}", "/v1/query"):
        for status, response in schema["paths"][path][next(iter(schema["paths"][path]))]["responses"].items():
            if int(status) >= 400:
                assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse"), \
                    (path, status)


def test_not_ready_carries_the_error_shape_beside_the_checks(down_project):
    from ragline.flows.serve.app import create_app

    with running(create_app(str(down_project))) as url:
        response = httpx.get(f"{url}/readyz", timeout=30)
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready" and body["checks"]["llm"]["status"] == "down"
    assert body["error"]["code"] == "not_ready" and "llm" in body["error"]["message"]


def test_the_chat_page_answers_in_a_real_browser_without_a_token(tokenless):
    """Headless Chromium (as tests/flows/serve/test_chat_page.py) on http://127.0.0.1:PORT of a tokenless
    server: the page's own requests (with their Host and Origin) are answered, no token asked."""
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright

    from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(tokenless + "/")
            page.wait_for_selector("#pipeline option[value=ask]", state="attached")
            card = ask(page, "white matter in newborns", pipeline="search")
            assert card.locator("ol.sources li").count() >= 1
            assert not page.locator("#token-box.shown").count()
        finally:
            browser.close()
