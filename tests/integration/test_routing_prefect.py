"""Conditional steps as Prefect task runs (issue 21, routing): a step its `when` leaves out ends in a
Completed state named "Skipped" carrying the reason, its consumers get what they get in this process
(tests/flows/run/test_conditions.py; the stages: tests/helpers/routing_stages.py), and the answer lists the skipped steps."""
from __future__ import annotations

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.prefect_runs import task_runs_once
from tests.helpers.routing_stages import CALLED, RETRIEVAL_BRANCH, ROUTED

pytestmark = pytest.mark.integration


def test_skipped_steps_are_skipped_task_runs_and_the_branch_that_ran_answers(prefect_server, make_project):
    pipeline = load_project(make_project(ROUTED.replace("  routed:", "  routed_prefect:"))).pipeline("routed_prefect")
    CALLED.clear()
    answer = engine.run(pipeline, {"query": "hi there"})
    assert answer.text == "hello to you" and set(answer.skipped) == RETRIEVAL_BRANCH | {"check"}
    assert not RETRIEVAL_BRANCH & set(CALLED)
    states = task_runs_once("routed_prefect", lambda states: len(states) == len(pipeline.steps))
    skipped = {name for name, state in states.items() if state.name == "Skipped"}
    assert skipped == RETRIEVAL_BRANCH | {"check"}, {n: s.name for n, s in states.items()}
    assert all(states[name].is_completed() for name in states)
    assert "route.label in [retrieve] is false (label: chitchat)" in states["dense"].message
    assert states["reply"].name == "Completed"
