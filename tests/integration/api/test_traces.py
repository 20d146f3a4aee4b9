"""OpenTelemetry traces of queries and ingestion, exported over real OTLP/HTTP to a collector
stand-in on loopback (``tests/helpers/otlp.py``, decoded with opentelemetry-proto): one trace per
request (its id in the response headers), a span per step with stage, parameters, sizes, retrieved
ids and scores, LLM calls as child spans with model, tokens and time to first token; question,
prompt and answer text only with ``RAGLINE_TRACE_CONTENT=1``; nothing exported unless configured."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator

import httpx
import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import AUTH, QUESTION
from tests.helpers.data import scifact_records, write_jsonl
from tests.helpers.otlp import OtlpReceiver

pytestmark = pytest.mark.integration
ASK_STEPS = ["dense", "sparse", "fuse", "insert", "answer", "check"]


@pytest.fixture
def receiver(monkeypatch) -> Iterator[OtlpReceiver]:
    for name in ("RAGLINE_TRACE_CONTENT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with OtlpReceiver() as collector:
        monkeypatch.setenv("RAGLINE_OTLP_ENDPOINT", collector.url)
        yield collector


def traced_query(served: str, receiver: OtlpReceiver, **body) -> tuple[httpx.Response, list[dict]]:
    """A query and, once the request's server span has arrived, every span of its trace."""
    response = httpx.post(f"{served}/v1/query", json={"question": QUESTION, **body}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    trace_id = response.headers["x-trace-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id)
    assert response.headers["traceparent"].split("-")[1] == trace_id
    spans = receiver.wait_for(lambda: (s := receiver.trace(trace_id)) and any(x["kind"] == "SERVER" for x in s)
                              and s)
    return response, spans


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def all_text(spans: list[dict]) -> str:
    return json.dumps([s["attributes"] for s in spans], ensure_ascii=False)


def test_a_query_is_one_trace_a_span_per_step_and_llm_calls_below_their_step(served, receiver, fresh_script):
    _, spans = traced_query(served, receiver, pipeline="ask")
    named = by_name(spans)
    server = named["POST /v1/query"]
    assert server["kind"] == "SERVER" and server["parent_id"] is None and server["service"] == "ragline"
    assert server["attributes"]["http.route"] == "/v1/query"
    assert server["attributes"]["http.response.status_code"] == 200
    run = named["query ask"]
    assert run["parent_id"] == server["span_id"] and run["attributes"]["ragline.pipeline"] == "ask"
    assert run["attributes"]["ragline.question.chars"] == len(QUESTION)
    for step in ASK_STEPS:
        span = named[f"step {step}"]
        assert span["parent_id"] == run["span_id"], step
        assert span["attributes"]["ragline.step"] == step and span["attributes"]["ragline.seconds"] > 0
    dense = named["step dense"]["attributes"]
    assert dense["ragline.stage"] == "retrieve_dense" and json.loads(dense["ragline.params"])["k"] == 10
    assert dense["ragline.input.query.chars"] == len(QUESTION)
    assert dense["ragline.output.size"] == 10 and len(dense["ragline.output.ids"]) == 10
    assert "ragline.input.query.ids" not in dense
    assert all(isinstance(score, float) for score in dense["ragline.output.scores"])
    fuse = named["step fuse"]["attributes"]
    assert fuse["ragline.input.rankings.size"] == 20 and fuse["ragline.input.rankings.rankings"] == 2
    assert fuse["ragline.output.size"] == 3
    assert set(fuse["ragline.output.ids"]) <= set(dense["ragline.output.ids"]) | set(
        named["step sparse"]["attributes"]["ragline.output.ids"])
    assert named["step check"]["attributes"]["ragline.output.refused"] is False
    llm = [s for s in spans if s["name"].startswith("llm ")]
    parents = {s["parent_id"] for s in llm}
    assert named["step answer"]["span_id"] in parents and named["step check"]["span_id"] in parents
    for span in llm:
        attributes = span["attributes"]
        assert span["kind"] == "CLIENT" and attributes["gen_ai.request.model"] == "smollm2"
        assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["gen_ai.usage.output_tokens"] > 0
        assert attributes["ragline.llm.queue_wait_seconds"] >= 0
    # no question, prompt or answer text without the explicit setting
    text = all_text(spans)
    assert QUESTION not in text and fresh_script.answer not in text and "gen_ai.prompt" not in text


def test_a_streamed_answer_records_time_to_first_token(served, receiver):
    response, spans = traced_query(served, receiver, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    [stream] = [s for s in spans if s["name"] == "llm stream"]
    assert 0 < stream["attributes"]["gen_ai.response.time_to_first_token_seconds"] <= stream["seconds"]
    assert stream["parent_id"] == by_name(spans)["step answer"]["span_id"]


def test_text_is_traced_only_with_the_setting(served, receiver, fresh_script, monkeypatch):
    monkeypatch.setenv("RAGLINE_TRACE_CONTENT", "1")
    _, spans = traced_query(served, receiver, pipeline="ask")
    named = by_name(spans)
    assert named["query ask"]["attributes"]["ragline.question"] == QUESTION
    answer_llm = [s for s in spans if s["parent_id"] == named["step answer"]["span_id"]][0]["attributes"]
    assert QUESTION in answer_llm["gen_ai.prompt"] and answer_llm["gen_ai.completion"] == fresh_script.answer
    assert named["step check"]["attributes"]["ragline.output.text"] == fresh_script.answer


def test_failed_requests_carry_a_trace_id_too(served, receiver):
    response = httpx.post(f"{served}/v1/query", json={"question": QUESTION, "pipeline": "nope"}, headers=AUTH,
                          timeout=30)
    assert response.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", response.headers["x-trace-id"])


def test_nothing_is_traced_unless_configured(served, monkeypatch):
    for name in ("RAGLINE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    response = httpx.post(f"{served}/v1/query", json={"question": QUESTION, "pipeline": "search"}, headers=AUTH,
                          timeout=30)
    assert response.status_code == 200 and "traceparent" not in response.headers
    assert "x-trace-id" not in response.headers


def test_the_standard_otel_variable_is_honoured(served, monkeypatch):
    monkeypatch.delenv("RAGLINE_OTLP_ENDPOINT", raising=False)
    with OtlpReceiver() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        _, spans = traced_query(served, collector, pipeline="search")
    assert {"step dense", "step sparse", "step fuse", "query search"} <= set(by_name(spans))


def test_an_ingestion_run_is_one_trace_with_its_steps_and_batches(tmp_path, api_project, receiver):
    folder = tmp_path / "ingest"
    write_jsonl(folder / "docs" / "corpus.jsonl", scifact_records(5))
    shutil.copy(api_project, folder / "pipelines.yaml")
    shutil.copytree(api_project.parent / "prompts", folder / "prompts")
    report = engine.run(load_project(folder / "pipelines.yaml").pipeline("index"), orchestrate=False)
    assert report.added == 5
    spans = receiver.wait_for(lambda: [s for s in receiver.spans if s["name"] == "ingestion index"] and receiver.spans)
    [run] = [s for s in spans if s["name"] == "ingestion index"]
    assert run["parent_id"] is None and run["attributes"]["ragline.output.added"] == 5
    steps = {s["name"]: s for s in receiver.trace(run["trace_id"]) if s["parent_id"] == run["span_id"]}
    assert {"step load", "step write.plan", "step convert", "step chunk", "step embed", "step write",
            "step write.finalize"} <= set(steps)
    # load queues what it must read in the index state's work list and the sink hands it out a page at
    # a time (write.pending): the documents no longer travel as load's output
    assert steps["step load"]["attributes"]["ragline.output.size"] == 0 and "step write.pending" in steps
    assert steps["step embed"]["attributes"]["ragline.output.size"] >= 5
