"""What a finished ingestion or job run shows on the Prefect dashboard, beside the run (issue 20.5).

An ingestion run publishes its counts, the roots it listed and the documents that failed (with the
stage and reason); a tuning run its chosen setting against the file's and the best single
retriever, and its candidates; an adaptation run what it trained. One markdown artifact per run,
keyed by pipeline (``ragline-<pipeline>``) so the dashboard's Artifacts page keeps each pipeline's
history as versions of one key.

Document ids, failure reasons and paths come from documents and file names, which an attacker may
choose: every value is escaped before it reaches markdown (no links, images or HTML from data),
and long values and long tables are cut.

Plots are small SVG bar charts drawn here (no plotting library), embedded as ``data:image/svg+xml``
images: both Prefect UIs render them in a markdown artifact (the React UI's sanitiser allows
``data:image/`` sources of images; the Vue UI renders any image source). Their text is XML-escaped
and the image is base64, so a label from data can end neither the image nor the markdown.
"""
from __future__ import annotations

import base64
import logging
import re
from typing import Any
from xml.sax.saxutils import escape as xml_escape

from ragline.flows.contracts import AdaptReport, Candidate, IndexReport, TuneReport

log = logging.getLogger("ragline.progress")

MAX_ROWS = 50  # failures or candidates listed; the rest are counted
MAX_CELL = 200  # characters of one value
MAX_PLOTTED = 15  # candidates in the tuning plot
OUTCOMES = ("added", "updated", "deleted", "unchanged", "failed")  # an ingestion's documents, plotted
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


def histogram(values: list[float], edges: list[float]) -> list[int]:
    """Counts per bin ``[edges[i], edges[i+1])``, the last bin closed (1.0 falls in the top bin)."""
    counts = [0] * (len(edges) - 1)
    for value in values:
        index = next((i for i in range(len(edges) - 1) if value < edges[i + 1]), len(edges) - 2)
        counts[max(0, index)] += 1
    return counts


def bar_chart_svg(labels: list[str], values: list[float], title: str, width: int = 560, height: int = 220) -> str:
    """A standalone SVG of vertical bars, one per label, its value above it."""
    left, right, top, bottom = 12, 12, 28, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max((v for v in values if v > 0), default=0) or 1
    step = plot_w / max(1, len(labels))
    every = max(1, len(labels) // 12)  # at most a dozen labels under the axis
    parts = [f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-weight="bold">{_xml(title)}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>']
    for i, (label, value) in enumerate(zip(labels, values)):
        h = plot_h * max(0.0, value) / peak
        x, y = left + i * step, top + plot_h - h
        parts.append(f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(1.0, step - 2):.1f}" height="{h:.1f}" '
                     f'fill="#4c78a8"/>')
        parts.append(f'<text x="{x + step / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">{_number(value)}</text>')
        if i % every == 0:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
                         f'{_xml(label[:18])}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
            f'<rect width="{width}" height="{height}" fill="#fff"/>{"".join(parts)}</svg>')


def image(alt: str, svg: str) -> str:
    """An SVG as a markdown image the dashboard shows inline (a data URI: nothing to serve)."""
    return f"![{cell(alt)}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def bar_plot(labels: list[str], values: list[float], title: str) -> list[str]:
    """Markdown lines of one plot; none when there is nothing to draw."""
    if not labels or not any(values):
        return []
    return ["", image(title, bar_chart_svg(labels, values, title))]


def _xml(value: Any) -> str:
    return xml_escape(_CONTROL.sub(" ", str(value))[:MAX_CELL], {'"': "&quot;"})


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3f}" if abs(value) < 1 else f"{value:.1f}"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"\n{len(rows) - MAX_ROWS} more not shown")
    return lines


def ingestion_markdown(pipeline: str, report: IndexReport) -> str:
    outcome = "**incomplete**: a root could not be reached, nothing was deleted" if report.incomplete else "complete"
    lines = [f"# Ingestion {cell(pipeline)}: {outcome}", "",
             *table(["added", "updated", "deleted", "unchanged", "failed", "chunks written", "chunks removed",
                      "seconds"],
                     [[report.added, report.updated, report.deleted, report.unchanged, report.failed,
                       report.chunks_written, report.chunks_deleted, f"{report.seconds:.1f}"]]),
             *bar_plot(list(OUTCOMES), [getattr(report, outcome) for outcome in OUTCOMES],
                       "documents by outcome")]
    if report.migrated:
        lines += ["", f"{report.migrated} sources moved to root-relative ids without re-embedding"]
    if report.roots:
        lines += ["", "## Roots listed", "", *table(["root"], [[r] for r in report.roots])]
    if report.failures:
        lines += ["", "## Failed documents", "",
                  *table(["document", "stage", "reason", "kind"],
                          [[f.source_id, f.stage, f.reason, "root unreachable" if f.root else
                            "skipped" if f.skipped else "failed"] for f in report.failures])]
    return "\n".join(lines) + "\n"




def _candidate_row(label: str, candidate: Candidate | None, metric: str) -> list[Any]:
    """A candidate's name, its setting flattened (fusion, depths, BM25 parameters) and its score."""
    if candidate is None:
        return [label, "", ""]
    setting = ", ".join(f"{k}={v}" for k, v in sorted(_flat(candidate.setting).items()))
    score = candidate.scores.get(metric)
    return [label, f"{candidate.name}: {setting}" if setting else candidate.name,
            f"{score:.4f}" if isinstance(score, float) else ""]


def _flat(setting: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in setting.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tuning_markdown(pipeline: str, report: TuneReport) -> str:
    lines = [f"# Tuning {cell(pipeline)}", "",
             f"Metric {cell(report.metric)} on {report.pairs} pseudo-queries over {report.chunks} chunks. "
             f"Rule: {cell(report.rule or 'none')}.", "", f"{cell(report.reason)}", "",
             *table(["", "setting", report.metric],
                     [_candidate_row("chosen", report.chosen, report.metric),
                      _candidate_row("pipelines.yaml", report.baseline, report.metric),
                      _candidate_row("best single retriever", report.single, report.metric)])]
    if report.gain_interval:
        low, high = report.gain_interval
        lines += ["", f"Gain over the best single retriever, 95 % interval: [{low:+.4f}, {high:+.4f}]"]
    if report.candidates:
        plotted = report.candidates[:MAX_PLOTTED]
        lines += ["", "## Candidates, best first",
                  *bar_plot([str(i + 1) for i in range(len(plotted))], [c.scores.get(report.metric) or 0.0
                                                                        for c in plotted],
                            f"{report.metric} of the candidates, best first (# as in the table)"), "",
                  *table(["#", "setting", report.metric],
                          [[str(i + 1), *_candidate_row("", c, report.metric)[1:]]
                           for i, c in enumerate(report.candidates)])]
    return "\n".join(lines) + "\n"


def adaptation_markdown(pipeline: str, report: AdaptReport) -> str:
    state = "reused an adapted model" if report.reused else \
        "stopped at its time limit" if report.stopped_early else "trained"
    return "\n".join([f"# Embedder adaptation {cell(pipeline)}: {state}", "",
                      *table(["base model", "pairs", "steps", "epochs", "mean loss", "chunks to re-embed"],
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
    return publish_markdown(artifact_key(pipeline), markdown, f"ragline report of {pipeline}")


def publish_markdown(key: str, markdown: str, description: str) -> str | None:
    """``markdown`` as an artifact of the current flow run (None outside one, or when the API
    refused it: logged, never raised)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return None
    try:
        create_markdown_artifact(markdown=markdown, key=key, description=description)
    except Exception as exc:  # noqa: BLE001 - a report's display, never a reason to fail the run
        log.warning("could not publish %s to the dashboard: %s", description, exc)
        return None
    return key
