"""Conditional steps at run time (issue 21, routing), in this process (the Prefect executor's run is in
tests/integration/test_routing_prefect.py): a step whose `when` does not hold is skipped and never
called; a skipped Query->Query or Answer->Answer step passes its input on, a skipped retriever finds
nothing, and a step whose required input came only from skipped steps is skipped too. Skips are logged
and listed on the answer, not in the timings."""
from __future__ import annotations

import logging

import pytest

from ragline.flows.contracts import Answer, Query, Skipped, StepResult
from ragline.flows.errors import ConfigError
from ragline.flows.run import engine
from ragline.flows.run.query_runner import STEP_OUTPUTS
from ragline.flows.run.steps import skipped_value
from ragline.flows.spec.compile import load_project
from tests.helpers.routing_stages import ATTEMPTS, CALLED, RETRIEVAL_BRANCH, ROUTED  # its stages registered


@pytest.fixture
def routed(make_project):
    CALLED.clear()
    return load_project(make_project(ROUTED)).pipeline("routed")


def run_traced(pipeline, text: str):
    trace: list = []
    outputs: dict = {}
    token = STEP_OUTPUTS.set(outputs)
    try:
        value = engine.run(pipeline, {"query": text}, orchestrate=False, trace=trace)
    finally:
        STEP_OUTPUTS.reset(token)
    return value, dict(trace), outputs


def test_chit_chat_skips_the_retrieval_branch_and_answers_from_its_own(routed, caplog):
    with caplog.at_level(logging.INFO, logger="ragline.run"):
        answer, timings, outputs = run_traced(routed, "hi there")
    # reply's answer, passed on by the skipped check; the skipped rewrite passed the query on unchanged
    assert answer.text == "hello to you" and answer.verdict is None
    assert not RETRIEVAL_BRANCH & set(CALLED) and "check" not in CALLED  # never called
    assert set(answer.skipped) == RETRIEVAL_BRANCH | {"check"}
    assert "route.label in [retrieve] is false (label: chitchat)" in answer.skipped["dense"]
    assert answer.skipped["check"] == "input 'context' came only from skipped steps (context)"
    assert set(timings) == {"route", "fuse", "reply"}  # the timings list the steps that ran
    assert outputs["fuse"] == []  # a skipped retriever found nothing
    logged = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert any("step 'dense' skipped: route.label in [retrieve] is false" in m for m in logged), logged


def test_a_retrieval_question_skips_only_the_chit_chat_branch(routed):
    answer, timings, _ = run_traced(routed, "what is BM25?")
    assert answer.text == "from 1 documents" and answer.verdict == "supported"
    assert set(answer.skipped) == {"reply"} and "reply" not in timings
    assert RETRIEVAL_BRANCH | {"check"} <= set(CALLED)


def test_no_label_means_no_branch_and_an_error_naming_the_output_step(make_project):
    pipeline = load_project(make_project(ROUTED)).pipeline("dead_end")
    with pytest.raises(ConfigError, match=r"pipeline 'dead_end' produced no output: step 'answer' was skipped "
                                          r"\(route.label in \[chitchat\] is false \(label: none\)\)"):
        engine.run(pipeline, {"query": "nolabel"}, orchestrate=False)


def test_a_retried_attempt_of_a_conditioned_step_is_decided_again_not_skipped(make_project):
    ATTEMPTS.clear()
    pipeline = load_project(make_project(ROUTED)).pipeline("flaky")
    answer = engine.run(pipeline, {"query": "hi"}, orchestrate=False)
    assert answer.text == "hello on a retry" and ATTEMPTS["reply"] == 2 and not answer.skipped


def test_a_label_sent_by_the_client_is_not_read_by_a_condition(make_project):
    """Labels are this run's decisions: a client's are dropped, even where the classifier it names
    was itself skipped and passed the query on."""
    pipeline = load_project(make_project(ROUTED)).pipeline("nested")
    spoofed = {"text": "hi", "labels": {"route": {"label": "chitchat"}}}
    with pytest.raises(ConfigError, match=r"step 'reply' was skipped \(route.label in \[chitchat\] is false "
                                          r"\(label: none\)\)"):
        engine.run(pipeline, {"query": spoofed}, orchestrate=False)


@pytest.mark.parametrize("step, given, expected", [
    ("rewrite", {"query": Query(text="q")}, Query(text="q")),  # Query -> Query: passed on
    ("dense", {"query": Query(text="q")}, []),  # a list output: empty
    ("context", {"passages": []}, Skipped()),  # nothing of its own kind to give
    ("check", {"answer": Answer(question="q", text="a")}, Answer(question="q", text="a")),
])
def test_what_a_skipped_step_gives_its_consumers(routed, step, given, expected):
    assert skipped_value(routed.step(step), given) == expected


def test_a_skip_crosses_processes_with_its_reason():
    import pickle

    result = pickle.loads(pickle.dumps(StepResult(Skipped(), skipped="because")))
    assert result.skipped == "because" and isinstance(result.value, Skipped)
