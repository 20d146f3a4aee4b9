"""Answer quality that counts wrong answers (issue 34): right, wrong-but-answered, refused when
answerable, refused when not, citation validity and time to the first cited answer, per pipeline, on

- the own QA set (bench/data/answer_quality: five made-up company documents written for this bench,
  30 answerable questions and 10 unanswerable ones, near misses among them), indexed with the shipped
  `index` pipeline;
- RGB en_fact (../shared/data/rgb, read in place): answer present (`positive`), absent (`negative`),
  counterfactual (`positive_wrong`, informational: the references state a fake answer), each item's
  references indexed together and searched with a filter on the item (flows/evaluation/answers.py).
  The extractor's weights and floor were set looking at the dev split (even item positions) only;
  the reported RGB rows are the test split (odd positions) unless --split all.

A question counts as answerable when its references hold one of its gold answers (RGB's negatives
sometimes do). Right: answered and a gold answer appears in the answer (RGB's accuracy); wrong:
answered otherwise. Citation valid: every [n] names an inserted passage and each evidence span is
found at its offsets in the cited passage. Time: the whole pipeline in-process, index warm.

Usage: .venv/bin/python bench/answer_quality.py [--pipelines ask_extractive,ask] [--split test|dev|all]
`ask` needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh or RAGLINE_LLM_BASE_URL); it is
left out, with the reason in the table, when none answers.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from common import DATA, OUT, REPO, publish, save

from ragline.flows.contracts import Answer
from ragline.flows.evaluation.answers import _ask, _index_corpus, contains, load_rgb
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

OWN = REPO / "bench" / "data" / "answer_quality"
COMPANY = REPO / "tests" / "fixtures" / "company"
RGB_SETS = (("positive", "RGB en_fact, answer present"), ("negative", "RGB en_fact, answer absent"),
            ("positive_wrong", "RGB en_fact, counterfactual (fake answer stated)"))


def valid_citations(answer: Answer) -> bool:
    """Every [n] names an inserted passage, and every evidence span sits at its offsets there."""
    if answer.invalid_citations or not answer.citations:
        return False
    passages = {s.number: s.passage for s in answer.sources}
    spans = answer.evidence.spans if answer.evidence is not None and answer.answered_by == "evidence" else []
    return all(passages.get(s.number, "")[s.start:s.end] == s.text for s in spans)


def score(rows: list[dict]) -> dict:
    """The table's figures from per-question rows {answerable, refused, right, valid, seconds}."""
    answerable = [r for r in rows if r["answerable"]]
    unanswerable = [r for r in rows if not r["answerable"]]
    answered = [r for r in rows if not r["refused"]]
    rate = lambda part, whole: round(len(part) / len(whole), 3) if whole else None  # noqa: E731
    return {"questions": len(rows), "answerable": len(answerable),
            "right": rate([r for r in answerable if r["right"] and not r["refused"]], answerable),
            "wrong_but_answered": rate([r for r in answered if not r["right"]], rows),
            "refused_when_answerable": rate([r for r in answerable if r["refused"]], answerable),
            "refused_when_not": rate([r for r in unanswerable if r["refused"]], unanswerable),
            "citation_validity": rate([r for r in answered if r["valid"]], answered),
            "median_s": round(statistics.median(r["seconds"] for r in rows), 3) if rows else None,
            "evidence_median_s": round(statistics.median(e), 3) if (e := [r["evidence_s"] for r in rows
                                                                          if r["evidence_s"] is not None]) else None}


def row(answer: Answer, golds: list[str], answerable: bool, seconds: float) -> dict:
    return {"answerable": answerable, "refused": answer.refused, "right": bool(contains(answer.text, golds)),
            "valid": valid_citations(answer), "seconds": seconds,
            "evidence_s": answer.evidence.seconds if answer.evidence is not None else None,
            "text": answer.text[:300], "reason": answer.reason,
            "answered_by": answer.answered_by}


def timed_ask(project, pipeline: str, query) -> tuple[Answer, float]:
    started = time.perf_counter()
    answer = engine.run(project.pipeline(pipeline), {"query": query}, orchestrate=False)
    return answer, time.perf_counter() - started


def own_questions() -> tuple[list[dict], list[str]]:
    questions = json.loads((OWN / "questions.json").read_text())
    return questions["answerable"], questions["unanswerable"]


def company_questions() -> tuple[list[dict], list[str]]:
    """Issue 24's questions on tests/fixtures/company, written before this bench: held out from its tuning."""
    questions = json.loads((COMPANY.parent / "company-questions.json").read_text())
    return ([{"question": q, "answers": [a]} for q, a in questions["answerable"].items()],
            questions["unanswerable"] + questions["off_topic"])


def with_backend(project, backend: str | None):
    """The project with its embedder on ``backend`` (None: as the pipelines file says)."""
    return project if backend is None else project.with_resource("embedder", backend=backend)


def document_set(name: str, docs: Path, questions, pipelines: list[str], workdir: Path,
                 backend: str | None = None) -> dict:
    answerable_items, unanswerable = questions
    folder = workdir / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(docs, folder / "docs")
    shutil.copytree(REPO / "prompts", folder / "prompts")
    (folder / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    project = with_backend(load_project(folder / "pipelines.yaml", tuned=False), backend)
    engine.run(project.pipeline("index"), orchestrate=False)
    texts = " ".join(p.read_text() for p in (folder / "docs").iterdir())
    results = {}
    for pipeline in pipelines:
        rows = []
        for item in answerable_items:
            answer, seconds = timed_ask(project, pipeline, item["question"])
            rows.append({"question": item["question"], **row(answer, item["answers"],
                                                            bool(contains(texts, item["answers"])), seconds)})
        for question in unanswerable:
            answer, seconds = timed_ask(project, pipeline, question)
            rows.append({"question": question, **row(answer, ["\0"], False, seconds)})
        results[pipeline] = {**score(rows), "rows": rows}
    return results


def rgb_sets(pipelines: list[str], workdir: Path, split: str, backend: str | None = None) -> dict:
    items = load_rgb(DATA / "rgb" / "en_fact.json")
    chosen = [it for i, it in enumerate(items) if split == "all" or (i % 2 == 1) == (split == "test")]
    project = with_backend(load_project(REPO / "pipelines.yaml", tuned=False), backend)
    results: dict = {}
    for corpus, _ in RGB_SETS:
        indexed = _index_corpus(project, chosen, corpus, workdir / "rgb", orchestrate=False)
        for pipeline in pipelines:
            rows = []
            for item in chosen:
                started = time.perf_counter()
                answer = _ask(indexed, pipeline, item, orchestrate=False)
                seconds = time.perf_counter() - started
                answerable = bool(contains(" ".join(item.passages[corpus]), item.answers))
                rows.append({"question": item.query, **row(answer, item.answers, answerable, seconds),
                             "fake": bool(contains(answer.text, item.fake_answers or ["\0"]))})
            figures = score(rows)
            if corpus == "positive_wrong":
                figures["repeats_fake"] = round(sum(r["fake"] and not r["refused"] for r in rows) / len(rows), 3)
            results.setdefault(corpus, {})[pipeline] = {**figures, "rows": rows}
    return results


WH = {"number": "How many", "date": "When", "name": "Who"}
KEYWORDS = 4  # a pseudo-question keeps the sentence's rarest content words, as users' short questions do


def pseudo_questions(texts: list[str], limit: int, seed: int = 0) -> list[tuple[str, int, str]]:
    """(question, passage index, source sentence) made from the passages alone, no labels: a sentence
    holding a number, date or name loses that value, keeps its four rarest content words and is asked
    with the matching wh-word ("How many Kestrel paid annual leave?" from "... receives 28 days ...")."""
    import random

    from ragline.flows.contracts import ContextDocument, Passage
    from ragline.tasks.generate.extract_answer import FUNCTION, split_units, value_spans, words

    frequency: dict[str, int] = {}
    for text in texts:
        for w in {w.lower() for w in words(text)}:
            frequency[w] = frequency.get(w, 0) + 1
    made = []
    for i, text in enumerate(texts):
        document = ContextDocument(number=1, passage=Passage(chunk_id="c", source_id="s", text=text))
        for unit in split_units(document):
            for kind, wh in WH.items():
                spans = value_spans(unit.text, kind, text)
                if spans and 8 <= len(words(unit.text)) <= 40:
                    start, end = spans[0]
                    rest = [w for w in words(unit.text[:start] + " " + unit.text[end:]) if w.lower() not in FUNCTION]
                    rarest = set(sorted(rest, key=lambda w: frequency.get(w.lower(), 0))[:KEYWORDS])
                    made.append((f"{wh} {' '.join(w for w in rest if w in rarest)}?", i, unit.text))
                    break
    random.Random(seed).shuffle(made)
    return made[:limit]


def calibrate(split: str, keep: float = 0.95, limit: int = 300) -> dict:
    """The evidence score that ``keep`` of the pseudo-questions clear with their own sentence in the
    passage: the label-free floor (``extract_answer``'s ``min_score``), from the own set's documents and
    the RGB split's passages (their text only: no question, no answer)."""
    import numpy as np

    from ragline.flows.contracts import Context, ContextDocument, Passage
    from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
    from ragline.tasks.generate.extract_answer import Params, evidence_answer

    items = load_rgb(DATA / "rgb" / "en_fact.json")
    texts = [p.read_text() for p in sorted((OWN / "docs").iterdir())] + [
        t for i, it in enumerate(items) if split == "all" or (i % 2 == 1) == (split == "test")
        for t in it.passages["positive"] + it.passages["negative"]]
    embedder, params = Embedder(EmbedderSpec(type="sentence_transformer")), Params(min_score=0.0)
    scores = []
    for question, i, sentence in pseudo_questions(texts, limit):
        context = Context(documents=[ContextDocument(number=1, passage=Passage(chunk_id="c", source_id="s",
                                                                                text=texts[i]))])
        answer = evidence_answer(question, context, params, embedder)
        scores.append(answer.confidence if not answer.refused and answer.spans[0].text == sentence else 0.0)
    found = [s for s in scores if s > 0]
    return {"pseudo_questions": len(scores), "own_sentence_found": round(len(found) / max(1, len(scores)), 3),
            "keep": keep, "floor": round(float(np.quantile(found, 1 - keep)), 3) if found else None,
            "floors": {k: round(float(np.quantile(found, 1 - k)), 3) for k in (0.9, 0.95, 0.98)} if found else {}}


def llm_up(project) -> str | None:
    """Why the `ask` pipeline's LLM cannot be used here, or None."""
    try:
        health = project.resource("llm").health()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"{type(exc).__name__}: {exc}"
    return None if health.status == "up" else f"no LLM server at {project.resource('llm').spec.base_url}"


def table(result: dict) -> list[str]:
    lines = ["| set | pipeline | questions (answerable) | right | wrong but answered | refused when answerable | "
             "refused when not | citations valid | median s (evidence step) |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "–" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    sets = [("own", "own QA set"), ("company", "issue 24's company questions (held out)")] + list(RGB_SETS)
    for key, label in sets:
        for pipeline, r in (result[key] if key in ("own", "company") else result["rgb"].get(key, {})).items():
            extra = f" (repeats the fake answer: {r['repeats_fake']:.2f})" if "repeats_fake" in r else ""
            lines.append(f"| {label}{extra} | `{pipeline}` | {r['questions']} ({r['answerable']}) | {fmt(r['right'])} | "
                         f"**{fmt(r['wrong_but_answered'])}** | {fmt(r['refused_when_answerable'])} | "
                         f"{fmt(r['refused_when_not'])} | {fmt(r['citation_validity'])} | {fmt(r['median_s'])} "
                         f"({fmt(r['evidence_median_s'])}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelines", default="ask_extractive,ask")
    parser.add_argument("--split", choices=("test", "dev", "all"), default="test")
    parser.add_argument("--skip-rgb", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="only place the label-free floor (pseudo-questions)")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    if args.table_only:
        report(json.loads((OUT / "answer_quality.json").read_text()), readme=not args.no_readme)
        return
    if args.calibrate:
        print(json.dumps(calibrate("dev" if args.split == "test" else args.split)))
        return
    pipelines = args.pipelines.split(",")
    workdir = OUT / "answer_quality"
    left_out = {}
    if "ask" in pipelines and (why := llm_up(load_project(REPO / "pipelines.yaml", tuned=False))):
        pipelines.remove("ask")
        left_out["ask"] = why
    own = document_set("own", OWN / "docs", own_questions(), pipelines, workdir)
    company = document_set("company", COMPANY, company_questions(), pipelines, workdir)
    result = {"split": args.split, "pipelines": pipelines, "left_out": left_out, "own": own, "company": company,
              "rgb": {} if args.skip_rgb else rgb_sets(pipelines, workdir, args.split)}
    save("answer_quality", result)
    report(result, readme=not args.no_readme and args.split == "test")


def report(result: dict, readme: bool) -> None:
    split = {"test": "the test split (odd positions, 50 items)", "dev": "the dev split (even positions, 50 items)",
             "all": "all 100 items"}[result["split"]]
    lines = [f"RGB rows: {split}; the extractor's rules, weights and floor were set on the dev split and the own "
             f"set only. Time: the whole pipeline in-process, index warm (the evidence step alone in brackets).", "",
             *table(result)]
    lines += [f"", *[f"`{p}` not measured: {why}." for p, why in result["left_out"].items()]]
    publish("answer_quality", lines, readme=readme)


if __name__ == "__main__":
    main()
