"""The driver's step-output hook (``engine.run(on_step=...)``): a surface sees a step's output as
soon as that step finishes, before the steps waiting for it start (the evidence answer before the
first generated token), and a failing or skipped step, or a failing hook, changes nothing else."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.contracts import Answer, EvidenceAnswer, Query
from ragline.flows.run import engine
from ragline.flows.run.engine import StepFailed
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.registry import stage


class FailParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail: bool = False


@stage("test_hook_evidence", params=FailParams, produces="evidence", kind="query")
def _evidence(query: Query, params: FailParams) -> EvidenceAnswer:
    if params.fail:
        raise RuntimeError("the extractor broke")
    return EvidenceAnswer(text=f"{query.text} is answered [1].", citations=[1], confidence=0.9)


@stage("test_hook_answer", produces="answer", kind="query")
def _answer(query: Query, evidence: EvidenceAnswer, ctx) -> Answer:
    for piece in ("generated ", "text"):
        ctx.on_token(piece)
    return Answer(question=query.text, text="generated text", evidence=evidence)


PIPES = """
pipelines:
  ask:
    kind: query
    steps:
      - {id: evidence, task: test_hook_evidence}
      - {id: answer,   task: test_hook_answer}
  broken:
    kind: query
    steps:
      - {id: evidence, task: test_hook_evidence, with: {fail: true}}
      - {id: answer,   task: test_hook_answer}
"""


def run(pipeline, seen: list, on_step=None):
    return engine.run(pipeline, {"query": "ragline"}, orchestrate=False, on_token=lambda t: seen.append(("token", t)),
                      on_step=on_step or (lambda step, value: seen.append((step, value))))


def test_a_steps_output_reaches_the_hook_before_the_next_step_streams(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("ask")
    seen: list = []
    answer = run(pipeline, seen)
    assert [kind for kind, _ in seen] == ["evidence", "token", "token", "answer"]
    assert isinstance(seen[0][1], EvidenceAnswer) and seen[0][1].text == "ragline is answered [1]."
    assert seen[-1][1] == answer and answer.evidence == seen[0][1]


def test_a_failed_step_hands_nothing_and_fails_the_run_as_before(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("broken")
    seen: list = []
    with pytest.raises(StepFailed, match="the extractor broke"):
        run(pipeline, seen)
    assert seen == []


def test_a_failing_hook_is_logged_and_the_run_answers(make_project, caplog):
    pipeline = load_project(make_project(PIPES)).pipeline("ask")
    seen: list = []

    def broken_hook(step: str, value) -> None:
        raise ValueError("the client went away")

    answer = run(pipeline, seen, on_step=broken_hook)
    assert answer.text == "generated text" and [t for _, t in seen] == ["generated ", "text"]
    assert "step-output hook failed on step 'evidence'" in caplog.text
