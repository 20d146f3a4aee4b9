"""flows/telemetry.py without a server: where traces go (ragline's setting, else the standard OTel
variables, else nowhere), refusal reasons folded into a fixed label set, and span attributes that
never carry text unless asked to."""
from __future__ import annotations

import pytest

from ragline.flows import telemetry
from ragline.flows.contracts import Passage, Ranking


@pytest.fixture(autouse=True)
def no_endpoints(monkeypatch):
    for name in ("RAGLINE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "RAGLINE_TRACE_CONTENT"):
        monkeypatch.delenv(name, raising=False)


def test_tracing_is_off_by_default():
    assert telemetry.traces_endpoint() is None and telemetry.tracer() is None
    with telemetry.span("x") as span:
        assert span is None
    assert telemetry.carrier() == ""


@pytest.mark.parametrize("variables, expected", [
    ({"RAGLINE_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/traces"),
    ({"RAGLINE_OTLP_ENDPOINT": "http://c:4318/v1/traces"}, "http://c:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:4318/"}, "http://o:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/traces"}, "http://t:1/traces"),
    ({"RAGLINE_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:4318"},
     "http://c:4318/v1/traces"),
])
def test_the_endpoint_comes_from_ragline_then_the_standard_variables(monkeypatch, variables, expected):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert telemetry.traces_endpoint() == expected


@pytest.mark.parametrize("reason, label", [
    ("fact check: contradicted (p=0.91)", "fact_check"), ("low confidence: 0.20 < 0.30", "low_confidence"),
    ("degenerate answer: repeats the question", "degenerate"), ("the answer cites no reference", "no_citation"),
    ("the references do not contain the answer", "not_in_references"), ("anything a user wrote", "other"),
    ("", "other"),
])
def test_refusal_reasons_fold_into_a_fixed_set(reason, label):
    assert telemetry.refusal_reason(reason) == label


def test_passages_are_described_by_ids_and_scores_never_by_text(monkeypatch):
    passages = [Passage(chunk_id=f"c{i}", source_id="s", text="secret text", score=1.0 / (i + 1)) for i in range(60)]
    rankings = [Ranking(retriever="dense", query="the user's question", passages=passages[:30]),
                Ranking(retriever="dense", query="the user's question", passages=passages[30:])]
    described = telemetry.describe_value("out", rankings)
    assert described["out.size"] == 60 and described["out.rankings"] == 2
    assert len(described["out.ids"]) == telemetry.MAX_LISTED and described["out.scores"][0] == 1.0
    assert "question" not in repr(described) and "secret" not in repr(described)
    assert telemetry.describe_value("in", rankings, listed=False) == {"in.size": 60, "in.rankings": 2}


def test_metrics_can_be_turned_off(monkeypatch):
    before = telemetry.QUERIES.labels("p-off", "answered")._value.get()
    monkeypatch.setenv("RAGLINE_METRICS", "0")
    telemetry.query_done("p-off", "answered", 0.1, [("s", 0.05)])
    assert telemetry.QUERIES.labels("p-off", "answered")._value.get() == before
    monkeypatch.setenv("RAGLINE_METRICS", "1")
    telemetry.query_done("p-off", "answered", 0.1, [("s", 0.05)])
    assert telemetry.QUERIES.labels("p-off", "answered")._value.get() == before + 1


@pytest.fixture
def recorded(monkeypatch):
    """ragline's span() on a provider whose spans are kept in memory (what an exporter would get)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracers = {"on": provider.get_tracer("t"), "off": TracerProvider(sampler=ParentBased(ALWAYS_OFF)).get_tracer("t")}
    chosen = {"tracer": tracers["on"]}
    monkeypatch.setattr(telemetry, "tracer", lambda: chosen["tracer"])
    return exporter, lambda name: chosen.update(tracer=tracers[name])


def test_a_step_span_is_the_child_of_the_parent_it_is_handed_as_plain_text(recorded):
    exporter, _ = recorded
    with telemetry.span("run", {"a": 1}, kind="SERVER") as run:
        parent = telemetry.traceparent(run)
    with telemetry.span("step", {"b": [1, 2], "none": None}, parent=parent):  # another thread, or process
        pass
    with telemetry.span("step", parent=parent):  # the parsed parent is reused: same parent again
        pass
    run_span, *steps = sorted(exporter.get_finished_spans(), key=lambda s: s.name)
    assert all(s.parent.span_id == run_span.context.span_id and s.context.trace_id == run_span.context.trace_id
               for s in steps) and len(steps) == 2
    assert run_span.kind.name == "SERVER" and dict(steps[0].attributes) == {"b": (1, 2)}
    with telemetry.span("orphan", parent="00-zz-bad-01"):  # unreadable: a new trace, as the W3C rules say
        pass
    assert exporter.get_finished_spans()[-1].parent is None


def test_attributes_are_made_only_for_a_span_that_records_and_a_failure_marks_it(recorded):
    exporter, use = recorded
    asked = []
    use("off")
    with telemetry.span("dropped", lambda: asked.append(1) or {"x": 1}) as span:
        assert not span.is_recording()
    assert asked == [] and exporter.get_finished_spans() == ()
    use("on")
    with pytest.raises(ValueError), telemetry.span("failing", lambda: asked.append(1) or {"x": 1}):
        raise ValueError("boom")
    (failed,) = exporter.get_finished_spans()
    assert asked == [1] and failed.attributes["x"] == 1 and failed.status.status_code.name == "ERROR"
    assert failed.status.description == "ValueError: boom" and failed.events[0].name == "exception"
