"""Answer quality on RGB en_fact (100 questions) through the `ask` pipeline and a real LLM server:
EM, token F1, accuracy (answer string in the response), citations, refusals, fact checking.
Accuracy with the answer is the `positive` row, refusal with negatives only the `negative` row's
refusal rate, the fake-answer rejection the `positive_wrong` row's refusal rate (and how often it
repeats the fake answer). With --limit N the table says it is a subset.

Usage: .venv/bin/python bench/rgb_answers.py [--limit N] [--pipeline ask]
Needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh, or RAGLINE_LLM_BASE_URL).
"""
from __future__ import annotations

import argparse
import json

from common import DATA, OUT, REPO, save, publish

from ragline.flows.spec.compile import load_project
from ragline.flows.evaluation.answers import evaluate_answers

ROWS = [("positive", "references contain the answer"), ("negative", "references do not contain it"),
        ("positive_wrong", "counterfactual references (fake answer)")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int)
    parser.add_argument("--pipeline", default="ask")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    args = parser.parse_args()
    if args.table_only:
        result = json.loads((OUT / "rgb_answers.json").read_text())
    else:
        project = load_project(REPO / "pipelines.yaml")
        result = evaluate_answers(project, DATA / "rgb" / "en_fact.json", args.pipeline, limit=args.limit)
        save("rgb_answers", result)
    subset = f" (the first {result['questions']}: a subset)" if result["questions"] < 100 else ""
    table = [f"RGB en_fact, {result['questions']} questions{subset}, pipeline `{result['pipeline']}`, "
             f"model {result['model']} (SmolLM2-135M-Instruct, bf16, vLLM CPU).", "",
             "| references | accuracy | EM | token F1 | refusal rate | cited | citations valid | s / question |",
             "|---|---|---|---|---|---|---|---|"]
    for corpus, label in ROWS:
        r = result[corpus]
        extra = f" (repeats the fake answer: {r['fake_answer_rate']:.2f})" if "fake_answer_rate" in r else ""
        table.append(f"| {label}{extra} | {r['accuracy']:.2f} | {r['exact_match']:.2f} | {r['token_f1']:.2f} | "
                     f"{r['refusal_rate']:.2f} | {r['citation_rate']:.2f} | {r['citation_validity']:.2f} | "
                     f"{r['seconds_per_question']} |")
    checks = result["fact_check"]
    table += ["", f"Fact check of each item's true answer and its counterfactual answer against the true "
                  f"references ({checks['claims']} pairs):", "",
              "| check | true answers kept | fake answers rejected | balanced accuracy |", "|---|---|---|---|"]
    for name in ("as_configured", "grounding_only", "llm_fact_check"):
        c = checks[name]
        table.append(f"| {name.replace('_', ' ')} | {c['true_answers_kept']:.2f} | {c['fake_answers_rejected']:.2f} | "
                     f"**{c['balanced_accuracy']:.2f}** |")
    publish("rgb", table, readme=not args.no_readme)


if __name__ == "__main__":
    main()
