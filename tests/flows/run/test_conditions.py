"""Conditional steps at run time (issue 21, routing), in this process (the Prefect executor's run is in
tests/integration/test_routing_prefect.py): a step whose `when` does not hold is skipped and never
called; a skipped Query->Query or Answer->Answer step passes its input on, a skipped retriever finds
nothing, and a step whose required input came only from skipped steps is skipped too. Skips are logged
and listed on the answer, not in the timings."""
from __future__ import annotations

import logging

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.contracts import (Answer, Context, ContextDocument, Label, Passage, Query, Ranking, Skipped,
                                     StepResult)
from ragline.flows.errors import ConfigError
from ragline.flows.run import engine
from ragline.flows.run.query_runner import STEP_OUTPUTS
from ragline.flows.run.steps import skipped_value
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.registry import NoParams, stage

CALLED: list[str] = []


class RouteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: list[str] = ["retrieve", "chitchat"]


@stage("test_route_word", params=RouteParams, produces="query", kind="query", labels=lambda p: p.labels)
def _route(query: Query, params: RouteParams, ctx) -> Query:
    """'hi ...' is chit-chat; anything else is retrieved for; 'nolabel' gives no label at all."""
    CALLED.append(ctx.step_id)
    if query.text == "nolabel":
        return query
    label = "chitchat" if query.text.lower().startswith("hi") else "retrieve"
    return query.model_copy(update={"labels": {**query.labels, ctx.step_id: Label(label=label, mode="test")}})


@stage("test_mark_rewrite", params=NoParams, produces="query", kind="query")
def _rewrite(query: Query, ctx) -> Query:
    CALLED.append(ctx.step_id)
    return query.model_copy(update={"variants": [query.text + " (rewritten)"]})


@stage("test_cond_retriever", params=NoParams, produces="rankings", kind="query")
def _retrieve(query: Query, ctx) -> list[Ranking]:
    CALLED.append(ctx.step_id)
    return [Ranking(retriever=ctx.step_id, query=t, passages=[Passage(chunk_id=f"{ctx.step_id}|{t}", source_id="s",
                                                                      text=t)]) for t in query.search_texts()]


@stage("test_cond_context", params=NoParams, produces="context", kind="query")
def _context(passages: list[Passage], ctx) -> Context:
    CALLED.append(ctx.step_id)
    return Context(documents=[ContextDocument(number=i, passage=p) for i, p in enumerate(passages, start=1)])


@stage("test_cond_answer", params=NoParams, produces="answer", kind="query")
def _answer(query: Query, context: Context, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return Answer(question=query.text, text=f"from {len(context.documents)} documents")


@stage("test_cond_reply", params=NoParams, produces="answer", kind="query")
def _reply(query: Query, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return Answer(question=query.text, text="hello to you" + (" (after a rewrite)" if query.variants else ""))


@stage("test_cond_check", params=NoParams, produces="answer", kind="query")
def _check(answer: Answer, context: Context, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return answer.model_copy(update={"verdict": "supported"})


ATTEMPTS: dict[str, int] = {}


@stage("test_cond_flaky_reply", params=NoParams, produces="answer", kind="query")
def _flaky_reply(query: Query, ctx) -> Answer:
    """Fails on its first attempt (a dropped LLM connection), answers on the second."""
    ATTEMPTS[ctx.step_id] = ATTEMPTS.get(ctx.step_id, 0) + 1
    if ATTEMPTS[ctx.step_id] == 1:
        raise ConnectionError("dropped")
    return Answer(question=query.text, text="hello on a retry")


ROUTED = """
pipelines:
  routed:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: rewrite, task: test_mark_rewrite, when: {step: route, label: retrieve}}
      - {id: dense,   task: test_cond_retriever, when: {step: route, label: retrieve}}
      - {id: fuse,    task: fuse}
      - {id: context, task: test_cond_context, when: {step: route, label: retrieve}}
      - {id: answer,  task: test_cond_answer, when: {step: route, label: retrieve}}
      - {id: reply,   task: test_cond_reply, after: [rewrite], when: {step: route, label: chitchat}}
      - {id: check,   task: test_cond_check, after: [answer, reply]}
  flaky:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: reply,   task: test_cond_flaky_reply, retries: 1, retry_delay_seconds: 0,
         when: {step: route, label: chitchat}}
  nested:
    kind: query
    steps:
      - {id: first,   task: test_route_word}
      - {id: route,   task: test_route_word, when: {step: first, label: retrieve}}
      - {id: reply,   task: test_cond_reply, when: {step: route, label: chitchat}}
  dead_end:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: answer,  task: test_cond_reply, when: {step: route, label: chitchat}}
"""
RETRIEVAL_BRANCH = {"rewrite", "dense", "context", "answer"}


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
