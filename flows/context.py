"""What the engine hands a stage besides its inputs: identity, failures, prompts, progress."""
from __future__ import annotations

import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

from ragline.flows.contracts import Coverage, Failure

# When the query being run arrived (time.monotonic()); set by engine.run for in-process runs and
# carried into step threads, so shared resources can serve older queries first (see FairSlots).
QUERY_ARRIVAL: ContextVar[float | None] = ContextVar("ragline_query_arrival", default=None)

# The query vectors embedded while one query runs ((embedder, text) -> vector): a fresh dict set by
# engine.run for each query and carried into step threads like QUERY_ARRIVAL, so the steps of one
# request share an embedding (e.g. `classify`'s and `retrieve_dense`'s of the same question) and
# nothing outlives the request (no cross-request cache: no timing probe of what others asked).
QUERY_VECTORS: ContextVar[dict | None] = ContextVar("ragline_query_vectors", default=None)


@dataclass
class StepContext:
    """Per-step run context. Stages ask for it by declaring a ``ctx`` parameter."""

    pipeline: str
    step_id: str
    fingerprint: str = ""
    base_dir: str = "."
    prompt_name: str | None = None
    render_prompt: Callable[..., str] | None = None
    on_progress: Callable[[str, int], None] | None = None
    on_token: Callable[[str], None] | None = None  # streaming: generated text as it arrives
    failures: list[Failure] = field(default_factory=list)
    covered: list[Coverage] = field(default_factory=list)  # roots a source step listed completely
    seconds: float = 0.0  # wall time of the stage call, for traces and benchmarks
    project: Any = None  # the compiled Project, for stages that act on the pipelines themselves (`tune`)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"ragline.{self.pipeline}.{self.step_id}")

    def fail(self, source_id: str, reason: str, *, root: bool = False, skipped: bool = False) -> None:
        """Report a document (or path) that is skipped; the run goes on. ``root``: a root the user
        listed could not be reached, so nothing may be deleted as gone and the run must fail.
        ``skipped``: left out on purpose, so it protects nothing that was indexed from it."""
        self.logger.warning("skipped %s: %s", source_id, reason)
        with self._lock:
            self.failures.append(Failure(source_id=source_id, stage=self.step_id, reason=reason, root=root,
                                         skipped=skipped))

    def cover(self, kind: str, path: str) -> None:
        """Declare a root listed completely: indexed sources it covers that were not loaded are gone."""
        with self._lock:
            self.covered.append(Coverage(kind=kind, path=path))

    def progress(self, unit: str, count: int = 1) -> None:
        if self.on_progress is not None:
            self.on_progress(unit, count)

    def prompt_for(self, name: str, **variables: Any) -> str:
        """Render another template of the same library (e.g. a stage with several prompts)."""
        if self.render_prompt is None:
            raise RuntimeError(f"step {self.step_id!r} has no prompt library")
        return self.render_prompt(name, **variables)

    def prompt(self, **variables: Any) -> str:
        """Render this step's prompt template (StrictUndefined: a missing variable is an error)."""
        if self.render_prompt is None or self.prompt_name is None:
            raise RuntimeError(f"step {self.step_id!r} has no prompt template")
        return self.render_prompt(self.prompt_name, **variables)
