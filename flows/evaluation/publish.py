"""What an evaluation run shows on the Prefect dashboard, beside the run (issue 20.5).

``ragline eval`` runs its evaluation as one flow run of ``evaluation_run`` when Prefect is used
(``--prefect``, or a Prefect API is configured), and publishes one markdown artifact there: the
dataset and split, the pipeline, the counts, the metrics (nDCG@10, Recall@100, MRR@10, ... on a
BEIR folder; hit@10 and MRR@10 on a generated test set, with the judge's scores under ``--judge``;
the answer metrics per corpus on an RGB file) and a plot of how the queries spread (per-query
nDCG@10, the rank of each question's source document, per-answer faithfulness). The queries inside
run in-process, as without Prefect: the flow run adds one run's bookkeeping, not one per query.

Dataset names, pipeline names and overlay paths come from files: every value goes through
``artifacts.cell`` (inert text); plots are ``artifacts`` SVG images.
"""
from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable

from prefect import flow

from ragline.flows.evaluation.judge import SCORES
from ragline.flows.evaluation.retrieval import METRICS
from ragline.flows.run.artifacts import artifact_key, bar_plot, cell, histogram, publish_markdown, table

log = logging.getLogger("ragline.progress")

FLOW_NAME = "ragline-eval"
NDCG_EDGES = [i / 10 for i in range(11)]
RANK_BUCKETS = (("1", 1, 1), ("2", 2, 2), ("3", 3, 3), ("4-5", 4, 5), ("6-10", 6, 10))
SCORE_EDGES = [i / 5 for i in range(6)]
CORPORA = ("positive", "negative", "positive_wrong")
_WORK: contextvars.ContextVar[Callable[[], dict[str, Any]] | None] = contextvars.ContextVar("ragline_eval_work",
                                                                                          default=None)


@flow(name=FLOW_NAME, flow_run_name="eval {label}", validate_parameters=False, persist_result=False,
      log_prints=False)
def evaluation_run(label: str, kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One evaluation (the work ``run`` set for this call) and its report as an artifact of this
    flow run. ``settings``: what was evaluated (dataset, split, pipeline), shown as parameters."""
    work = _WORK.get()
    if work is None:
        raise RuntimeError("evaluation_run runs an evaluation `publish.run` hands it; start it with ragline eval")
    result = work()
    publish(result, kind, settings.get("split"))
    return result


def run(work: Callable[[], dict[str, Any]], *, kind: str, settings: dict[str, Any], as_flow: bool,
        required: bool = True) -> dict[str, Any]:
    """``work()`` as a flow run of ``evaluation_run`` (``as_flow``) or directly. A flow run that
    cannot start when Prefect was not asked for (``required`` false: an API is merely configured)
    leaves the evaluation in-process, with a warning: the figures matter more than the dashboard."""
    if not as_flow:
        return work()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    started: list[bool] = []

    def tracked() -> dict[str, Any]:
        started.append(True)
        return work()

    token = _WORK.set(tracked)
    label = " ".join(str(settings[k]) for k in ("dataset", "split", "pipeline") if settings.get(k))
    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):  # in-process: no heartbeats
            return evaluation_run(label=label, kind=kind, settings=settings)
    except Exception as exc:
        if started or required:
            raise
        log.warning("the evaluation runs without a flow run (the Prefect API did not take one: %s)", exc)
        return work()
    finally:
        _WORK.reset(token)


def publish(result: dict[str, Any], kind: str, split: str | None = None) -> str | None:
    """The evaluation's report as a markdown artifact of the current flow run (None outside one)."""
    key = artifact_key(f"eval-{result.get('dataset', '')}-{result.get('pipeline', '')}")
    return publish_markdown(key, evaluation_markdown(result, kind, split), f"ragline evaluation of "
                                                                        f"{result.get('pipeline')}")


def evaluation_markdown(result: dict[str, Any], kind: str, split: str | None = None) -> str:
    """``kind``: "beir" (a BEIR folder or a feedback export), "generated" (a generated test set,
    judged or not) or "answers" (an RGB file)."""
    if kind == "answers":
        return _answers_markdown(result)
    where = f"{result.get('dataset')} ({split or result.get('kind') or 'test'})"
    lines = [f"# Evaluation {cell(where)}: pipeline {cell(result.get('pipeline'))}", "",
             f"{result.get('queries', 0)} queries, {cell(result.get('query_ms_mean'))} ms per query (mean)."]
    if result.get("index_summary"):
        lines += ["", f"Index: {cell(result['index_summary'])} in {cell(result.get('index_seconds'))} s."]
    if result.get("overlay"):
        lines += ["", f"Tuned overlay: {cell(result['overlay'])} ({len(result.get('overlay_changes') or [])} "
                      "settings applied)."]
    elif "overlay" in result:
        lines += ["", "Tuned overlay: none (the pipelines file as written)."]
    figures = dict(result)
    if result.get("judge"):
        figures["supported_claims"] = result["judge"].get("supported_claims")
    names = [m for m in dict.fromkeys((*METRICS, "hit@10", *SCORES, "supported_claims")) if m in figures]
    lines += ["", "## Metrics", "", *table(["metric", "value"], [[m, _figure(figures[m])] for m in names])]
    if result.get("judge"):
        judge = result["judge"]
        lines += ["", f"Judged by {cell(result.get('judge_model'))} on the answers of pipeline "
                      f"{cell(result.get('answer_pipeline'))}: {judge.get('items')} answers, {judge.get('claims')} "
                      f"claims, {judge.get('refused')} refusals, {judge.get('unreadable')} unreadable verdicts, "
                      f"{judge.get('llm_calls')} LLM calls in {judge.get('seconds')} s."]
    lines += _plots(result)
    return "\n".join(lines) + "\n"


def _plots(result: dict[str, Any]) -> list[str]:
    per_query = result.get("per_query") or {}
    lines: list[str] = []
    if per_query.get("ndcg@10"):
        values = per_query["ndcg@10"]
        lines += bar_plot([f"{low:.1f}-{high:.1f}" for low, high in zip(NDCG_EDGES, NDCG_EDGES[1:])],
                          histogram(values, NDCG_EDGES), f"queries by nDCG@10 ({len(values)} queries)")
    if per_query.get("rank"):
        ranks = per_query["rank"]
        counts = [sum(r is not None and low <= r <= high for r in ranks) for _, low, high in RANK_BUCKETS]
        lines += bar_plot([label for label, _, _ in RANK_BUCKETS] + ["not in top 10"],
                          counts + [len(ranks) - sum(counts)], "questions by the rank of their source document")
    faithfulness = [i["faithfulness"] for i in result.get("items") or () if i.get("faithfulness") is not None]
    if faithfulness:
        lines += bar_plot([f"{low:.1f}-{high:.1f}" for low, high in zip(SCORE_EDGES, SCORE_EDGES[1:])],
                          histogram(faithfulness, SCORE_EDGES), f"answers by faithfulness ({len(faithfulness)} "
                                                                f"judged)")
    return ["", "## Per query", *lines] if lines else []


def _answers_markdown(result: dict[str, Any]) -> str:
    lines = [f"# Evaluation {cell(result.get('dataset'))}: pipeline {cell(result.get('pipeline'))}", "",
             f"{result.get('questions', 0)} questions, answered by {cell(result.get('model') or 'the pipeline')}."]
    corpora = [c for c in CORPORA if isinstance(result.get(c), dict)]
    names = list(dict.fromkeys(name for c in corpora for name in result[c]))
    if corpora:
        lines += ["", "## Answers per corpus", "",
                  *table(["corpus", *names], [[c, *(_figure(result[c].get(n)) for n in names)] for c in corpora]),
                  *bar_plot([f"{c} {m.replace('_rate', '')}" for c in corpora for m in ("accuracy", "refusal_rate")],
                            [result[c].get(m) or 0.0 for c in corpora for m in ("accuracy", "refusal_rate")],
                            "accuracy and refusals per corpus")]
    checks = {k: v for k, v in (result.get("fact_check") or {}).items() if isinstance(v, dict)}
    if checks:
        columns = list(dict.fromkeys(n for v in checks.values() for n in v))
        lines += ["", f"## Fact check ({result['fact_check'].get('claims', 0)} claims)", "",
                  *table(["check", *columns], [[k, *(_figure(v.get(n)) for n in columns)]
                                                for k, v in checks.items()])]
    return "\n".join(lines) + "\n"


def _figure(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
