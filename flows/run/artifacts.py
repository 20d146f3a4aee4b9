"""What a finished ingestion or job run shows on the Prefect dashboard, beside the run (issue 20.5).

An ingestion run publishes its counts, the roots it listed and the documents that failed (with the
stage and reason); a tuning run its chosen setting against the file's and the best single
retriever, and its candidates; an adaptation run what it trained. One markdown artifact per run,
keyed by pipeline (``ragline-<pipeline>``) so the dashboard's Artifacts page keeps each pipeline's
history as versions of one key.

Document ids, failure reasons and paths come from documents and file names, which an attacker may
choose: every value is escaped before it reaches markdown (no links, images or HTML from data),
and long values and long tables are cut.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from ragline.flows.contracts import AdaptReport, IndexReport, TuneReport

log = logging.getLogger("ragline.progress")

MAX_ROWS = 50  # failures or candidates listed; the rest are counted
MAX_CELL = 200  # characters of one value
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]<>()#+\-.!|~&])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]+")


def cell(value: Any) -> str:
    """A value as inert markdown text: control characters and newlines become a space, every
    markdown/HTML special character is escaped, and the value is cut to ``MAX_CELL`` characters."""
    text = _CONTROL.sub(" ", str(value)).strip()
    if len(text) > MAX_CELL:
        text = text[:MAX_CELL - 1] + "…"
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def artifact_key(pipeline: str) -> str:
    """Prefect artifact keys are lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", pipeline.lower()).strip("-")
    return f"ragline-{slug or 'pipeline'}"[:100]


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"\n{len(rows) - MAX_ROWS} more not shown")
    return lines


def ingestion_markdown(pipeline: str, report: IndexReport) -> str:
    outcome = "**incomplete**: a root could not be reached, nothing was deleted" if report.incomplete else "complete"
    lines = [f"# Ingestion {cell(pipeline)}: {outcome}", "",
             *_table(["added", "updated", "deleted", "unchanged", "failed", "chunks written", "chunks removed",
                      "seconds"],
                     [[report.added, report.updated, report.deleted, report.unchanged, report.failed,
                       report.chunks_written, report.chunks_deleted, f"{report.seconds:.1f}"]])]
    if report.migrated:
        lines += ["", f"{report.migrated} sources moved to root-relative ids without re-embedding"]
    if report.roots:
        lines += ["", "## Roots listed", "", *_table(["root"], [[r] for r in report.roots])]
    if report.failures:
        lines += ["", "## Failed documents", "",
                  *_table(["document", "stage", "reason", "kind"],
                          [[f.source_id, f.stage, f.reason, "root unreachable" if f.root else
                            "skipped" if f.skipped else "failed"] for f in report.failures])]
    return "\n".join(lines) + "\n"


def _candidate_row(label: str, candidate: Any) -> list[Any]:
    if candidate is None:
        return [label, "", ""]
    data = candidate.model_dump() if hasattr(candidate, "model_dump") else dict(candidate)
    score = data.pop("score", data.pop("value", ""))
    settings = ", ".join(f"{k}={v}" for k, v in sorted(data.items()) if not isinstance(v, (dict, list)))
    return [label, settings, f"{score:.4f}" if isinstance(score, float) else score]


def tuning_markdown(pipeline: str, report: TuneReport) -> str:
    lines = [f"# Tuning {cell(pipeline)}", "",
             f"Metric {cell(report.metric)} on {report.pairs} pseudo-queries over {report.chunks} chunks. "
             f"Rule: {cell(report.rule or 'none')}.", "", f"{cell(report.reason)}", "",
             *_table(["", "setting", report.metric],
                     [_candidate_row("chosen", report.chosen), _candidate_row("pipelines.yaml", report.baseline),
                      _candidate_row("best single retriever", report.single)])]
    if report.gain_interval:
        low, high = report.gain_interval
        lines += ["", f"Gain over the best single retriever, 95 % interval: [{low:+.4f}, {high:+.4f}]"]
    if report.candidates:
        lines += ["", "## Candidates, best first", "",
                  *_table(["#", "setting", report.metric],
                          [[str(i + 1), *_candidate_row("", c)[1:]] for i, c in enumerate(report.candidates)])]
    return "\n".join(lines) + "\n"


def adaptation_markdown(pipeline: str, report: AdaptReport) -> str:
    state = "reused an adapted model" if report.reused else \
        "stopped at its time limit" if report.stopped_early else "trained"
    return "\n".join([f"# Embedder adaptation {cell(pipeline)}: {state}", "",
                      *_table(["base model", "pairs", "steps", "epochs", "mean loss", "chunks to re-embed"],
                              [[report.base_model, report.pairs, report.steps, f"{report.epochs:.2f}",
                                "" if report.loss is None else f"{report.loss:.4f}", report.chunks]]),
                      "", f"Model: {cell(report.model_path)}",
                      f"Overlay: {cell(report.overlay_path or 'not written')}"]) + "\n"


def markdown_for(pipeline: str, result: Any) -> str | None:
    if isinstance(result, IndexReport):
        return ingestion_markdown(pipeline, result)
    if isinstance(result, TuneReport):
        return tuning_markdown(pipeline, result)
    if isinstance(result, AdaptReport):
        return adaptation_markdown(pipeline, result)
    return None


def publish(pipeline: str, result: Any) -> str | None:
    """Attach the run's report to the current flow run as a markdown artifact; returns its key, or
    None when there is nothing to show or no flow run. Best effort: a dashboard that cannot take
    the artifact never fails the run that did the work."""
    markdown = markdown_for(pipeline, result)
    if markdown is None:
        return None
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return None
    key = artifact_key(pipeline)
    try:
        create_markdown_artifact(markdown=markdown, key=key, description=f"ragline report of {pipeline}")
    except Exception as exc:  # noqa: BLE001 - a report's display, never a reason to fail the run
        log.warning("could not publish the report of %s to the dashboard: %s", pipeline, exc)
        return None
    return key
