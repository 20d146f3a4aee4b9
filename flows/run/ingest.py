"""The incremental-ingestion protocol.

The source steps list documents (``load`` from cheap change signals: an unchanged file is listed from
the index state unopened, a changed one without its text, read again in its batch by the source's
``read`` hook, so no run holds the corpus's text); the sink's ``plan`` hook decides which documents
changed (and which sources are gone); the steps
between the sources and the sink run once per batch of changed documents, pipelined (different
steps overlap across batches, each step takes the batches in order); the sink's ``finalize`` hook
removes deleted sources and publishes derived indexes; its ``session`` hook (the writer lease)
spans the whole run.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document, IndexReport, IngestPlan, StepResult
from ragline.flows.run.executors import Run, settle
from ragline.flows.spec.model import CompiledPipeline, CompiledStep
from ragline.flows.run.steps import PipelineRef, invoke


def _batches(run: Run, sink: CompiledStep | None, plan: IngestPlan, origin: dict[str, str], size: int
             ) -> Iterator[tuple[list[Document], list[str]]]:
    """The batches to index, each document with the source step that listed it: the plan's own
    list, then the sink's work list a page at a time (``pending``: kept in its state, so the run
    holds a batch of it, never the corpus's list)."""
    for start in range(0, len(plan.to_index), size):
        batch = plan.to_index[start:start + size]
        yield batch, [origin.get(d.source_id, "") for d in batch]
    if not plan.queued or sink is None or sink.stage.pending is None:
        return
    after, number = "", 0
    while True:
        number += 1
        page = run.result(run.submit(sink, {}, label=f"{sink.id}.pending[page {number}]", hook="pending",
                                     inputs={"after": [StepResult(after)], "size": [StepResult(size)]})).value
        if not page.documents:
            return
        yield page.documents, page.steps
        if len(page.documents) < size:  # a short page is the last: no empty page to ask for (a task run each)
            return
        after = page.documents[-1].source_id


def run_ingestion(pipeline: CompiledPipeline, executor: Any, progress: Any = None) -> IndexReport:
    sink = pipeline.sink
    if sink is None or sink.stage.session is None:
        return _ingest(pipeline, executor, progress)
    ctx = StepContext(pipeline=pipeline.name, step_id=sink.id, base_dir=str(pipeline.project.base_dir))
    _phase(progress, "waiting")  # for the index's writer lease (another writer holds it)
    with invoke(pipeline, sink, {}, ctx, hook=sink.stage.session):
        return _ingest(pipeline, executor, progress)


def _ingest(pipeline: CompiledPipeline, executor: Any, progress: Any) -> IndexReport:
    started = time.perf_counter()
    sources_steps = [s for s in pipeline.steps if not s.stage.inputs and s.stage.produces == "documents"]
    sink = pipeline.sink
    middle = [s for s in pipeline.steps if s not in sources_steps]
    run = Run(pipeline, executor, PipelineRef.of(pipeline), pipeline.fingerprint([s for s in middle if s is not sink]))

    _phase(progress, "listing")  # sources listed (changed items read and hashed), then compared with the state DB
    loaded = {s.id: run.result(run.submit(s, {})) for s in sources_steps}
    steps_by_id = {s.id: s for s in sources_steps}
    origin = {d.source_id: sid for sid, result in loaded.items() for d in result.value}
    documents = [d for result in loaded.values() for d in result.value]
    failures = [f for result in loaded.values() for f in result.failures]
    covered = [c for result in loaded.values() for c in result.covered]

    if sink is None:
        plan = IngestPlan(to_index=documents, new={d.source_id for d in documents})
        plan_future = None
    else:
        given = {"documents": [StepResult(documents)], "failures": [StepResult(failures)],
                 "covered": [StepResult(covered)]}
        plan_future = run.submit(sink, {}, label=f"{sink.id}.plan", hook="plan", inputs=given)
        plan_result = run.result(plan_future)
        plan, failures = plan_result.value, failures + plan_result.failures
    report = IndexReport(unchanged=plan.unchanged, migrated=plan.migrated, regranted=plan.regranted)
    if progress is not None:
        progress.start(len(plan.to_index) + plan.queued)
    _phase(progress, "indexing")  # batches: converted, chunked, embedded and written, pipelined
    in_flight: deque[tuple[list[Document], dict[str, Any]]] = deque()
    previous: dict[str, Any] = {}
    batches = _batches(run, sink, plan, origin, pipeline.spec.batch_size)
    for number, (batch, listed_by) in enumerate(batches):
        # Pipelined: each step takes the batches in order, but different steps overlap, so batch
        # n+1 is chunked (and batch n-1 written) while batch n is embedded. Two batches in flight.
        sources = {sid: _read(run, step, [d for d, by in zip(batch, listed_by) if by == sid], number)
                   for sid, step in steps_by_id.items()}
        for step in middle:
            sources[step.id] = run.submit(step, sources, label=f"{step.id}[batch {number}]",
                                          after=[previous[step.id]] if step.id in previous else [])
        previous = {step.id: sources[step.id] for step in middle}
        in_flight.append((batch, sources))
        if len(in_flight) > 1:
            report = _collect(run, in_flight.popleft(), middle, sink, report, progress, failures)
    while in_flight:
        report = _collect(run, in_flight.popleft(), middle, sink, report, progress, failures)
    if sink is not None and sink.stage.finalize is not None:
        _phase(progress, "publishing")  # deletions, then the derived indexes (BM25) published
        final = run.result(run.submit(sink, {}, label=f"{sink.id}.finalize", hook="finalize",
                                      inputs={"plan": [plan_future], "failures": [StepResult(failures)]}))
        report = report.merge(final.value)
        failures += final.failures
    report.failures = failures
    report.failed = len({f.source_id for f in failures})
    report.roots = [c.path for c in covered] + [f.source_id for f in failures if f.root]
    report.seconds = time.perf_counter() - started
    return report


def _read(run: Run, step: CompiledStep, listed: list[Document], number: int) -> Any:
    """A batch's documents of one source step: those it listed without their text are read now,
    by its ``read`` hook, so a run holds one batch's text at a time, never the corpus's."""
    if step.stage.read is None or all(d.text for d in listed):
        return StepResult(listed)
    return run.submit(step, {}, label=f"{step.id}.read[batch {number}]", hook="read",
                      inputs={"documents": [StepResult(listed)]})


def _phase(progress: Any, name: str) -> None:
    """Tell a progress reporter that understands phases (``entrypoints.RunProgress``) where the run is."""
    if progress is not None and hasattr(progress, "phase"):
        progress.phase(name)


def _collect(run: Run, done: tuple[list[Document], dict[str, Any]], middle: list[CompiledStep],
             sink: CompiledStep | None, report: IndexReport, progress: Any, failures: list) -> IndexReport:
    """Wait for one batch; keep its failures; add its sink's report; advance the progress bar."""
    batch, sources = done
    ids = {step.id for step in middle}
    reads = [run.result(v) for k, v in sources.items() if k not in ids and not isinstance(v, StepResult)]
    results = reads + settle(run, middle, sources)
    failures.extend(f for result in results for f in result.failures)
    value = run.result(sources[sink.id if sink else middle[-1].id]).value
    written = value.chunks_written if isinstance(value, IndexReport) else 0
    if progress is not None:
        progress.advance(len(batch), written)
    return report.merge(value) if isinstance(value, IndexReport) else report


