"""Reading what a run left on Prefect's server. The server records task runs from the events their
engine sends in the background, so a run's last task runs may land after the run itself returned
(seconds on a loaded machine): readers poll until what they wait for is there."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def _newest_run(client, flow_run_name: str):
    """The newest flow run of that name, or None."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])),
                                       sort=FlowRunSort.START_TIME_DESC, limit=1)
    return runs[0] if runs else None


def latest_flow_run(flow_run_name: str):
    """The newest flow run of that name as the server has it (None if there is none)."""
    from prefect import get_client

    async def read():
        async with get_client() as client:
            return await _newest_run(client, flow_run_name)

    return asyncio.run(read())


def latest_task_runs(flow_run_name: str) -> dict[str, object]:
    """The task runs of the newest flow run of that name: their states by task run name."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            run = await _newest_run(client, flow_run_name)
            if run is None:
                return {}
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            return {t.name: t.state for t in tasks}

    return asyncio.run(read())


def task_runs_once(flow_run_name: str, recorded: Callable[[dict[str, object]], bool],
                   within: float = 60.0) -> dict[str, object]:
    """``latest_task_runs`` once ``recorded`` says all it waits for is in (or ``within`` s passed:
    the caller's assertion then says what is missing), every state final."""
    deadline = time.monotonic() + within
    while True:
        states = latest_task_runs(flow_run_name)
        final = all(s is not None and s.is_final() for s in states.values())
        if (states and final and recorded(states)) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)
