"""Choosing a setting: a gain over the better single retriever only when the paired bootstrap says it
is real."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ragline.flows.contracts import Candidate, PseudoQuery, TuneReport
from ragline.tasks.jobs.tune_retrieval.params import METRICS, Params


def is_single(c: Candidate) -> bool:
    return c.setting["dense_weight"] in (0.0, 1.0)


@dataclass
class Decision:
    chosen: Candidate
    reason: str
    rule: str
    single: Candidate | None = None
    interval: list[float] | None = None  # of the chosen (or best fused) candidate minus ``single``


def choose(candidates: list[Candidate], baseline: Candidate, params: Params,
           per_query: dict[str, np.ndarray]) -> Decision:
    """The best single retriever unless a fused candidate beats it significantly on the pseudo-
    queries (paired bootstrap: the lower end of the gain's interval above 0); among those, the
    best by the metric that the recall guard lets through; pipelines.yaml's own setting when
    it is allowed and the choice beats it by no more than min_gain. The intervals are simultaneous
    over every fused candidate (max-T, as the on/off switches'): the choice is the best of hundreds
    of settings, so one of them clearing 0 by luck must be as rare as one setting doing so alone."""
    metric = params.metric
    singles = [c for c in candidates if is_single(c)]
    single = recall_guarded(singles, params)[0] if singles else baseline
    fused = [c for c in candidates if not is_single(c)]
    intervals = gain_intervals(fused, single, per_query, params, simultaneous=True)
    words = interval_words(params, len(fused))
    significant = [c for c in fused if intervals[c.name][0] > 0]
    allowed = recall_guarded([*significant, single], params)
    chosen = allowed[0]
    top = max([*significant, single], key=lambda c: c.scores[metric])
    best_fused = significant[0] if significant else (fused[0] if fused else None)
    shown = chosen if not is_single(chosen) else best_fused
    interval = intervals.get(shown.name) if shown is not None else None
    low, high = interval if interval else (0.0, 0.0)
    if shown is not None and is_single(chosen):
        rule = "no significant gain" if top is single else "recall guard"
        why = (f"no fused candidate beats the best single retriever significantly (best: {shown.name}, "
               f"{low:+.4f} to {high:+.4f} {metric}, {words})"
               if rule == "no significant gain" else
               f"{top.name} gains no more than {params.recall_trade:g} {metric} for a Recall@100 loss over "
               f"{params.recall_margin:g}")
        reason = f"{single.name} alone: {why}"
    elif shown is not None:
        rule = "significant gain" if chosen is top else "recall guard"
        reason = (f"{chosen.scores[metric] - single.scores[metric]:+.4f} {metric} over the best single retriever "
                  f"({single.name}; {words} {low:+.4f} to {high:+.4f})")
        if rule == "recall guard":
            reason += (f"; {top.name} scores up to {params.recall_trade:g} higher but loses over "
                       f"{params.recall_margin:g} Recall@100")
    else:
        rule, reason = "no fused candidate", f"{single.name} alone: no fused candidate was tried"
    allowed_names = {c.name for c in allowed}
    gain = chosen.scores[metric] - baseline.scores[metric]
    if chosen.name != baseline.name and baseline.name in allowed_names and gain <= params.min_gain:
        rule = "min_gain"
        reason = (f"the current setting is kept: {chosen.name} beats it by {gain:+.4f} {metric}, "
                  f"not more than min_gain {params.min_gain:g}")
        chosen = baseline
        interval = intervals.get(baseline.name)
    elif chosen.name == baseline.name:
        reason = f"the current setting is the choice: {reason}"
    return Decision(chosen, reason, rule, single, [round(v, 5) for v in interval] if interval else None)


def recall_guarded(pool: list[Candidate], params: Params) -> list[Candidate]:
    """``pool`` best first without any candidate that another one in it beats by more than
    recall_margin Recall@100 while losing no more than recall_trade on the metric."""
    metric = params.metric
    ordered = sorted(pool, key=lambda c: -c.scores[metric])  # stable: the grid's order breaks ties
    kept = [c for c in ordered if not any(
        c.scores[metric] - o.scores[metric] <= params.recall_trade
        and o.scores["recall@100"] - c.scores["recall@100"] > params.recall_margin for o in ordered)]
    return kept or ordered[:1]


def gain_intervals(candidates: list[Candidate], single: Candidate, per_query: dict[str, np.ndarray],
                   params: Params, simultaneous: bool = False) -> dict[str, tuple[float, float]]:
    """Per candidate, the paired-bootstrap interval of its mean gain over ``single`` on the metric:
    the same resampled pseudo-queries for every candidate, from a fixed seed. Per candidate (each
    interval alone at ``confidence``: the percentile interval), or ``simultaneous``: all of them at
    once (max-T), so that the chance that *any* of the k intervals misses its candidate's true gain
    stays within 1 - confidence whatever k; see ``simultaneous_intervals``."""
    if not candidates or single.name not in per_query:
        return {}
    column = METRICS.index(params.metric)
    base = per_query[single.name][:, column]
    n = len(base)
    if n == 0:
        return {c.name: (0.0, 0.0) for c in candidates}
    # each resample's count of every pseudo-query, drawn in one call (the same stream as a draw per resample)
    drawn = np.random.default_rng(params.seed).integers(0, n, (params.bootstrap, n))
    offsets = n * np.arange(params.bootstrap)[:, None]
    counts = np.bincount((drawn + offsets).ravel(), minlength=params.bootstrap * n).reshape(params.bootstrap, n)
    gains = np.stack([per_query[c.name][:, column] - base for c in candidates], axis=1)  # (n, candidates)
    means = counts @ gains / n  # (resamples, candidates)
    tail = 100 * (1 - params.confidence) / 2
    if simultaneous:
        low, high = simultaneous_intervals(means, gains.mean(axis=0), tail)
    else:
        low, high = np.percentile(means, [tail, 100 - tail], axis=0)
    return {c.name: (float(lo), float(hi)) for c, lo, hi in zip(candidates, low, high)}


def simultaneous_intervals(means: np.ndarray, observed: np.ndarray, tail: float) -> tuple[np.ndarray, np.ndarray]:
    """Max-T bootstrap intervals of k mean gains that hold together: ``means`` (resamples x k) are
    the resampled means, ``observed`` the k means of the pseudo-queries themselves. Each candidate's
    deviation is standardised by its bootstrap standard error (so that the noisiest candidate does
    not set the bar for a steady one); per resample, the largest standardised deviation over the k
    candidates upwards (and, for the upper ends, downwards); its 100 - ``tail`` percentile ``c`` gives
    every candidate ``observed - c * se`` as its lower end (``observed + c' * se`` its upper end).
    Every lower end is then above the true gain in at most ``tail`` % of samples for all k at once,
    as one candidate's percentile interval is alone. With k = 1 it is the basic bootstrap interval.
    A candidate whose gain does not vary over the resamples (the same figure on every pseudo-query,
    e.g. a setting that changes no ranking) has its observed gain as both ends."""
    se = means.std(axis=0)
    varies = se > 1e-12
    low, high = observed.astype(float).copy(), observed.astype(float).copy()
    if varies.any():
        z = (means[:, varies] - observed[varies]) / se[varies]  # (resamples, varying candidates)
        up, down = np.percentile(z.max(axis=1), 100 - tail), np.percentile((-z).max(axis=1), 100 - tail)
        low[varies] = observed[varies] - up * se[varies]
        high[varies] = observed[varies] + down * se[varies]
    return low, high


@dataclass(frozen=True)
class SwitchVerdict:
    """Whether an opt-in step beats ``off`` (the ranking without it): ``best`` is ``off`` unless a
    candidate gains significantly; ``shown`` is what the report names (the best, else the top one);
    ``low``..``high`` its interval, simultaneous over the ``family`` candidates tried."""
    best: Candidate
    top: Candidate
    shown: Candidate
    low: float
    high: float
    gain: float
    family: int


def switch_verdict(candidates: list[Candidate], off: Candidate, per_query: dict[str, np.ndarray],
                   params: Params) -> SwitchVerdict:
    """The paired-bootstrap decision for a step that is on or off: on only for a candidate whose
    interval of gain over ``off`` is above 0 and whose gain exceeds min_gain, recall guard applied.
    The intervals are simultaneous over all the candidates (max-T): picking the best of k settings
    must not turn a step on by the luck of one of k tries, so "off" is wrongly left with a chance of
    about (1 - confidence) / 2 for the whole family (as for one setting alone), not for each setting."""
    intervals = gain_intervals(candidates, off, per_query, params, simultaneous=True)
    metric = params.metric
    significant = [c for c in candidates if intervals[c.name][0] > 0
                   and c.scores[metric] - off.scores[metric] > params.min_gain]
    best = recall_guarded([*significant, off], params)[0]
    top = max(candidates, key=lambda c: c.scores[metric])
    shown = best if best is not off else top
    low, high = intervals[shown.name]
    return SwitchVerdict(best, top, shown, low, high, shown.scores[metric] - off.scores[metric], len(candidates))


def interval_words(params: Params, family: int) -> str:
    """How an interval is named in a reason: simultaneous over the ``family`` settings tried."""
    return f"{params.confidence:.0%} interval simultaneous over {family} settings"


def by_strategy(pairs: list[PseudoQuery], candidates: list[Candidate], per_query: dict[str, np.ndarray],
                metric: str, shown: dict[str, Candidate | None]) -> dict[str, dict[str, Any]]:
    """Per generator: how many pairs, the figures of the chosen, best single and file's setting
    on its pairs alone, and the candidate it alone would rank first."""
    column = METRICS.index(metric)
    out: dict[str, dict[str, Any]] = {}
    for strategy in sorted({p.strategy for p in pairs}):
        rows = np.array([i for i, p in enumerate(pairs) if p.strategy == strategy])
        entry: dict[str, Any] = {"pairs": len(rows)}
        for label, c in shown.items():
            if c is not None and c.name in per_query:
                entry[label] = {"name": c.name, **{m: round(float(per_query[c.name][rows, j].mean()), 5)
                                                   for j, m in enumerate(METRICS)}}
        own = max((c for c in candidates if c.name in per_query),
                  key=lambda c: per_query[c.name][rows, column].mean(), default=None)
        if own is not None:
            entry["own best"] = {"name": own.name, metric: round(float(per_query[own.name][rows, column].mean()), 5)}
        out[strategy] = entry
    return out


def summary(report: TuneReport, shown: int = 12) -> str:
    """The run summary: the best candidates, the single retrievers and the file's own setting with
    their pseudo-query figures, what was chosen and why, the time and the overlay."""
    metric = report.metric
    strategies = ", ".join(f"{n} {s}" for s, n in report.strategies.items())
    lines = [f"tuned on {report.pairs} pseudo-queries ({strategies}) over {report.chunks} chunks in "
             f"{report.seconds:.1f} s; {len(report.candidates)} candidates, by {metric}"
             + (" (time budget spent: not every BM25 variant was tried)" if report.budget_exhausted else ""),
             "",
             f"  {'rank':>4}  {'nDCG@10':>7}  {'MRR@10':>6}  {'R@100':>6}  candidate"]
    ranked = {c.name: i for i, c in enumerate(report.candidates, start=1)}
    singles = [c for c in report.candidates if c.setting.get("dense_weight") in (0.0, 1.0)]
    best_single = {("dense" if c.setting["dense_weight"] == 1.0 else "bm25"): c for c in reversed(singles)}
    extra = [c for c in (report.baseline, best_single.get("dense"), best_single.get("bm25"), report.chosen)
             if c is not None and ranked.get(c.name, 0) > shown]
    for c in report.candidates[:shown] + list({c.name: c for c in extra}.values()):
        marks = []
        if report.chosen and c.name == report.chosen.name:
            marks.append("chosen")
        if report.baseline and c.name == report.baseline.name:
            marks.append("pipelines.yaml")
        s = c.scores
        lines.append(f"  {ranked.get(c.name, 0):>4}  {s['ndcg@10']:7.4f}  {s['mrr@10']:6.4f}  {s['recall@100']:6.4f}  "
                     f"{c.name}" + (f"  <- {', '.join(marks)}" if marks else ""))
    lines.append("")
    if report.chosen is not None:
        lines.append(f"chosen: {report.chosen.name} ({report.reason})")
        lines.append(f"decided by: {report.rule}")
    for strategy, entry in report.by_strategy.items():
        figures = ", ".join(f"{label} {entry[label][metric]:.4f}" for label in ("chosen", "best single", "pipelines.yaml")
                            if label in entry)
        own = entry.get("own best")
        lines.append(f"  {strategy} ({entry['pairs']} pairs): {figures}"
                     + (f"; its own best: {own['name']} {own[metric]:.4f}" if own else ""))
    if report.gate_floor is not None:
        lines.append(f"answerability gate: refuses questions with no reference above {report.gate_floor:.3f} "
                     f"similarity (what the pseudo-queries' own sources clear)")
    if report.gate_llm is not None:
        lines.append(f"answerability gate, LLM check ({report.gate_llm.pairs} pseudo-queries): {report.gate_llm.reason}")
    for stage, entry in report.expansions.items():
        lines.append(f"{stage} ({', '.join(entry['steps'])}): {entry['reason']}")
        if entry.get("by_strategy"):
            lines.append("  gain per strategy: " + ", ".join(f"{s} {g:+.4f}" for s, g in entry["by_strategy"].items()))
    lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()))
    lines.append(f"overlay: {report.overlay}" + ("" if report.written else " (not written: dry run)"))
    if report.written:
        lines.append("search and ask use it from now on; `ragline validate` shows it, --no-tuned ignores it")
    return "\n".join(lines)


def strategy_gains(pairs: list[PseudoQuery], per_query: dict[str, np.ndarray], candidate: Candidate,
                   off: Candidate, metric: str) -> dict[str, float]:
    """The candidate's mean gain over off on each strategy's pseudo-queries alone."""
    column = METRICS.index(metric)
    gains = per_query[candidate.name][:, column] - per_query[off.name][:, column]
    return {s: round(float(np.mean([g for g, p in zip(gains, pairs) if p.strategy == s])), 5)
            for s in sorted({p.strategy for p in pairs})}
