"""``ragline report``: one self-contained HTML page of how the served project did (issue 20.5):
latency per step, refusals and failures over time, feedback over time, retrieval metrics per
``ragline eval`` run, requests per pipeline and principal, the ingestion pipelines' last success.

Read from the files the project already keeps (the query log, the feedback file, the eval runs, the
index state): nothing is written but the page. The plots are inline SVG drawn here (no plotting
library, no script); the page loads nothing (a CSP of ``default-src 'none'`` with the one inline
style allowed by its hash). Questions, pipeline names, principals and errors come from users, so
every value from data is HTML-escaped and cut to ``MAX_TEXT`` characters.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ragline.flows.evaluation.judge import SCORES
from ragline.flows.evaluation.retrieval import EVAL_RUNS, METRICS
from ragline.flows.run.entrypoints import LAST_SUCCESS
from ragline.flows.serve.routers.feedback import FEEDBACK_FOLDER, FEEDBACK_NAME
from ragline.flows.serve.routers.metrics import index_facts
from ragline.flows.serve.query_log import LOG_FOLDER, LOG_NAME, read_lines

MAX_TEXT = 160  # characters of one value shown
MAX_ROWS = 15  # rows of a listing (pipelines, principals, slowest queries)
MAX_EVAL_RUNS = 20
BIN_EDGES_MS = (0, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 60_000)
STATUSES = ("answered", "refused", "failed")
COLOURS = {"answered": "#4c78a8", "refused": "#f58518", "failed": "#e45756", "up": "#54a24b", "down": "#e45756",
           "refusal rate": "#f58518", "failure rate": "#e45756"}
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float | None:
    """``30m``, ``12h``, ``7d``, ``4w`` as seconds; ``all``: no bound (None)."""
    if text.strip().lower() == "all":
        return None
    found = _DURATION.match(text.strip().lower())
    if not found or float(found[1]) <= 0:
        raise ValueError(f"--since {text!r}: a number and m, h, d or w (e.g. 7d), or 'all'")
    return float(found[1]) * _UNIT_SECONDS[found[2]]


def _epoch(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


# ----------------------------------------------------------------------------- aggregation
@dataclass
class Summary:
    """What the page shows, computed from the records alone (no I/O): the unit tests' subject."""

    start: float
    end: float
    queries: int = 0
    statuses: Counter = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=dict)  # "overall" and each step, milliseconds
    buckets: list[float] = field(default_factory=list)  # bucket starts
    bucket_seconds: float = 3600.0
    status_over_time: dict[str, list[int]] = field(default_factory=dict)
    feedback_over_time: dict[str, list[int]] = field(default_factory=dict)
    pipelines: Counter = field(default_factory=Counter)
    principals: Counter = field(default_factory=Counter)
    slowest: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, Any]] = field(default_factory=list)
    latest: list[dict[str, Any]] = field(default_factory=list)
    eval_runs: list[dict[str, Any]] = field(default_factory=list)
    ingestion: list[dict[str, Any]] = field(default_factory=list)


def summarize(entries: list[dict[str, Any]], feedback: list[dict[str, Any]], eval_runs: list[dict[str, Any]],
              since_seconds: float | None, now: float | None = None) -> Summary:
    """Query log entries and feedback records within ``since_seconds`` of ``now`` (all: None),
    the last ``MAX_EVAL_RUNS`` eval runs whatever their age."""
    now = time.time() if now is None else now
    cutoff = now - since_seconds if since_seconds is not None else float("-inf")
    timed = [(t, e) for e in entries if (t := _epoch(e.get("time"))) is not None and cutoff <= t <= now + 60]
    rated = [(t, r) for r in feedback if (t := _epoch(r.get("time"))) is not None and cutoff <= t <= now + 60]
    start = min((t for t, _ in [*timed, *rated]), default=now) if since_seconds is None else cutoff
    summary = Summary(start=start, end=now)
    summary.bucket_seconds = size = _bucket_size(now - start)
    origin = start // size * size  # buckets on whole hours, days (UTC), weeks
    count = int((now - origin) // size) + 1
    summary.buckets = [origin + i * size for i in range(count)]

    def bucket(t: float) -> int:
        return min(count - 1, max(0, int((t - origin) // size)))

    summary.status_over_time = {s: [0] * count for s in STATUSES}
    summary.latency = {"overall": []}
    for t, entry in timed:
        status = entry.get("status") if entry.get("status") in STATUSES else "failed"
        summary.queries += 1
        summary.statuses[status] += 1
        summary.status_over_time[status][bucket(t)] += 1
        summary.pipelines[str(entry.get("pipeline"))] += 1
        summary.principals[str(entry.get("principal") or "anonymous")] += 1
        if isinstance(entry.get("latency_ms"), (int, float)):
            summary.latency["overall"].append(float(entry["latency_ms"]))
        for step, ms in (entry.get("timings") or {}).items() if isinstance(entry.get("timings"), dict) else ():
            if isinstance(ms, (int, float)):
                summary.latency.setdefault(str(step), []).append(float(ms))
    logged = [e for _, e in timed]
    summary.slowest = sorted((e for e in logged if isinstance(e.get("latency_ms"), (int, float))),
                             key=lambda e: -e["latency_ms"])[:MAX_ROWS]
    newest_first = [e for _, e in sorted(timed, key=lambda te: -te[0])]
    summary.latest = newest_first[:MAX_ROWS]
    summary.refusals = [e for e in newest_first if e.get("status") in ("refused", "failed")][:MAX_ROWS]
    summary.feedback_over_time = {"up": [0] * count, "down": [0] * count}
    for t, record in rated:
        if record.get("rating") in ("up", "down"):
            summary.feedback_over_time[record["rating"]][bucket(t)] += 1
    runs = sorted((r for r in eval_runs if _epoch(r.get("time")) is not None), key=lambda r: _epoch(r["time"]))
    summary.eval_runs = runs[-MAX_EVAL_RUNS:]
    return summary


def _bucket_size(span: float) -> float:
    """An hour up to two days, a day up to ten weeks, a week beyond."""
    return 3600.0 if span <= 2 * 86400 else 86400.0 if span <= 70 * 86400 else 7 * 86400.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def histogram(values: list[float], edges: tuple[float, ...] = BIN_EDGES_MS) -> list[int]:
    """Counts per bin ``[edges[i], edges[i+1])``; the last bin takes everything from its edge up."""
    counts = [0] * len(edges)
    for value in values:
        index = next((i for i in range(len(edges) - 1) if value < edges[i + 1]), len(edges) - 1)
        counts[index] += 1
    return counts


# ----------------------------------------------------------------------------- reading
def read_eval_runs(data_dir: Path) -> list[dict[str, Any]]:
    """The JSON records ``ragline eval`` leaves under ``.ragline/eval-runs/`` (unreadable ones skipped)."""
    runs = []
    for path in sorted((data_dir / EVAL_RUNS).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            runs.append(record)
    return runs


def ingestion_rows(project: Any) -> list[dict[str, Any]]:
    """Each ingestion pipeline's index (documents, chunks) and last success, from the state DBs
    (what ``/metrics`` reads: a COUNT and a few keys); an index that cannot be read is left out."""
    rows = []
    for index, collection, (documents, chunks), newest, meta in index_facts(project, "report"):
        for pipeline in index.pipelines:
            rows.append({"pipeline": pipeline, "collection": collection, "documents": documents, "chunks": chunks,
                         "last_success": meta.get(LAST_SUCCESS + pipeline), "newest_change": newest})
    return rows


def build(data_dir: Path, since_seconds: float | None, ingestion: list[dict[str, Any]] | None = None,
          now: float | None = None) -> str:
    """The page for one data dir."""
    entries = list(read_lines(data_dir / LOG_FOLDER / LOG_NAME))
    feedback = list(read_lines(data_dir / FEEDBACK_FOLDER / FEEDBACK_NAME))
    summary = summarize(entries, feedback, read_eval_runs(data_dir), since_seconds, now)
    summary.ingestion = ingestion or []
    return render(summary, str(data_dir))


# ----------------------------------------------------------------------------- SVG
def text(value: Any) -> str:
    """A value from data as inert HTML text: control characters become spaces, cut, escaped."""
    shown = re.sub(r"[\x00-\x1f\x7f]+", " ", str(value)).strip()
    if len(shown) > MAX_TEXT:
        shown = shown[:MAX_TEXT - 1] + "…"
    return html.escape(shown, quote=True)


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.2g}" if value < 1 else \
        f"{value:.1f}"


def bar_chart(labels: list[str], series: dict[str, list[float]], title: str, unit: str = "",
              width: int = 560, height: int = 200) -> str:
    """Stacked vertical bars, one per label, a ``<title>`` tooltip per bar."""
    left, bottom, top = 44, 38, 10
    plot_w, plot_h = width - left - 8, height - bottom - top
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    peak = max(totals, default=0) or 1
    step = plot_w / max(1, len(labels))
    parts = [_axes(left, top, plot_w, plot_h, peak, unit)]
    for i, label in enumerate(labels):
        y = top + plot_h
        for name, values in series.items():
            h = plot_h * values[i] / peak
            if values[i]:
                y -= h
                parts.append(f'<rect class="bar" x="{left + i * step + 1:.1f}" y="{y:.1f}" '
                             f'width="{max(1.0, step - 2):.1f}" '
                             f'height="{h:.1f}" fill="{COLOURS.get(name, PALETTE[0])}"><title>{text(label)}: '
                             f'{text(name)} {_number(values[i])}{text(unit)}</title></rect>')
    parts.extend(_x_labels(labels, left, step, top + plot_h))
    return _svg(title, width, height, parts, series.keys() if len(series) > 1 else ())


def line_chart(labels: list[str], series: dict[str, list[float | None]], title: str, unit: str = "",
               top_value: float | None = None, width: int = 560, height: int = 200) -> str:
    """One polyline per series (a None value breaks it), a dot with a tooltip per point."""
    left, bottom, top = 44, 38, 10
    plot_w, plot_h = width - left - 8, height - bottom - top
    peak = top_value or max((v for values in series.values() for v in values if v is not None), default=0) or 1
    step = plot_w / max(1, len(labels))
    parts = [_axes(left, top, plot_w, plot_h, peak, unit)]
    for n, (name, values) in enumerate(series.items()):
        colour = COLOURS.get(name, PALETTE[n % len(PALETTE)])
        points = [(left + (i + 0.5) * step, top + plot_h * (1 - v / peak), v) for i, v in enumerate(values)
                  if v is not None]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for (x, y, v), label in zip(points, [labels[i] for i, v in enumerate(values) if v is not None]):
            parts.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"><title>'
                         f'{text(label)}: {text(name)} {_number(v)}{text(unit)}</title></circle>')
    parts.extend(_x_labels(labels, left, step, top + plot_h))
    return _svg(title, width, height, parts, series.keys())


def hbar_chart(counts: list[tuple[str, int]], title: str, width: int = 560) -> str:
    """Horizontal bars, one per name (a listing of counts)."""
    row, left = 20, 190
    height = 10 + row * max(1, len(counts))
    peak = max((c for _, c in counts), default=0) or 1
    parts = []
    for i, (name, count) in enumerate(counts):
        y = 5 + i * row
        w = (width - left - 60) * count / peak
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{text(name[:28])}</text>'
                     f'<rect class="bar" x="{left}" y="{y + 3}" width="{max(1.0, w):.1f}" height="{row - 6}" '
                     f'fill="{PALETTE[0]}"><title>{text(name)}: {count}</title></rect>'
                     f'<text x="{left + w + 4:.1f}" y="{y + 14}">{count}</text>')
    return _svg(title, width, height, parts, ())


def _axes(left: float, top: float, plot_w: float, plot_h: float, peak: float, unit: str) -> str:
    lines = [f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#888"/>']
    for share in (0.5, 1.0):
        y = top + plot_h * (1 - share)
        lines.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{_number(peak * share)}{text(unit)}</text>')
    return "".join(lines)


def _x_labels(labels: list[str], left: float, step: float, baseline: float) -> list[str]:
    every = max(1, len(labels) // 8)
    return [f'<text x="{left + (i + 0.5) * step:.1f}" y="{baseline + 14}" text-anchor="middle">{text(label)}</text>'
            for i, label in enumerate(labels) if i % every == 0]


def _svg(title: str, width: int, height: int, parts: list[str], legend: Any) -> str:
    keys = "".join(f'<span class="key"><svg width="10" height="10" aria-hidden="true"><rect width="10" height="10" '
                   f'fill="{COLOURS.get(name, PALETTE[n % len(PALETTE)])}"/></svg> {text(name)}</span>'
                   for n, name in enumerate(legend))
    return (f'<figure><figcaption>{text(title)}{" " + keys if keys else ""}</figcaption>'
            f'<svg class="plot" role="img" aria-label="{text(title)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-size="10" font-family="sans-serif">{"".join(parts)}</svg></figure>')


# ----------------------------------------------------------------------------- the page
STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}figcaption{font-weight:600;font-size:13px}
.key{font-weight:400;margin-left:8px}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}
.num{text-align:right}.num,td:first-child{white-space:nowrap}.tiles{display:flex;gap:16px}
.tile{border:1px solid #ddd;border-radius:6px;padding:8px 14px}
.tile b{display:block;font-size:20px}
.empty{background:#fff6e0;border:1px solid #f0c36d;padding:10px;border-radius:6px}"""


def _when(epoch: float | None, bucket_seconds: float = 0) -> str:
    if epoch is None:
        return "-"
    moment = datetime.fromtimestamp(epoch, timezone.utc)
    return moment.strftime("%m-%d %H:00" if bucket_seconds == 3600 else "%Y-%m-%d" if bucket_seconds else
                           "%Y-%m-%d %H:%M UTC")


def render(summary: Summary, where: str) -> str:
    digest = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
    policy = f"default-src 'none'; style-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'"
    sections = [_overview(summary), _latency(summary), _outcomes(summary), _feedback(summary), _usage(summary),
                _evaluations(summary), _ingestion(summary)]
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
            '<meta name="referrer" content="no-referrer"><title>ragline report</title>'
            f"<style>{STYLE}</style></head><body><h1>ragline report</h1>"
            f"<p>{text(where)}: {_when(summary.start)} to {_when(summary.end)}.</p>{''.join(sections)}</body></html>\n")


def _overview(s: Summary) -> str:
    if not s.queries:
        return ('<p class="empty" id="empty">No query in the query log for this period. The log is opt-in: serve with '
                "<code>RAGLINE_QUERY_LOG=1</code> (and <code>RAGLINE_QUERY_LOG_TEXT=1</code> to keep the questions); "
                "feedback comes from <code>POST /v1/feedback</code>, retrieval metrics from "
                "<code>ragline eval</code>.</p>")
    rate = {k: f"{100 * s.statuses[k] / s.queries:.1f}%" for k in STATUSES}
    overall = s.latency["overall"]
    tiles = [("queries", s.queries), ("refused", rate["refused"]), ("failed", rate["failed"]),
             ("p50 latency", f"{percentile(overall, 0.5):.0f} ms"),
             ("p95 latency", f"{percentile(overall, 0.95):.0f} ms"),
             ("feedback", f"{sum(s.feedback_over_time['up'])} up / {sum(s.feedback_over_time['down'])} down")]
    return '<div class="tiles">' + "".join(f'<div class="tile">{text(k)}<b>{text(v)}</b></div>' for k, v in tiles) + \
        "</div>"


def _latency(s: Summary) -> str:
    if not s.queries:
        return ""
    bins = [_ms(edge) + ("+" if i == len(BIN_EDGES_MS) - 1 else "") for i, edge in enumerate(BIN_EDGES_MS)]
    plots = [bar_chart(bins, {"queries": histogram(values)},
                       f"{name}: p50 {percentile(values, 0.5):.0f} ms · p95 {percentile(values, 0.95):.0f} ms · "
                       f"n={len(values)}", width=360, height=150)
             for name, values in s.latency.items() if values]
    return "<h2>Latency (ms, bins from their lower edge)</h2><div class=\"grid\" id=\"latency\">" + "".join(plots) + \
        "</div>"


def _ms(edge: float) -> str:
    return f"{edge / 1000:g}s" if edge >= 1000 else f"{edge:g}"


def _labels(s: Summary) -> list[str]:
    return [_when(b, s.bucket_seconds) for b in s.buckets]


def _outcomes(s: Summary) -> str:
    if not s.queries:
        return ""
    totals = [sum(s.status_over_time[k][i] for k in STATUSES) for i in range(len(s.buckets))]
    rates = {"refusal rate": [100 * s.status_over_time["refused"][i] / t if t else None for i, t in enumerate(totals)],
             "failure rate": [100 * s.status_over_time["failed"][i] / t if t else None for i, t in enumerate(totals)]}
    return ('<h2>Outcomes over time</h2><div class="grid" id="outcomes">'
            + bar_chart(_labels(s), {k: s.status_over_time[k] for k in STATUSES}, "queries by outcome")
            + line_chart(_labels(s), rates, "refusal and failure rate", "%", top_value=100)
            + "</div>" + _listing("Latest refusals and failures", s.refusals, "reason"))


def _feedback(s: Summary) -> str:
    if not any(sum(v) for v in s.feedback_over_time.values()):
        return "<h2>Feedback</h2><p>No feedback in this period (<code>POST /v1/feedback</code>).</p>"
    return ('<h2>Feedback</h2><div class="grid" id="feedback">'
            + bar_chart(_labels(s), s.feedback_over_time, "ratings over time") + "</div>")


def _usage(s: Summary) -> str:
    if not s.queries:
        return ""
    return ('<h2>Requests</h2><div class="grid" id="usage">'
            + hbar_chart(s.pipelines.most_common(MAX_ROWS), "per pipeline", width=420)
            + hbar_chart(s.principals.most_common(MAX_ROWS), "per principal", width=420)
            + "</div>" + _listing("Latest queries", s.latest, "latency")
            + _listing("Slowest queries", s.slowest, "latency"))


def _listing(title: str, entries: list[dict[str, Any]], extra: str) -> str:
    if not entries:
        return ""
    rows = "".join(
        f"<tr><td>{text(_when(_epoch(e.get('time'))))}</td><td>{text(e.get('pipeline', ''))}</td>"
        f"<td>{text(e.get('status', ''))}</td><td class=\"num\">{text(round(float(e.get('latency_ms') or 0)))} ms</td>"
        f"<td>{text(e.get('principal') or '')}"
        f"</td><td>{text(e.get('question', '(not logged: RAGLINE_QUERY_LOG_TEXT=0)'))}</td>"
        f"<td>{text(e.get('error') or (e.get('answer') or {}).get('reason') or '') if extra == 'reason' else ''}</td>"
        f"</tr>" for e in entries)
    return (f"<h3>{text(title)}</h3><table><tr><th>time</th><th>pipeline</th><th>status</th><th>latency</th>"
            f"<th>principal</th><th>question</th><th>{'reason' if extra == 'reason' else ''}</th></tr>{rows}</table>")


def _evaluations(s: Summary) -> str:
    if not s.eval_runs:
        return "<h2>Retrieval evaluation</h2><p>No <code>ragline eval</code> run recorded yet.</p>"
    labels = [f"#{i + 1}" for i in range(len(s.eval_runs))]
    # a generated test set's runs (`ragline eval --testset/--judge`) add source hit@10 and the judge's scores
    metrics = METRICS + tuple(m for m in ("hit@10", *SCORES) if any(m in r for r in s.eval_runs))
    series = {m: [r.get(m) if isinstance(r.get(m), (int, float)) else None for r in s.eval_runs] for m in metrics}
    rows = "".join(f"<tr><td>#{i + 1}</td><td>{text(_when(_epoch(r.get('time'))))}</td>"
                   f"<td>{text(r.get('dataset'))}</td>"
                   f"<td>{text(r.get('pipeline'))}</td><td class=\"num\">{text(r.get('queries'))}</td>"
                   + "".join(f"<td class=\"num\">{text(r.get(m, '-'))}</td>" for m in metrics) + "</tr>"
                   for i, r in enumerate(s.eval_runs))
    return (f'<h2>Retrieval evaluation (last {MAX_EVAL_RUNS} runs)</h2><div class="grid" id="evaluation">'
            + line_chart(labels, series, "metrics per run", top_value=1.0) + "</div><table><tr><th>run</th><th>time"
            "</th><th>dataset</th><th>pipeline</th><th>queries</th>" + "".join(f"<th>{m}</th>" for m in metrics)
            + f"</tr>{rows}</table>")


def _ingestion(s: Summary) -> str:
    if not s.ingestion:
        return ""
    rows = "".join(f"<tr><td>{text(r['pipeline'])}</td><td>{text(r['collection'])}</td><td class=\"num\">"
                   f"{text(r['documents'])}</td><td class=\"num\">{text(r['chunks'])}</td>"
                   f"<td>{text(_when(r['last_success']))}</td><td>{text(_when(r['newest_change']))}</td></tr>"
                   for r in s.ingestion)
    return ("<h2>Ingestion</h2><table id=\"ingestion\"><tr><th>pipeline</th><th>collection</th><th>documents</th>"
            f"<th>chunks</th><th>last success</th><th>newest change</th></tr>{rows}</table>")
