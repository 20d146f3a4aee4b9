"""The direct executor: wiring, fan-in, pipeline inputs, failures naming the step."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Passage, Query, Ranking
from ragline.flows.run.engine import StepFailed
from ragline.flows.spec.registry import stage


class EchoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str = "x"
    fail: bool = False


@stage("test_echo_retriever", params=EchoParams, produces="rankings", kind="query")
def _echo(query: Query, params: EchoParams) -> list[Ranking]:
    if params.fail:
        raise RuntimeError("index unavailable")
    return [Ranking(retriever=params.label, query=t, passages=[Passage(chunk_id=f"{params.label}:{t}",
                                                                         source_id=params.label, text=t)])
            for t in query.search_texts()]


@stage("test_rewrite_upper", produces="query", kind="query")
def _upper(query: Query) -> Query:
    return query.model_copy(update={"variants": [query.text.upper(), query.text.lower()]})


PIPES = """
pipelines:
  fan:
    kind: query
    steps:
      - {id: rewrite, task: test_rewrite_upper}
      - {id: a, task: test_echo_retriever, with: {label: a}}
      - {id: b, task: test_echo_retriever, with: {label: b}, after: [rewrite]}
      - {id: join, task: fuse, after: [a, b]}
  failing:
    kind: query
    steps:
      - {id: a, task: test_echo_retriever, with: {fail: true}}
      - {id: join, task: fuse}
"""


def test_nearest_producer_wiring_and_fan_in(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("fan")
    assert pipeline.step("a").wiring == {"query": ["rewrite"]}
    passages = engine.run(pipeline, {"query": "Hi"}, orchestrate=False)
    assert {p.chunk_id for p in passages} == {"a:HI", "a:hi", "b:HI", "b:hi"}


def test_query_input_accepts_text_or_object(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("fan")
    by_text = engine.run(pipeline, {"query": "Hi"}, orchestrate=False)
    by_object = engine.run(pipeline, {"query": {"text": "Hi", "history": []}}, orchestrate=False)
    assert [p.chunk_id for p in by_text] == [p.chunk_id for p in by_object]
    with pytest.raises(ValueError, match="needs a 'query' input"):
        engine.run(pipeline, {}, orchestrate=False)


def test_failure_names_pipeline_step_and_cause(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("failing")
    with pytest.raises(StepFailed, match=r"pipeline 'failing', step 'a' \(task 'test_echo_retriever'\) "
                                         r"failed: RuntimeError: index unavailable"):
        engine.run(pipeline, {"query": "x"}, orchestrate=False)


def test_overrides_change_params_without_touching_the_original(make_project):
    pipeline = load_project(make_project(PIPES)).pipeline("fan")
    changed = pipeline.with_overrides({"a": {"label": "z"}})
    assert changed.step("a").params.label == "z" and pipeline.step("a").params.label == "a"
    with pytest.raises(KeyError, match="no step"):
        pipeline.with_overrides({"nope": {}})
