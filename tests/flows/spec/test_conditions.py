"""Conditional steps (issue 21, routing): a step's `when` names an earlier classify step and labels it
can give; every mistake is an error located by file, line, pipeline, step and field, found before
anything runs. Alternatives feeding one non-list input compile only when their `when`s exclude each other."""
from __future__ import annotations

import pytest

from ragline.flows.spec.compile import load_project, validate_file
from tests.helpers.data import BASE_RESOURCES

LLM = "  llm:      {type: openai_compatible, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
ROUTED = BASE_RESOURCES + LLM + """
pipelines:
  ask:
    kind: query
    steps:
      - id: route
        task: classify
        with: {labels: {retrieve: {examples: ["what is x?"]}, chitchat: {examples: [hello]}}}
      - {id: dense,  task: retrieve_dense, when: {step: route, label: retrieve}}
      - {id: fuse,   task: fuse}
      - {id: insert, task: insert}
      - {id: answer, task: generate, when: {step: route, label: [retrieve]}}
      - {id: reply,  task: answer_direct, after: [route], when: {step: route, not_label: retrieve}}
      - {id: check,  task: verify, after: [answer, reply], when: {step: route, label: retrieve}}
"""


def changed(*pairs: str) -> str:
    text = ROUTED
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def errors(make_project, text: str):
    return validate_file(make_project(text))


def test_a_routed_pipeline_compiles_with_its_conditions(make_project):
    pipeline = load_project(make_project(ROUTED)).pipeline("ask")
    assert pipeline.step("dense").when.label == ["retrieve"]
    assert pipeline.step("reply").when.not_label == ["retrieve"]
    assert pipeline.step("check").wiring["answer"] == ["answer", "reply"]  # exclusive alternatives fan in


def test_an_unknown_condition_step_is_located_with_a_suggestion(make_project):
    text = changed("when: {step: route, label: retrieve}}", "when: {step: rout, label: retrieve}}")
    [error] = errors(make_project, text)
    assert (error.line, error.pipeline, error.step, error.field) == (line_of(text, "step: rout,"), "ask", "dense",
                                                                     "when.step")
    assert "unknown step 'rout'" in error.message and "did you mean 'route'" in error.message


def test_a_label_the_classifier_cannot_give_is_located_with_the_labels(make_project):
    text = changed("label: [retrieve]}", "label: [retrieve, chit_chat]}")
    [error] = errors(make_project, text)
    assert (error.step, error.field) == ("answer", "when.label.1")
    assert error.line == line_of(text, "chit_chat")
    assert "'chit_chat' is not a label of step 'route'" in error.message
    assert "did you mean 'chitchat'" in error.message and "retrieve, chitchat" in error.message


def test_a_condition_on_a_step_that_runs_later_is_an_error(make_project):
    text = changed("- {id: dense,  task: retrieve_dense, when: {step: route, label: retrieve}}",
                   "- {id: dense,  task: retrieve_dense, when: {step: late, label: retrieve}}",
                   "      - {id: fuse,   task: fuse}",
                   "      - {id: fuse,   task: fuse}\n      - {id: late, task: classify, after: [dense], "
                   "with: {labels: {retrieve: {examples: [a]}, other: {examples: [b]}}}}")
    found = errors(make_project, text)
    assert any(e.step == "dense" and e.field == "when.step" and "step 'late' runs after step 'dense'" in e.message
               for e in found), found


def test_a_condition_on_a_step_that_gives_no_label_is_an_error(make_project):
    text = changed("when: {step: route, label: [retrieve]}", "when: {step: dense, label: [retrieve]}")
    [error] = errors(make_project, text)
    assert (error.step, error.field) == ("answer", "when.step")
    assert "step 'dense' (task 'retrieve_dense') gives no label" in error.message


def test_a_condition_on_itself_is_an_error(make_project):
    text = changed("when: {step: route, label: retrieve}}", "when: {step: dense, label: retrieve}}")
    [error] = errors(make_project, text)
    assert error.field == "when.step" and "cannot be conditioned on itself" in error.message


@pytest.mark.parametrize("when, field, words", [
    ("{step: route}", "when", "give one of 'label' or 'not_label'"),
    ("{step: route, label: retrieve, not_label: chitchat}", "when", "give one of 'label' or 'not_label'"),
    ("{step: route, label: [3]}", "when.label.0", "valid string"),
    ("{step: route, label: retrieve, if: x}", "when.if", "unknown field 'if'"),
    ("\"route.label == 'retrieve'\"", "when", "valid dictionary"),
])
def test_a_malformed_condition_is_located(make_project, when, field, words):
    text = changed("when: {step: route, label: retrieve}}", f"when: {when}}}")
    found = errors(make_project, text)
    assert any(e.step == "dense" and e.field == field and words in e.message for e in found), found
    assert all(e.line == line_of(text, "id: dense") for e in found if e.step == "dense")


def test_alternatives_that_can_both_run_cannot_feed_one_answer(make_project):
    text = changed("when: {step: route, not_label: retrieve}", "when: {step: route, not_label: chitchat}")
    [error] = errors(make_project, text)
    assert (error.step, error.field) == ("check", "after")
    assert "input 'answer' has several producers (answer, reply)" in error.message


def test_a_label_routed_to_an_undeclared_collection_is_located(make_project):
    text = changed('retrieve: {examples: ["what is x?"]}',
                   'retrieve: {examples: ["what is x?"], collections: [handbok]}') + "collections: {handbook: {}}\n"
    found = errors(make_project, text)
    assert any(e.step == "route" and e.field == "with.labels.retrieve.collections.0"
               and "unknown collection 'handbok' (did you mean 'handbook'?); the file declares handbook" in e.message
               and e.line == line_of(text, "handbok") for e in found), found
