"""The Prefect task every step runs as (``run_step``): module-level, so a thread, Dask or Ray task
runner can import it; its arguments are plain data and upstream futures."""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from ragline.flows.contracts import StepResult
from ragline.flows.run import driver  # a module global: cloudpickle sends a module by name, a ContextVar not at all
from ragline.flows.run import steps
from ragline.flows.run.steps import StepCall


@task(name="step", cache_policy=NO_CACHE, persist_result=False)
def run_step(call: StepCall, inputs: dict[str, list[StepResult]]) -> Any:
    """One step of one run; Prefect has already resolved the upstream futures in ``inputs``. On a
    thread of the calling process the driver's token callback streams too (Prefect copies the
    context into its worker threads); elsewhere there is none. A step its ``when`` left out ends
    in a Completed state named "Skipped" (with the reason, in the UI and the run's logs)."""
    result = steps.execute(call, inputs, driver.DRIVER.get().on_token)
    if not result.skipped:
        return result
    get_run_logger().info("step '%s' skipped: %s", call.step, result.skipped)
    return Completed(name="Skipped", message=result.skipped, data=result)
