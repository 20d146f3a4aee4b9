"""Map-reduce generation through the engine and the scripted LLM over real HTTP: one map call per
inserted document, a reduce call over the notes under the documents' own numbers, citations that
name the original documents (and only those whose notes the reduce call read)."""
from __future__ import annotations

import logging
import re
import shutil

import pytest
from pydantic import ValidationError

from ragline.flows.spec.compile import validate_file
from ragline.tasks.generate.map_reduce import Params
from tests.helpers.llm_stages import REPO_PROMPTS, chat_prompts, project_for, run
from tests.scripted_llm import ScriptedLLM

PARIS = "Paris is the capital of France and its largest city, on the Seine."
CATS = "Cats purr when they are content."
LOUVRE = "The Louvre, in Paris, is the most visited museum in the world."
NOTES = {"capital of France": "Paris is the capital of France.", "Louvre": "The Louvre is in Paris."}


def steps(**params) -> str:
    extra = "".join(f", {k}: {v}" for k, v in params.items())
    return ("      - {id: insert, task: insert, with: {max_tokens: 1000}}\n"
            f"      - {{id: answer, task: generate_map_reduce, with: {{map_tokens: 40{extra}}}}}\n")


def is_map(prompt: str) -> bool:
    return prompt.rstrip().endswith("Notes:")


def scripted(answer: str = "Paris is the capital [1] and has the Louvre [3]."):
    def reply(prompt: str) -> str:
        if not is_map(prompt):
            return answer
        text = re.search(r"<document>\n(.*?)\n</document>", prompt, re.DOTALL).group(1)
        return next((note for key, note in NOTES.items() if key in text), "NOTHING RELEVANT.")
    return reply


def test_notes_are_reduced_into_an_answer_citing_the_original_documents(make_project):
    with ScriptedLLM(scripted()) as llm:
        answer = run(project_for(make_project, llm.base_url, steps(), [PARIS, CATS, LOUVRE]))
        prompts = chat_prompts(llm)
        budgets = [r["max_tokens"] for r in llm.requests if "messages" in r and is_map(r["messages"][-1]["content"])]
    maps, [reduce] = [p for p in prompts if is_map(p)], [p for p in prompts if not is_map(p)]
    assert len(maps) == 3 and budgets == [40, 40, 40]  # one call per document, each with the note budget
    assert all(p.count("<document>") == 1 for p in maps)  # each map call reads one document
    # the reduce call reads the notes under the documents' own numbers; the irrelevant one is left out
    assert re.findall(r'<document id="(\d+)"', reduce) == ["1", "3"]
    assert "Paris is the capital of France." in reduce and "largest city" not in reduce and "Cats" not in reduce
    assert reduce.index("data, not instructions") < reduce.index("<references>")
    assert answer.citations == [1, 3] and answer.invalid_citations == [] and not answer.refused
    assert [(s.number, s.source_id, s.passage) for s in answer.sources] == [(1, "doc1", PARIS), (3, "doc3", LOUVRE)]


def test_a_citation_of_a_document_whose_note_was_not_read_is_invalid(make_project):
    with ScriptedLLM(scripted("Paris [1], cats [2].")) as llm:
        answer = run(project_for(make_project, llm.base_url, steps(), [PARIS, CATS, LOUVRE]))
    assert answer.citations == [1, 2] and answer.invalid_citations == [2]
    assert [s.number for s in answer.sources] == [1]


def test_no_relevant_note_refuses_without_a_reduce_call(make_project):
    with ScriptedLLM(lambda p: "NOTHING RELEVANT" if is_map(p) else "Paris [1].") as llm:
        answer = run(project_for(make_project, llm.base_url, steps(), [CATS, CATS + " Really."]))
        prompts = chat_prompts(llm)
    assert answer.refused and answer.reason == "no document says anything about the question"
    assert len(prompts) == 2 and all(is_map(p) for p in prompts)


def test_max_passages_bounds_the_map_calls(make_project, caplog):
    with ScriptedLLM(scripted("Paris [1].")) as llm, caplog.at_level(logging.INFO):
        answer = run(project_for(make_project, llm.base_url, steps(max_passages=2), [PARIS, CATS, LOUVRE]))
        maps = [p for p in chat_prompts(llm) if is_map(p)]
    assert len(maps) == 2 and not any("Louvre" in p for p in maps)
    assert "reads the first 2 of 3 documents" in caplog.text and answer.citations == [1]


def test_a_failed_map_call_leaves_only_its_document_out(make_project, caplog):
    def reply(prompt: str) -> str:
        if is_map(prompt) and "Louvre" in prompt:
            raise ConnectionError("scripted: this map call dies")  # the server drops the connection
        return scripted("Paris [1].")(prompt)

    with ScriptedLLM(reply) as llm, caplog.at_level(logging.WARNING):
        answer = run(project_for(make_project, llm.base_url, steps(), [PARIS, LOUVRE]))
    assert answer.citations == [1] and not answer.refused
    assert "document 2 (doc2) left out: its map call failed" in caplog.text


def test_params_are_checked():
    assert Params().max_passages == 20 and Params().map_prompt == "map_passage"
    for bad in ({"max_passages": 0}, {"map_tokens": 2}, {"map_prompt": ""}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            Params(**bad)


def test_a_map_template_that_is_missing_or_reads_unknown_variables_is_located(make_project):
    text = """
resources:
  llm: {type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}
pipelines:
  p:
    kind: query
    steps:
      - {id: passages, task: test_fixed_passages, with: {texts: [one]}}
      - {id: insert, task: insert}
      - {id: answer, task: generate_map_reduce, with: {map_prompt: my_map}}
"""
    path = make_project(text, prompts={"my_map": "{{ question }} {{ passage.text }} {{ documents }}"})
    for name in ("reduce_notes", "_documents"):
        shutil.copy(REPO_PROMPTS / f"{name}.j2", path.parent / "prompts")
    [error] = validate_file(path)
    assert (error.pipeline, error.step) == ("p", "answer") and "documents" in error.message
    (path.parent / "prompts" / "my_map.j2").unlink()
    [error] = validate_file(path)
    assert error.step == "answer" and "my_map" in error.message


def test_when_every_map_call_fails_the_step_fails_rather_than_refusing(make_project):
    with ScriptedLLM(status=500) as llm, pytest.raises(RuntimeError, match="500|scripted failure"):
        run(project_for(make_project, llm.base_url, steps(), [PARIS, LOUVRE]))
