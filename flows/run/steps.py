"""Running one step anywhere: this thread, a worker thread, or a Dask/Ray worker process.

A step travels as a ``StepCall``: plain data naming the pipelines file, the pipeline (with its
overrides), the step and the run's fingerprint. The process that runs it compiles the file once
(or finds the driver's own compiled pipeline when it is the same process), looks its resources
up by name (one model per process, loaded once) and returns a ``StepResult``: the value, with the
failures and timings it reported. Nothing here holds locks, closures or weak references, so a
call and its inputs pickle.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import re
import threading
import time
import typing
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ragline.flows import telemetry
from ragline.flows.files import write_atomic
from ragline.flows.spec.compile import CompiledPipeline, CompiledStep, load_project
from ragline.flows.context import StepContext
from ragline.flows.contracts import Query, Ranking, Skipped, StepResult
from ragline.flows.contracts import COLLECTION_KEY
from ragline.flows.errors import RaglineError


class StepFailed(RaglineError, RuntimeError):
    """A stage raised ``cause``; the message names the pipeline, step and stage. The API answers
    by the cause's class when it declares a client-facing status (a bad filter, an unavailable
    LLM or index), else with this class's: the step's name, the details in the log."""

    error_code = "step_failed"

    def __init__(self, pipeline: str | None, step: str, stage: str, cause: BaseException | None = None):
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"{self.where_of(pipeline, step, stage)} failed{detail}")
        self.pipeline, self.step, self.stage = pipeline, step, stage
        self.__cause__ = cause

    @staticmethod
    def where_of(pipeline: str | None, step: str, stage: str) -> str:
        return (f"pipeline '{pipeline}', " if pipeline else "") + f"step '{step}' (task '{stage}')"

    @property
    def where(self) -> str:
        """``pipeline 'p', step 's' (task 't')``: what a client may be told of the failed step."""
        return self.where_of(self.pipeline, self.step, self.stage)

    @property
    def cause(self) -> BaseException | None:
        """What the stage raised (None once the error crossed a process: causes do not pickle, unless
        tblib's exception pickling is installed, as Dask's `distributed` does)."""
        return self.__cause__


class StepTimedOut(StepFailed):
    """An attempt of a step ran past its ``timeout_seconds``."""

    http_status = 504
    error_code = "step_timeout"

    def __init__(self, pipeline: str | None, step: str, stage: str, seconds: float):
        RaglineError.__init__(self, f"{self.where_of(None, step, stage)} timed out after {seconds:g} s")
        self.pipeline, self.step, self.stage, self.seconds = pipeline, step, stage, seconds


@dataclass(frozen=True)
class PipelineRef:
    """How any process finds a compiled pipeline: the file plus what the driver changed in memory."""

    file: str
    pipeline: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    data_dir: str | None = None
    digest: str = ""  # of the file's text: a worker never runs a step of an edited file
    source: str | None = None  # the pinned copy of the file's text (``ragline serve``), read instead of ``file``

    @classmethod
    def of(cls, pipeline: CompiledPipeline) -> "PipelineRef":
        project = pipeline.project
        source = str(project.source) if project.source else None
        ref = cls(str(project.path), pipeline.name, _plain(pipeline.overrides), _plain(project.resource_overrides),
                  str(project.data_dir) if project.data_dir else None, digest_of(project.source or project.path),
                  source)
        _remember(ref.key, pipeline)  # this process needs no recompiling
        return ref

    @property
    def key(self) -> str:
        return json.dumps([self.file, self.digest, self.pipeline, self.overrides, self.resources, self.data_dir,
                           self.source], sort_keys=True, default=str)

    def resolve(self) -> CompiledPipeline:
        """The compiled pipeline in this process: the driver's own object, else compiled once from the file."""
        with _lock:
            live = _LIVE.get(self.key)
        if live is not None:
            return live
        if self.digest and digest_of(Path(self.source or self.file)) != self.digest:
            raise RuntimeError(f"{self.source or self.file} changed since this run started; run it again")
        project = load_project(self.file, source=self.source)
        for name, fields in self.resources.items():
            project = project.with_resource(name, **fields)
        if self.data_dir:
            project = project.relocated(Path(self.data_dir))
        pipeline = project.pipeline(self.pipeline).with_overrides(self.overrides)
        _remember(self.key, pipeline)
        return pipeline


_LIVE: OrderedDict[str, CompiledPipeline] = OrderedDict()
_LIVE_LIMIT = 64
_lock = threading.Lock()


def _remember(key: str, pipeline: CompiledPipeline) -> None:
    with _lock:
        _LIVE[key] = pipeline
        _LIVE.move_to_end(key)
        while len(_LIVE) > _LIVE_LIMIT:
            _LIVE.popitem(last=False)


def digest_of(path: Path) -> str:
    """What identifies a pipelines file's content across processes (its env-expanded values aside)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


SERVED_DIR = Path(".ragline") / "served"  # under the data dir: the pipelines files `ragline serve` pinned
_DIGEST = re.compile(r"[0-9a-f]{16}")


def pin_file(file: str | Path, data_dir: str | Path | None = None) -> Path:
    """Copy a pipelines file's text to ``<data dir>/.ragline/served/<digest>.yaml`` (once per
    content) and return the copy: what ``ragline serve`` compiles for its API, and what every run
    of its deployments reads, so an edit of the file never splits the two (restart to apply it)."""
    path = Path(file).resolve()
    text = path.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:16]
    pinned = served_copy(path, data_dir, digest)
    if not pinned.is_file() or digest_of(pinned) != digest:
        write_atomic(pinned, text)
    return pinned


def served_copy(file: str | Path, data_dir: str | Path | None, digest: str) -> Path:
    """Where ``pin_file`` keeps the text with this digest (the data dir defaults to the file's folder)."""
    if not _DIGEST.fullmatch(digest or ""):
        raise ValueError(f"parameter 'digest': {digest!r} is not a pipelines-file digest (16 hex digits)")
    return Path(data_dir or Path(file).resolve().parent).resolve() / SERVED_DIR / f"{digest}.yaml"


def _plain(value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """JSON-shaped copy (paths and the like as strings), so the reference is a flow-run parameter too."""
    return json.loads(json.dumps(value, default=str))


@dataclass(frozen=True)
class StepCall:
    """One step (or one of its sink hooks) of one run, as plain data."""

    pipeline: PipelineRef
    step: str
    fingerprint: str = ""
    hook: str | None = None  # "plan", "finalize" or "session" of an ingestion sink
    parent: str = ""  # the run's span as a W3C traceparent ("" untraced): the step's span is its child


def execute(call: StepCall, inputs: dict[str, list[StepResult]],
            on_token: Callable[[str], None] | None = None) -> StepResult:
    """Run the step on resolved inputs: each port's producers' values (one, or several lists joined)."""
    pipeline = call.pipeline.resolve()
    step = pipeline.step(call.step)
    ctx = StepContext(pipeline=pipeline.name, step_id=step.id, fingerprint=call.fingerprint,
                      base_dir=str(pipeline.project.base_dir), prompt_name=step.prompt,
                      render_prompt=pipeline.project.prompts.render, on_token=on_token, project=pipeline.project)
    inputs = dict(inputs)  # a retried attempt gets the same mapping: left as it came
    decider = inputs.pop(WHEN_INPUT, None) if call.hook is None else None
    values = {port: _value_of(results) for port, results in inputs.items()}
    skipped = skip_reason(step, decider, values) if call.hook is None else ""
    if skipped:
        _LOG.info("pipeline '%s': step '%s' skipped: %s", pipeline.name, step.id, skipped)
        with telemetry.span(f"step {step.id}", parent=call.parent, attributes=lambda: {
                **_constant_attributes(pipeline, step), "ragline.skipped": skipped}):
            return StepResult(skipped_value(step, values), skipped=skipped)
    values = {port: value for port, value in values.items() if value is not _NOTHING}  # optional, unfed
    hook = getattr(step.stage, call.hook) if call.hook else None
    with telemetry.span(f"step {step.id}" + (f".{call.hook}" if call.hook else ""), parent=call.parent,
                        attributes=lambda: _step_attributes(pipeline, step, call, values)) as span:
        value = invoke(pipeline, step, values, ctx, hook=hook)
        if span is not None and span.is_recording():  # not when a sampler left this trace out
            done = {"ragline.seconds": ctx.seconds, "ragline.failures": len(ctx.failures)}
            span.set_attributes(telemetry.clean({**telemetry.describe_value("ragline.output", value), **done}))
    return StepResult(value, ctx.failures, ctx.covered, ctx.seconds)


def _step_attributes(pipeline: CompiledPipeline, step: CompiledStep, call: StepCall,
                     values: dict[str, Any]) -> dict[str, Any]:
    """What a step's span says before it runs: stage, parameters, the size of each input (a
    query's text only with ``trace_content``). Asked only of a span that records."""
    attributes = {**_constant_attributes(pipeline, step), "ragline.hook": call.hook}
    for port, value in values.items():
        if isinstance(value, Query):
            attributes[f"ragline.input.{port}.chars"] = len(value.text)
            if telemetry.content_on():
                attributes[f"ragline.input.{port}.text"] = value.text
        else:
            attributes.update(telemetry.describe_value(f"ragline.input.{port}", value, listed=False))
    return attributes


_CONSTANT: dict[int, tuple[CompiledStep, dict[str, Any]]] = {}  # id(step) -> (step, its spans' fixed attributes)


def _constant_attributes(pipeline: CompiledPipeline, step: CompiledStep) -> dict[str, Any]:
    """Pipeline, step, stage and parameters (as JSON): the same on every span of one compiled step,
    so made once per step, not per run."""
    known = _CONSTANT.get(id(step))
    if known is not None and known[0] is step:
        return known[1]
    attributes = {"ragline.pipeline": pipeline.name, "ragline.step": step.id, "ragline.stage": step.stage.name,
                  "ragline.params": json.dumps(step.params.model_dump(mode="json"), default=str)}
    if len(_CONSTANT) >= 1024:  # compiled pipelines are cached; a bound all the same
        _CONSTANT.clear()
    _CONSTANT[id(step)] = (step, attributes)
    return attributes


WHEN_INPUT = "_when"  # the input port carrying the output of the step a condition reads
_LOG = logging.getLogger("ragline.run")


def skip_reason(step: CompiledStep, decider: list[StepResult] | None, values: dict[str, Any]) -> str:
    """Why the step does not run ("" when it runs): its ``when`` does not hold, or a required input
    came only from skipped steps (the branch it belongs to was not taken)."""
    when = step.when
    if when is not None:
        label = _label_of(decider[0].value if decider else None, when.step)
        if not when.holds(label):
            return f"{when.describe()} is false (label: {label or 'none'})"
    optional = step.stage.optional_inputs
    for port, value in values.items():
        if value is _NOTHING and port not in optional:
            return f"input '{port}' came only from skipped steps ({', '.join(step.wiring.get(port, []))})"
    return ""


def _label_of(value: Any, step_id: str) -> str | None:
    """The label a classify step put on the query (None: that step gave none, e.g. it was skipped)."""
    label = value.labels.get(step_id) if isinstance(value, Query) else None
    return label.label if label is not None else None


def skipped_value(step: CompiledStep, values: dict[str, Any]) -> Any:
    """What a skipped step gives its consumers: its input of the kind it produces, passed on
    unchanged (a Query->Query rewrite, a Passages->Passages rerank, an Answer->Answer check); else
    an empty list for a list output (a skipped retriever finds no passages); else ``Skipped``,
    which consumers drop (a fan-in of alternatives takes the branch that ran)."""
    own = values.get(step.stage.produces, _NOTHING)
    if own is not _NOTHING and step.stage.produces in step.stage.inputs:
        return own
    if typing.get_origin(step.stage.output_type) is list:
        return []
    return Skipped()


class _Nothing:
    """A port whose producers were all skipped."""


_NOTHING = _Nothing()


def _value_of(results: list[StepResult]) -> Any:
    """A port's value: its producers' outputs joined, leaving out skipped ones; ``_NOTHING`` when
    every producer was skipped."""
    kept = [r.value for r in results if not isinstance(r.value, Skipped)]
    return _NOTHING if results and not kept else _join(kept)


def _join(values: list[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    if not all(isinstance(v, list) for v in values):  # alternatives (checked exclusive): the one that ran
        return values[0]
    return [item for value in values for item in value]


def invoke(pipeline: CompiledPipeline, step: CompiledStep, inputs: dict[str, Any], ctx: StepContext,
           params: Any = None, hook: Callable[..., Any] | None = None) -> Any:
    """Call a stage (or one of its hooks) with its inputs, params, resources and context."""
    if step.collections and hook is None and not step.stage.merges_collections:
        return _per_collection(pipeline, step, inputs, ctx, params)
    return _call(pipeline, step, step.resources, inputs, ctx, params, hook)


def _per_collection(pipeline: CompiledPipeline, step: CompiledStep, inputs: dict[str, Any], ctx: StepContext,
                    params: Any) -> list[Ranking]:
    """A retriever over named collections: run once per collection the query selects (all when it
    names none), over that collection's resources; every passage says which collection it came
    from, and fuse ranks them all together."""
    wanted = getattr(inputs.get("query"), "collections", None)
    selected = [(name, bound) for name, bound in step.collections.items() if wanted is None or name in wanted]

    def search(name: str, resources: dict[str, str]) -> list[Ranking]:
        rankings = _call(pipeline, step, resources, inputs, ctx, params, None)
        return [r.model_copy(update={"passages": [p.model_copy(update={"metadata": {**p.metadata, COLLECTION_KEY: name}})
                                                  for p in r.passages]}) for r in rankings]

    before, started = ctx.seconds, time.perf_counter()
    if len(selected) == 1:
        found = [search(*selected[0])]
    else:  # side by side: each waits on its own store; the embedder encodes one at a time anyway
        with ThreadPoolExecutor(len(selected) or 1, thread_name_prefix=f"ragline-{step.id}") as pool:
            found = list(pool.map(lambda chosen: contextvars.copy_context().run(search, *chosen), selected))
    ctx.seconds = before + time.perf_counter() - started  # the step's wall time, not the sum of its threads'
    return [ranking for rankings in found for ranking in rankings]


def _call(pipeline: CompiledPipeline, step: CompiledStep, resources: dict[str, str], inputs: dict[str, Any],
          ctx: StepContext, params: Any, hook: Callable[..., Any] | None) -> Any:
    import inspect

    fn = hook or step.stage.fn
    accepted = inspect.signature(fn).parameters
    kwargs = dict(inputs)
    if "params" in accepted:
        kwargs["params"] = params or step.params
    if "ctx" in accepted:
        kwargs["ctx"] = ctx
    for role, name in resources.items():
        if role in accepted:
            kwargs[role] = pipeline.project.resource(name)
    started = time.perf_counter()
    try:
        return fn(**{k: v for k, v in kwargs.items() if k in accepted})
    except StepFailed:
        raise
    except Exception as exc:
        raise StepFailed(pipeline.name, step.id, step.stage.name, exc) from exc
    finally:
        ctx.seconds += time.perf_counter() - started
