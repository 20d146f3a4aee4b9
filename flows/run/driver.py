"""What only the calling process can give a run (a progress bar, streamed tokens, a trace list,
each step's output as it is ready):
set in a context variable by the driver, read by the steps that run on its threads."""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class DriverHooks:
    """What only the calling process can use (a progress bar, streamed tokens, a trace list):
    never flow-run parameters, so a deployed run simply has none."""

    progress: Any = None
    on_token: Callable[[str], None] | None = None
    trace: list | None = None
    # (step id, output) of a query step as soon as it finishes, before the steps that wait for it
    # start: a surface shows an early result (the evidence answer) while the LLM still works
    on_step: Callable[[str, Any], None] | None = None


DRIVER: ContextVar[DriverHooks] = ContextVar("ragline_driver_hooks", default=DriverHooks())
