"""Issue 24: a newcomer's own documents (five made-up-company files: Markdown, text, HTML), five
questions they answer and two they do not, through the shipped `ask` pipeline on the real packaged
model (SmolLM2-135M on CPU vLLM). Asserted is what that small model can honestly do: the questions
the documents do not answer and the off-topic ones are refused, and no answer that a reader would
not take for one (repeated, the question restated, a bare number the cited passage does not give
for what was asked, uncited) is accepted. How many answerable ones it gets right is measured by
bench/company_answers.py, not asserted: a 135M model gets some of them wrong."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.tasks.generate.verify import Params, degenerate, grounding
from tests.helpers.data import REPO

pytestmark = [pytest.mark.integration, pytest.mark.llm]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUESTIONS = json.loads((FIXTURES / "company-questions.json").read_text())


@pytest.fixture(scope="module")
def company(tmp_path_factory, vllm_server):
    """The shipped pipelines.yaml over a copy of the company documents, its LLM the test's vLLM, indexed."""
    folder = tmp_path_factory.mktemp("company")
    (folder / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    shutil.copytree(REPO / "prompts", folder / "prompts")
    shutil.copytree(FIXTURES / "company", folder / "docs")
    os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"] = vllm_server.base_url, vllm_server.model
    try:
        project = load_project(folder / "pipelines.yaml", tuned=False)
    finally:
        del os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"]
    engine.run(project.pipeline("index"), orchestrate=False)
    return project


def ask(project, question: str):
    return engine.run(project.pipeline("ask"), {"query": question}, orchestrate=False)


@pytest.mark.parametrize("question", QUESTIONS["unanswerable"])
def test_what_the_documents_do_not_say_is_refused(company, question):
    answer = ask(company, question)
    assert answer.refused and answer.text == "I cannot answer this question" and answer.reason, answer


@pytest.mark.parametrize("question", QUESTIONS["off_topic"][:3])
def test_off_topic_questions_are_refused_by_the_gate_before_generation(company, question):
    answer = ask(company, question)
    assert answer.refused and answer.reason.startswith("no reference is close to the question"), answer


@pytest.mark.parametrize("question", list(QUESTIONS["answerable"]))
def test_an_accepted_answer_is_one_a_reader_would_take_for_one(company, question):
    """Accepted or refused, never degenerate nor ungrounded in what it cites."""
    answer = ask(company, question)
    if answer.refused:
        assert answer.reason and answer.text == "I cannot answer this question"
        return
    cited = [source.passage for source in answer.sources]  # the inserted passages it cites
    assert cited, answer
    assert degenerate(answer.text, question, cited, Params()) is None, answer
    found, total = grounding(answer.text, question, cited)
    assert total and found / total >= 0.6, answer
