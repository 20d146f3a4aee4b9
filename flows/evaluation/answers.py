"""Answer evaluation on RGB-format data: EM, token F1, citation validity, rejection, fact checking.

Each RGB item carries its own references. They are indexed together, tagged with the item's id,
and the query pipeline runs with a metadata filter on that id: the real retrieval path, restricted
to the item's passages. Three corpora: `positive` (contain the answer), `negative` (do not: the
right response is a refusal) and `positive_wrong` (counterfactual edits stating a fake answer).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragline.flows.run import engine
from ragline.flows.run.targets import load_step_id
from ragline.flows.spec.compile import Project
from ragline.flows.spec.model import require_kinds
from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, ContextDocument, Passage, Query
from ragline.flows.resources.models.llm_output import normalize_text as normalize, strip_citations

CORPORA = ("positive", "negative", "positive_wrong")


@dataclass
class RgbItem:
    id: str
    query: str
    answers: list[str]
    fake_answers: list[str]
    passages: dict[str, list[str]]


def _flatten(value: Any) -> list[str]:
    if isinstance(value, list):
        return [s for v in value for s in _flatten(v)]
    return [str(value)] if value not in (None, "") else []


def load_rgb(path: str | Path) -> list[RgbItem]:
    """One JSON object per line: query, answer (str or nested lists of aliases), fakeanswer, passages."""
    items = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                items.append(RgbItem(str(record["id"]), record["query"], _flatten(record["answer"]),
                                     _flatten(record.get("fakeanswer")),
                                     {c: [p for p in record.get(c, []) if p.strip()] for c in CORPORA}))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not an RGB record ({type(exc).__name__}: {exc})") from None
    return items


# ----------------------------------------------------------------------------- metrics (SQuAD-style)
def exact_match(prediction: str, golds: list[str]) -> float:
    return float(any(normalize(prediction) == normalize(g) for g in golds))


def token_f1(prediction: str, golds: list[str]) -> float:
    best = 0.0
    predicted = normalize(prediction).split()
    for gold in golds:
        expected = normalize(gold).split()
        common = sum((Counter(predicted) & Counter(expected)).values())
        if common:
            precision, recall = common / len(predicted), common / len(expected)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains(prediction: str, golds: list[str]) -> float:
    """RGB's accuracy: the answer string appears in the response."""
    text = normalize(prediction)
    return float(any(normalize(g) and normalize(g) in text for g in golds))


# ----------------------------------------------------------------------------- running
def _index_corpus(project: Project, items: list[RgbItem], corpus: str, workdir: Path, orchestrate: bool,
                  index_pipeline: str = "index") -> Project:
    """The project relocated to this corpus' private index, with the corpus indexed there."""
    records = [{"_id": f"{item.id}-{j}", "title": "", "text": passage, "metadata": {"rgb_id": item.id}}
               for item in items for j, passage in enumerate(item.passages[corpus])]
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{corpus}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    project = project.relocated(workdir / corpus)
    indexer = project.pipeline(index_pipeline)
    load_step = load_step_id(indexer)
    engine.run(indexer.with_overrides({load_step: {"paths": [str(path)]}}), orchestrate=orchestrate)
    return project


def _ask(project: Project, pipeline: str, item: RgbItem, orchestrate: bool) -> Answer:
    query = {"text": item.query, "filters": {"rgb_id": item.id}}
    return engine.run(project.pipeline(pipeline), {"query": query}, orchestrate=orchestrate)


def _answer_metrics(answers: list[Answer], items: list[RgbItem], golds_of) -> dict[str, float]:
    n = max(1, len(answers))
    texts = [strip_citations(a.text) for a in answers]
    cited = [a for a in answers if a.citations]
    return {
        "exact_match": round(sum(exact_match(t, golds_of(i)) for t, i in zip(texts, items)) / n, 4),
        "token_f1": round(sum(token_f1(t, golds_of(i)) for t, i in zip(texts, items)) / n, 4),
        "accuracy": round(sum(contains(a.text, golds_of(i)) for a, i in zip(answers, items)) / n, 4),
        "draft_accuracy": round(sum(contains(a.draft or a.text, golds_of(i)) for a, i in zip(answers, items)) / n, 4),
        "refusal_rate": round(sum(a.refused for a in answers) / n, 4),
        "citation_rate": round(len(cited) / n, 4),
        "citation_validity": round(sum(not a.invalid_citations for a in cited) / max(1, len(cited)), 4),
    }


CHECKS = {"as_configured": {}, "llm_fact_check": {"fact_check": True, "min_grounding": 0.0},
          "grounding_only": {"fact_check": False, "min_grounding": 0.6}}


def fact_check_claims(project: Project, pipeline: str, items: list[RgbItem]) -> dict[str, Any]:
    """The pipeline's verify step on each item's true and counterfactual answer, judged against the
    true references: as configured, as an LLM fact check alone, and as a grounding check alone."""
    compiled = project.pipeline(pipeline)
    step = next((s for s in compiled.steps if s.stage.name == "verify"), None)
    if step is None:
        return {}
    checked = [i for i in items if i.fake_answers and i.passages["positive"]]
    results = {}
    for name, override in CHECKS.items():
        overridden = compiled.with_overrides({step.id: override})  # binds the LLM where fact_check turns it on
        checker = next(s for s in overridden.steps if s.id == step.id)
        params = checker.params
        prompt = step.spec.prompt or step.stage.default_prompt(params)
        kept_true = flagged_fake = 0
        for item in checked:
            documents = [ContextDocument(number=j, passage=Passage(chunk_id=f"{item.id}-{j}", source_id=item.id,
                                                                   text=p))
                         for j, p in enumerate(item.passages["positive"][:5], start=1)]
            context, query = Context(documents=documents), Query(text=item.query)
            for claim, is_true in ((item.answers[0], True), (item.fake_answers[0], False)):
                ctx = StepContext(pipeline=pipeline, step_id=step.id, prompt_name=prompt,
                                  render_prompt=project.prompts.render)
                claimed = Answer(question=item.query, text=claim, citations=[d.number for d in documents])
                verdict = engine.invoke(overridden, checker, {"query": query, "context": context, "answer": claimed},
                                        ctx, params=params)
                kept_true += is_true and not verdict.refused
                flagged_fake += (not is_true) and verdict.refused
        n = max(1, len(checked))
        results[name] = {"true_answers_kept": round(kept_true / n, 4), "fake_answers_rejected": round(flagged_fake / n, 4),
                         "balanced_accuracy": round((kept_true + flagged_fake) / (2 * n), 4)}
    return {"claims": len(checked), **results}


def evaluate_answers(project: Project, path: str | Path, pipeline: str = "ask", limit: int | None = None,
                     orchestrate: bool = False, index_pipeline: str = "index") -> dict[str, Any]:
    items = load_rgb(path)[:limit]
    workdir = project.base_dir / ".ragline" / "eval" / f"rgb-{Path(path).stem}"
    require_kinds(project, query=pipeline, ingestion=index_pipeline)
    result: dict[str, Any] = {"dataset": Path(path).name, "pipeline": pipeline, "questions": len(items),
                              "model": project.spec.resources.get("llm").model if "llm" in project.spec.resources else None}
    for corpus in CORPORA:
        indexed = _index_corpus(project, items, corpus, workdir, orchestrate, index_pipeline)
        started = time.perf_counter()
        answers = [_ask(indexed, pipeline, item, orchestrate) for item in items]
        seconds = time.perf_counter() - started
        metrics = _answer_metrics(answers, items, lambda i: i.answers)
        if corpus == "positive_wrong":
            metrics["fake_answer_rate"] = _answer_metrics(answers, items, lambda i: i.fake_answers or ["\0"])["accuracy"]
        metrics["seconds_per_question"] = round(seconds / max(1, len(items)), 2)
        result[corpus] = metrics
    result["fact_check"] = fact_check_claims(project.relocated(workdir / "positive"), pipeline, items)
    return result
