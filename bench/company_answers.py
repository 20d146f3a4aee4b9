"""Answers a newcomer can trust: five made-up-company documents (tests/fixtures/company: Markdown,
text, HTML), five questions they answer and two they do not, through the shipped `ask` pipeline and
a real LLM server; plus ten off-topic questions for the answerability gate.

Usage: .venv/bin/python bench/company_answers.py [--repo PATH] [--out FILE]
Needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh, or RAGLINE_LLM_BASE_URL). ``--repo``
takes pipelines.yaml and prompts/ from another checkout (run it with that checkout's Python to
measure its code: the "before" of a change).

Each question is classed: correct (the expected answer in the text), refused, wrong-but-cited (an
answer that is not the expected one and cites a passage), wrong-uncited; an unanswerable or off-topic
question is right only when refused.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
DOCS = HERE / "tests" / "fixtures" / "company"
QUESTIONS = json.loads((HERE / "tests" / "fixtures" / "company-questions.json").read_text())
ANSWERABLE, UNANSWERABLE, OFF_TOPIC = QUESTIONS["answerable"], QUESTIONS["unanswerable"], QUESTIONS["off_topic"]


def project_in(folder: Path, repo: Path):
    """The checkout's pipelines.yaml and prompts over a copy of the company documents, indexed."""
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    (folder / "pipelines.yaml").write_text((repo / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    shutil.copytree(repo / "prompts", folder / "prompts")
    shutil.copytree(DOCS, folder / "docs")
    project = load_project(folder / "pipelines.yaml", tuned=False)
    engine.run(project.pipeline("index"), orchestrate=False)
    return project


def classify(answer, expected: str | None) -> str:
    if answer.refused:
        return "refused"
    if expected is not None and expected.lower() in answer.text.lower():
        return "correct"
    return "wrong-but-cited" if answer.citations else "wrong-uncited"


def run(repo: Path) -> dict:
    from ragline.flows.run import engine

    with tempfile.TemporaryDirectory() as tmp:
        project = project_in(Path(tmp), repo)
        rows = []
        for kind, questions in (("answerable", ANSWERABLE), ("unanswerable", dict.fromkeys(UNANSWERABLE)),
                                ("off_topic", dict.fromkeys(OFF_TOPIC))):
            for question, expected in questions.items():
                started = time.perf_counter()
                answer = engine.run(project.pipeline("ask"), {"query": question}, orchestrate=False)
                rows.append({"kind": kind, "question": question, "class": classify(answer, expected),
                             "text": answer.text, "draft": answer.draft, "reason": answer.reason,
                             "citations": answer.citations, "seconds": round(time.perf_counter() - started, 2)})
    summary = {kind: {c: sum(r["class"] == c for r in rows if r["kind"] == kind)
                      for c in ("correct", "refused", "wrong-but-cited", "wrong-uncited")}
               for kind in ("answerable", "unanswerable", "off_topic")}
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", type=Path, default=HERE, help="checkout whose pipelines.yaml and prompts to use")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run(args.repo.resolve())
    for row in result["rows"]:
        print(f"{row['kind']:<12} {row['class']:<16} {row['question']}\n    -> {row['text'][:100]!r}"
              + (f"\n    draft {row['draft'][:80]!r}; {row['reason']}" if row["reason"] else ""))
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
