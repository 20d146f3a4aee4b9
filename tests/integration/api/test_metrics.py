"""``GET /metrics`` over real uvicorn and HTTP, parsed with prometheus_client's own parser: queries
move the counters and histogram buckets of their pipeline and steps, LLM tokens and queue waits
are counted, refusals by reason, failures by step and code, the index gauges read the state DB,
labels never take a value from a request, the token rules, and the Grafana dashboard queries only
metrics the API serves."""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragline.flows.serve.app import create_app
from tests.helpers.api_harness import AUTH, QUESTION, running

pytestmark = pytest.mark.integration
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "ragline.json"


def scrape(url: str, headers=AUTH) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def query(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json={"question": QUESTION, **body}, headers=AUTH, timeout=60)


def test_queries_move_counts_and_histogram_buckets_per_pipeline_and_step(served, fresh_script):
    before = scrape(served)
    for _ in range(2):
        assert query(served, pipeline="search").status_code == 200
    assert query(served, pipeline="ask").status_code == 200
    assert query(served, pipeline="ask", stream=True).status_code == 200
    after = scrape(served)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    def moved_any_model(name: str, **labels) -> float:  # the model label: the pipelines file's model name
        models = {dict(k).get("model") for n, k in after if n == name}
        return sum(moved(name, model=m, **labels) for m in models)

    assert moved("ragline_queries_total", pipeline="search", status="answered") == 2
    assert moved("ragline_queries_total", pipeline="ask", status="answered") == 2
    assert moved("ragline_query_duration_seconds_count", pipeline="search") == 2
    assert moved("ragline_query_duration_seconds_bucket", pipeline="search", le="+Inf") == 2
    assert moved("ragline_query_duration_seconds_sum", pipeline="search") > 0
    for step in ("dense", "sparse", "fuse"):
        assert moved("ragline_step_duration_seconds_count", pipeline="search", step=step) == 2
    for step in ("answer", "check"):
        assert moved("ragline_step_duration_seconds_bucket", pipeline="ask", step=step, le="+Inf") == 2
    # a finite bucket counts only what fell under it: the buckets are cumulative and end at the count
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                     if k[0] == "ragline_step_duration_seconds_bucket"
                     and (dict(k[1])["pipeline"], dict(k[1])["step"]) == ("search", "dense"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] >= 2
    assert moved("ragline_http_requests_total", route="/v1/query", method="POST", status="200") == 4
    # the LLM: tokens as the server reported them (JSON and streamed), and every call's wait for a slot
    assert moved_any_model("ragline_llm_tokens_total", kind="prompt") > 0
    answer_words = len(fresh_script.answer.split())
    assert moved_any_model("ragline_llm_tokens_total", kind="completion") >= 2 * answer_words
    assert moved_any_model("ragline_llm_request_duration_seconds_count", call="stream") == 1
    assert moved("ragline_llm_queue_wait_seconds_count", lane="long") >= 2
    assert moved("ragline_llm_queue_wait_seconds_count", lane="short") >= 2  # the fact checks


def test_refusals_are_counted_by_reason(served, fresh_script):
    fresh_script.verdict = "No"
    before = scrape(served)
    body = query(served, pipeline="ask").json()
    assert body["answer"]["refused"] and body["answer"]["reason"].startswith("fact check")
    after = scrape(served)
    assert value(after, "ragline_refusals_total", pipeline="ask", reason="fact_check") == \
        value(before, "ragline_refusals_total", pipeline="ask", reason="fact_check") + 1
    assert value(after, "ragline_queries_total", pipeline="ask", status="refused") == \
        value(before, "ragline_queries_total", pipeline="ask", status="refused") + 1


def test_failures_are_counted_by_step_and_code(served, scripted_llm):
    before = scrape(served)
    scripted_llm.status = 500
    try:
        response = query(served, pipeline="ask")
    finally:
        scripted_llm.status = 200
    assert response.status_code == 503, response.text
    after = scrape(served)
    code = response.json()["error"]["code"]  # the label is the code the client was told
    labels = dict(pipeline="ask", step="insert", code=code)  # the insert step's /tokenize call fails first
    assert value(after, "ragline_query_errors_total", **labels) == value(before, "ragline_query_errors_total",
                                                                          **labels) + 1
    assert value(after, "ragline_queries_total", pipeline="ask", status="failed") == \
        value(before, "ragline_queries_total", pipeline="ask", status="failed") + 1


def test_index_size_and_ingestion_lag_are_read_from_the_state_db(served):
    samples = scrape(served)
    [labels] = [dict(k) for name, k in samples if name == "ragline_index_documents" and dict(k)["pipeline"] == "index"]
    assert labels["collection"] == "test"  # the store's collection, from the pipelines file
    assert value(samples, "ragline_index_documents", **labels) == 24
    assert value(samples, "ragline_index_chunks", **labels) >= 24
    lag = value(samples, "ragline_ingestion_lag_seconds", **labels)
    assert 0 < lag < 3600  # indexed by this session's fixture


def test_a_random_path_or_pipeline_name_creates_no_label_value(served):
    def route_labels() -> set[str]:
        return {dict(labels).get("route") for name, labels in scrape(served) if name == "ragline_http_requests_total"}

    before = route_labels()
    marker = uuid.uuid4().hex
    assert httpx.get(f"{served}/{marker}/x", headers=AUTH, timeout=10).status_code == 404
    assert httpx.post(f"{served}/v1/{marker}", headers=AUTH, timeout=10).status_code == 404
    assert query(served, pipeline=marker).status_code == 404
    assert httpx.get(f"{served}/v1/query?{marker}=1", headers=AUTH, timeout=10).status_code == 405
    text = httpx.get(f"{served}/metrics", headers=AUTH, timeout=10).text
    assert marker not in text
    after = route_labels()
    assert "<unmatched>" in after
    # four requests to made-up places add at most the labels of the routes they were matched to
    assert after - before <= {"<unmatched>", "<refused>", "/metrics", "/v1/query"}, after - before


def test_metrics_need_the_token_unless_opened(served, api_project, monkeypatch):
    assert httpx.get(f"{served}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{served}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    monkeypatch.setenv("RAGLINE_METRICS_PUBLIC", "1")
    with running(create_app(str(api_project), token="t0k", warm_up=False)) as url:
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        assert httpx.post(f"{url}/v1/query", json={"question": "q"}, timeout=10).status_code == 401
    monkeypatch.setenv("RAGLINE_METRICS", "0")
    with running(create_app(str(api_project), token="t0k", warm_up=False)) as url:
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer t0k"}, timeout=10).status_code == 404


def test_without_a_token_metrics_answer_loopback_names_only(api_project):
    with running(create_app(str(api_project), warm_up=False)) as url:
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        refused = httpx.get(f"{url}/metrics", headers={"Host": "attacker.example"}, timeout=10)
        assert refused.status_code == 403


def test_the_grafana_dashboard_queries_only_served_metrics(served):
    query(served, pipeline="ask")  # every family has samples by now (the tests above ran queries)
    response = httpx.get(f"{served}/metrics", headers=AUTH, timeout=30)
    served_names = set()
    for family in text_string_to_metric_families(response.text):
        served_names.add(family.name)
        served_names.update(s.name for s in family.samples)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 8
    queried = {name for expr in exprs for name in re.findall(r"\b(ragline_[a-z_]+)", expr)}
    assert queried and queried <= served_names, f"not served: {sorted(queried - served_names)}"
