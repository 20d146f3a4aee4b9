"""What a job pipeline's report asks for, done by the runner: stages report, the runner writes.

``tune_retrieval``, ``adapt_embedder`` and ``summarize_communities`` return a ``TuneReport`` /
``AdaptReport`` / ``SummaryReport`` that says which overlay (or summaries file) to write; writing
it (and rebuilding BM25 with the tuned settings, under the index lease) is engine work, so the
stages never import the engine's configuration modules and a dry run is simply a report nobody
publishes.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ragline.flows.contracts import AdaptReport, SummaryReport, TuneReport
from ragline.flows.resources.stores import summaries
from ragline.flows.spec import overlay
from ragline.flows.spec.model import CompiledPipeline

log = logging.getLogger("ragline.jobs")


def publish(pipeline: CompiledPipeline, output: Any) -> Any:
    """Write what a job's report asks for; returns the report with where it was written."""
    if isinstance(output, TuneReport):
        return publish_tuning(pipeline, output)
    if isinstance(output, AdaptReport):
        return publish_adaptation(pipeline, output)
    if isinstance(output, SummaryReport):
        return publish_summaries(pipeline, output)
    return output


def publish_summaries(pipeline: CompiledPipeline, report: SummaryReport) -> SummaryReport:
    """The community summaries for the report's index state: replaced in one rename beside a state
    file, in one transaction in a database state (a build killed before this leaves the old ones)."""
    if not report.write_requested:
        return report
    if report.state_resource:
        return pipeline.project.resource(report.state_resource).summaries().publish(report)
    return summaries.publish(Path(report.path), report)


def publish_tuning(pipeline: CompiledPipeline, report: TuneReport) -> TuneReport:
    """The tuned overlay, then BM25 rebuilt with its settings as a writer (queries never rebuild
    it, and a version built with other settings, a changed stemmer, would not match their terms)."""
    project = pipeline.project
    path = overlay.overlay_path(project, report.overlay_file)
    report.overlay = str(path)
    if not report.write_requested:
        return report
    overlay.write_overlay(project, path, report, state_generation=report.generation)
    report.written = True
    if report.state_resource and report.sparse_resources:
        tuned = overlay.apply_overlay(project.untuned or project)
        state = tuned.resource(report.state_resource)
        with state.lease(f"{pipeline.name} (publishing tuned BM25)"):
            for name in report.sparse_resources:
                if tuned.resource(name).sync(state):
                    log.info("BM25 %s rebuilt with the tuned settings", name)
    return report


def publish_adaptation(pipeline: CompiledPipeline, report: AdaptReport) -> AdaptReport:
    """Point the embedder at the adapted model in the overlay (keeping tuned entries)."""
    if not report.write_requested:
        return report
    project = pipeline.project
    written = overlay.write_adaptation(project, overlay.overlay_path(project, report.overlay_file), report)
    report.overlay_path = str(Path(written))
    log.info("adapt: %s now points the embedder '%s' at the model; the next ingestion re-embeds, then run "
             "`ragline tune` again", report.overlay_path, report.embedder)
    return report
