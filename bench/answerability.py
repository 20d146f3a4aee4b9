"""Can the answerability gate tell RGB's answerable items from its unanswerable ones?

Usage: .venv/bin/python bench/answerability.py [--llm-items 30] [--calibrate 60] [--no-llm] [--no-readme]

RGB en_fact gives each question passages that contain the answer (positive) and passages on the
same topic that do not (negative). For each item the gate sees the question with its positives
(passing is right) and with its negatives only (refusing is right). Signals:

1. ``similarity`` (the gate's ``min_similarity``): the closest passage's cosine similarity. Its
   floor is the one ``ragline tune`` sets on the RGB collection (bench/tuning.py builds it: every
   RGB passage, indexed in its private workspace), from pseudo-queries, without labels.
2. ``llm`` (the gate's ``min_probability``): P(yes) from the gate's own prompt
   (prompts/answerable.j2) on the LLM of pipelines.yaml (RAGLINE_LLM_BASE_URL, RAGLINE_LLM_MODEL),
   first N items. Its threshold is the one ``ragline tune`` sets with ``gate_llm_pairs`` (the
   ``--calibrate`` pseudo-queries of the RGB collection asked with their own source), no labels.

Reported: each signal's AUC (1.0: perfect, 0.5: chance) and refusal rates: at the tuned thresholds,
and at the best threshold that still passes 95 % of positives (chosen with the labels, so an upper
bound of what any threshold could do, not a tuned figure). LLM rows of other models from earlier
runs (bench/out/answerability.json) are kept, one per model.
"""
from __future__ import annotations

import argparse
import json
import time

from common import DATA, OUT, REPO, publish, save
from tuning import rgb_as_beir

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import ContextDocument, Passage
from ragline.flows.evaluation.retrieval import eval_workspace, load_beir
from ragline.tasks.generate.answerable import probability, similarity
from ragline.tasks.jobs.tune_retrieval import auc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llm-items", type=int, default=30)
    parser.add_argument("--calibrate", type=int, default=60, help="pseudo-queries the tuner asks the LLM about")
    parser.add_argument("--no-llm", action="store_true")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    result = run(0 if args.no_llm else args.llm_items, args.calibrate)
    earlier = OUT / "answerability.json"
    if earlier.exists():  # other models' rows stay
        kept = json.loads(earlier.read_text()).get("llm", {})
        kept = {m: r for m, r in kept.items() if isinstance(r, dict) and "auc" in r}
        result["llm"] = {**kept, **result.get("llm", {})}
    save("answerability", result)
    publish("gate", table(result), readme=not args.no_readme)


def run(llm_items: int, calibrate: int) -> dict:
    items = [json.loads(line) for line in (DATA / "rgb" / "en_fact.json").read_text().splitlines() if line.strip()]
    items = [i for i in items if i["positive"] and i["negative"]]
    dataset = load_beir(rgb_as_beir(OUT / "rgb-beir"), "test")
    project = load_project(REPO / "pipelines.yaml", tuned=False)
    project = project.relocated(eval_workspace(project, dataset, "index"))
    engine.run(project.pipeline("index").with_overrides({"load": {"paths": [str(dataset.corpus.resolve())]}}),
               orchestrate=False)
    started = time.perf_counter()
    tune = {"write": False, "gate_llm_pairs": calibrate if llm_items else 0}
    report = engine.run(project.pipeline("tune").with_overrides({"tune": tune}), orchestrate=False)
    calibration = report.gate_llm
    print(f"tuned floor {report.gate_floor}; LLM check: {calibration.reason if calibration else 'not calibrated'} "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    embedder = project.resource("embedder")
    sims = {kind: [similarity(embedder, i["query"], i[kind]) for i in items] for kind in ("positive", "negative")}
    result = {"items": len(items), "floor": report.gate_floor,
              "similarity": signal(sims["positive"], sims["negative"], report.gate_floor)}
    if llm_items:
        llm, prompts = project.resource("llm"), project.prompts
        probs: dict[str, list[float]] = {"positive": [], "negative": []}
        started = time.perf_counter()
        for n, item in enumerate(items[:llm_items]):
            for kind in probs:
                documents = [ContextDocument(number=j, passage=Passage(chunk_id=str(j), source_id=str(j), text=text))
                             for j, text in enumerate(item[kind][:5], start=1)]
                probs[kind].append(probability(llm, prompts.render("answerable", question=item["query"],
                                                                   documents=documents)))
            print(f"llm {n + 1}/{llm_items}: {probs['positive'][-1]:.2f} {probs['negative'][-1]:.2f}", flush=True)
        model = project.spec.resources["llm"].model
        threshold = calibration.threshold if calibration else None
        result["llm"] = {model: {**signal(probs["positive"], probs["negative"], threshold),
                                 "model": model, "threshold": threshold,
                                 "calibration": calibration.model_dump() if calibration else None,
                                 "seconds_per_check": round((time.perf_counter() - started) / (2 * llm_items), 2)}}
    return result


def signal(positive: list[float], negative: list[float], floor: float | None) -> dict:
    """AUC, refusal rates at ``floor``, and at the labelled threshold passing 95 % of positives."""
    ranked = sorted(positive)
    best = ranked[int(0.05 * len(ranked))]  # 95 % of positives at or above it
    out = {"items": len(positive), "auc": round(auc(positive, negative), 3),
           "oracle_threshold": round(best, 4),
           "oracle_refused_with_negatives": round(sum(n < best for n in negative) / len(negative), 3),
           "oracle_refused_with_positives": round(sum(p < best for p in positive) / len(positive), 3)}
    if floor is not None:
        out["refused_with_negatives"] = round(sum(n < floor for n in negative) / len(negative), 3)
        out["refused_with_positives"] = round(sum(p < floor for p in positive) / len(positive), 3)
    return out


def table(result: dict) -> list[str]:
    lines = [f"RGB en_fact, {result['items']} items, each with its positive passages and with its negatives only "
             f"(target: refuse ≥ 60 % of the negatives-only items while accuracy with positives stays ≥ 0.80).", "",
             "| signal | items | AUC | threshold | refused: negatives only | refused: with the answer |",
             "|---|---|---|---|---|---|"]
    s = result["similarity"]
    lines.append(f"| similarity, floor set by `ragline tune` | {s['items']} | {s['auc']:.2f} | {result['floor']:.3f} | "
                 f"{s['refused_with_negatives']:.2f} | {s['refused_with_positives']:.2f} |")
    lines.append(f"| similarity, best threshold chosen with the labels | {s['items']} | {s['auc']:.2f} | "
                 f"{s['oracle_threshold']:.3f} | {s['oracle_refused_with_negatives']:.2f} | "
                 f"{s['oracle_refused_with_positives']:.2f} |")
    notes = []
    for m in result.get("llm", {}).values():
        c = m.get("calibration")
        if m.get("threshold") is not None:
            verdict = "set" if c["enabled"] else "left off"
            lines.append(f"| LLM P(answerable), {m['model']}, threshold from `ragline tune` ({c['pairs']} "
                         f"pseudo-queries; {verdict}) | {m['items']} | {m['auc']:.2f} | {m['threshold']:.3f} | "
                         f"{m['refused_with_negatives']:.2f} | {m['refused_with_positives']:.2f} |")
            notes.append(f"- {m['model']}: on the pseudo-queries, without labels, the tuner measured AUC "
                         f"{c['auc']:.2f} and {c['refused_unanswerable']:.0%} refused without the source, "
                         f"{c['refused_answerable']:.0%} with it: {verdict} (it needs 25 % refused without). "
                         f"{m['seconds_per_check']} s per check.")
        lines.append(f"| LLM P(answerable), {m['model']}, best threshold chosen with the labels | {m['items']} | "
                     f"{m['auc']:.2f} | {m['oracle_threshold']:.3f} | {m['oracle_refused_with_negatives']:.2f} | "
                     f"{m['oracle_refused_with_positives']:.2f} |")
    return lines + ([""] + notes if notes else [])


if __name__ == "__main__":
    main()
