"""How far the answer judge of `ragline eval --judge` can be trusted: its agreement with RGB's labels,
and the size and cost of a test set generated from SciFact (issue 20.4).

RGB gives each question passages that contain the answer (positive) and passages retrieved for it
that do not (negative), a gold answer and, for many, a counterfactual (fake) answer. Labelled pairs:

- context relevance: (question, a positive passage) is relevant, (question, a negative passage) is
  not; judged by the LLM (P(yes)) and by the packaged embedder (cosine), the two packaged models;
- faithfulness, grounded vs not: the gold answer with two positive passages is supported, with two
  negative passages (same topic, no answer) it is not: what an answer built from poor retrieval is;
- faithfulness, true vs counterfactual: the gold answer vs the fake answer, both with the positive
  passages: a claim the passages contradict (the hard case; the verify stage's fact check);
- answer relevance: the gold answer to its question vs another question's gold answer.

Then a SciFact sub-corpus is indexed and `generate_testset` writes questions from it with the LLM
(timed); retrieval on them is scored by the source document (hit@10, MRR@10).

Usage: RAGLINE_LLM_BASE_URL=http://127.0.0.1:8000/v1 .venv/bin/python bench/judge_agreement.py \
           [--items 30] [--docs 100] [--questions 20]
Needs an LLM server (deploy/vllm/serve.sh): SmolLM2-135M on CPU answers ~1 judge call per second.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from common import DATA, REPO, publish, save, subset_corpus

from ragline.flows.evaluation.answers import load_rgb
from ragline.flows.evaluation.judge import (Judge, agreement, cosine_scorer, evaluate_testset, generate_testset,
                                            judge_llm, save_testset)
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project


def rgb_agreement(project, items: int, seed: int) -> dict:
    judge = Judge(judge_llm(project), project.prompts.render)
    cosine = cosine_scorer(project.resource("embedder"))
    data = [i for i in load_rgb(DATA / "rgb" / "en_fact.json") if i.passages["positive"] and i.passages["negative"]]
    sample = random.Random(seed).sample(data, min(items, len(data)))
    scores: dict[str, list] = {k: [] for k in ("ctx_llm", "ctx_cos", "grounded", "counterfactual", "relevance")}
    labels: dict[str, list] = {k: [] for k in scores}
    started = time.perf_counter()
    for n, item in enumerate(sample):
        positive, negative = item.passages["positive"][0], item.passages["negative"][0]
        scores["ctx_llm"] += judge.context_relevance(item.query, [positive, negative])
        scores["ctx_cos"] += cosine(item.query, [positive, negative])
        labels["ctx_llm"] += [True, False]
        labels["ctx_cos"] += [True, False]
        gold = item.answers[0]
        for passages, label in ((item.passages["positive"][:2], True), (item.passages["negative"][:2], False)):
            claims = judge.faithfulness(item.query, gold, dict(enumerate(passages, start=1)))
            scores["grounded"].append(claims[0].score if claims else None)
            labels["grounded"].append(label)
        if item.fake_answers:
            for claim, label in ((gold, True), (item.fake_answers[0], False)):
                claims = judge.faithfulness(item.query, claim, dict(enumerate(item.passages["positive"][:2], 1)))
                scores["counterfactual"].append(claims[0].score if claims else None)
                labels["counterfactual"].append(label)
        other = sample[(n + 1) % len(sample)].answers[0]
        scores["relevance"] += [judge.answer_relevance(item.query, gold), judge.answer_relevance(item.query, other)]
        labels["relevance"] += [True, False]
    seconds = time.perf_counter() - started
    everything = data  # the embedder is cheap: every item, every passage
    all_cos, all_labels = [], []
    for item in everything:
        texts = item.passages["positive"] + item.passages["negative"]
        all_cos += cosine(item.query, texts)
        all_labels += [True] * len(item.passages["positive"]) + [False] * len(item.passages["negative"])
    result = {name: agreement(scores[name], labels[name]) for name in scores}
    result["ctx_cos_all"] = {**agreement(all_cos, all_labels), "items": len(everything)}
    # cosine has no natural 0.5 threshold: agreement at the median is what a tuned threshold would give
    median = sorted(all_cos)[len(all_cos) // 2]
    result["ctx_cos_all"]["agreement_at_median"] = agreement(all_cos, all_labels, median)["agreement"]
    result["ctx_cos"]["agreement_at_median"] = agreement(scores["ctx_cos"], labels["ctx_cos"], median)["agreement"]
    return {"items": len(sample), "llm_calls": judge.calls, "seconds": round(seconds, 1), "metrics": result}


def scifact_testset(docs: int, questions: int, work: Path) -> dict:
    (work / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text())
    (work / "prompts").symlink_to(REPO / "prompts")
    corpus = subset_corpus(docs, work / "corpus")
    project = load_project(work / "pipelines.yaml")
    started = time.perf_counter()
    engine.run(project.pipeline("index").with_overrides({"load": {"paths": [str(corpus)]}}), orchestrate=False)
    indexed = time.perf_counter() - started
    rows, stats = generate_testset(project, questions, seed=0)
    path = save_testset(work / "generated.jsonl", rows)
    retrieval = evaluate_testset(project, path, "search")
    return {**stats, "asked": questions, "index_seconds": round(indexed, 1), "corpus_docs": docs,
            "seconds_per_question": round(stats["seconds"] / max(1, stats["questions"]), 2),
            "hit@10": retrieval["hit@10"], "mrr@10": retrieval["mrr@10"],
            "examples": [r.question for r in rows[:3]]}


def table(result: dict) -> list[str]:
    m, t = result["rgb"]["metrics"], result["testset"]
    model = result["model"]

    def row(label: str, judge: str, key: str) -> str:
        a = m[key]
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        extra = f" ({fmt(a['agreement_at_median'])} at the median)" if "agreement_at_median" in a else ""
        return f"| {label} | {judge} | {a['n']} | {fmt(a['agreement'])}{extra} | {fmt(a['auc'])} | {a['unreadable']} |"

    lines = [f"RGB en_fact, {result['rgb']['items']} questions sampled (seed 0), judge model {model} "
             f"(SmolLM2-135M-Instruct, bf16, vLLM on 2 busy CPU cores): {result['rgb']['llm_calls']} judge calls in "
             f"{result['rgb']['seconds']} s. Agreement: P(yes) >= 0.5 matches the label; AUC 0.5 is chance.", "",
             "| labelled pairs | judge | n | agreement | ROC AUC | unreadable |", "|---|---|---|---|---|---|",
             row("context relevance: positive vs negative passage", "LLM P(yes)", "ctx_llm"),
             row("context relevance: same pairs", "embedder cosine", "ctx_cos"),
             row(f"context relevance: every passage of all {m['ctx_cos_all']['items']} questions", "embedder cosine",
                 "ctx_cos_all"),
             row("faithfulness: gold answer with positive vs negative passages", "LLM P(yes)", "grounded"),
             row("faithfulness: gold vs counterfactual answer, positive passages", "LLM P(yes)", "counterfactual"),
             row("answer relevance: own gold answer vs another question's", "LLM P(yes)", "relevance"), "",
             f"Test set from SciFact's first {t['corpus_docs']} abstracts (indexed in {t['index_seconds']} s): "
             f"{t['asked']} questions asked for, {t['questions']} written from {t['documents']} documents in "
             f"{t['seconds']} s ({t['seconds_per_question']} s per question, LLM doc2query, max 64 tokens); "
             f"the `search` pipeline finds the source document in the top 10 for {t['hit@10']:.2f} of them "
             f"(MRR@10 {t['mrr@10']:.2f})."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=30, help="RGB questions judged by the LLM")
    parser.add_argument("--docs", type=int, default=100, help="SciFact abstracts indexed for the test set")
    parser.add_argument("--questions", type=int, default=20, help="test-set questions to generate")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    if not os.environ.get("RAGLINE_LLM_BASE_URL"):
        parser.error("set RAGLINE_LLM_BASE_URL to a running OpenAI-compatible server (deploy/vllm/serve.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        testset = scifact_testset(args.docs, args.questions, work)
        project = load_project(work / "pipelines.yaml")
        result = {"model": os.environ.get("RAGLINE_LLM_MODEL", "smollm2"), "testset": testset,
                  "rgb": rgb_agreement(project, args.items, seed=0)}
    save("judge_agreement", result)
    publish("judge", table(result), readme=not args.no_readme)


if __name__ == "__main__":
    main()
