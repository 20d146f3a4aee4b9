"""Conditional steps as Prefect task runs (issue 21, routing): a step its `when` leaves out ends in a
Completed state named "Skipped" carrying the reason, its consumers get what they get in this process
(tests/flows/run/test_conditions.py; the stages: tests/helpers/routing_stages.py), and the answer lists the skipped steps."""
from __future__ import annotations

import asyncio
import time

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.routing_stages import CALLED, RETRIEVAL_BRANCH, ROUTED

pytestmark = pytest.mark.integration


def task_runs(flow_run_name: str, steps: int, within: float = 60.0) -> dict[str, object]:
    """The latest flow run of that name: its task runs' final states, by task run name (the server
    records a task run's states from events, a moment after the run returned: polled until it has)."""
    deadline = time.monotonic() + within
    while True:
        states = _task_runs(flow_run_name)
        if len(states) == steps and all(s is not None and s.is_final() for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def _task_runs(flow_run_name: str) -> dict[str, object]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter
    from prefect.client.schemas.sorting import FlowRunSort

    async def read():
        async with get_client() as client:
            [run] = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])),
                                                sort=FlowRunSort.START_TIME_DESC, limit=1)
            from prefect.client.schemas.filters import FlowRunFilterId
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
                                                task_run_filter=TaskRunFilter())
            return {t.name: t.state for t in tasks}

    return asyncio.run(read())


def test_skipped_steps_are_skipped_task_runs_and_the_branch_that_ran_answers(prefect_server, make_project):
    pipeline = load_project(make_project(ROUTED.replace("  routed:", "  routed_prefect:"))).pipeline("routed_prefect")
    CALLED.clear()
    answer = engine.run(pipeline, {"query": "hi there"})
    assert answer.text == "hello to you" and set(answer.skipped) == RETRIEVAL_BRANCH | {"check"}
    assert not RETRIEVAL_BRANCH & set(CALLED)
    states = task_runs("routed_prefect", steps=len(pipeline.steps))
    skipped = {name for name, state in states.items() if state.name == "Skipped"}
    assert skipped == RETRIEVAL_BRANCH | {"check"}, {n: s.name for n, s in states.items()}
    assert all(states[name].is_completed() for name in states)
    assert "route.label in [retrieve] is false (label: chitchat)" in states["dense"].message
    assert states["reply"].name == "Completed"
