"""One `ragline validate` pass reports every mistake in a pipeline, each with file:line and field;
prompt templates are checked against the variables their stage passes, default ones included."""
from __future__ import annotations

import pytest

from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.context import StepContext
from ragline.flows.spec.prompts import PromptLibrary
from tests.helpers.data import BASE_RESOURCES

LLM = "  llm: {type: openai_compatible, base_url: 'http://127.0.0.1:9/v1', model: m}\n"

MANY_MISTAKES = BASE_RESOURCES + LLM + """
pipelines:
  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: ten}, retries: many}
      - {id: sparse, task: retrieve_sparse, after: [], colour: blue, with: {k: 5, kk: 1}}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
      - {id: insert, task: insert}
      - {id: answer, task: generate, prompt: mine}
"""
MINE = "{% include '_documents.j2' %}\nQ: {{ question }}\nA: {{ foo }}\n"
DOCUMENTS = "{% for d in documents %}[{{ d.number }}] {{ d.passage.text }} {{ bar }}\n{% endfor %}"


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def by_field(errors) -> dict[tuple[str | None, str | None], list]:
    found: dict[tuple[str | None, str | None], list] = {}
    for e in errors:
        found.setdefault((e.step, e.field), []).append(e)
    return found


def test_every_mistake_in_one_pipeline_is_reported_at_once(make_project):
    path = make_project(MANY_MISTAKES, prompts={"mine": MINE, "_documents": DOCUMENTS})
    errors = validate_file(path)
    found = by_field(errors)
    report = "\n".join(map(str, errors))
    expected = {("dense", "retries"): "id: dense", ("sparse", "colour"): "id: sparse",
                ("dense", "with.k"): "id: dense", ("sparse", "with.kk"): "id: sparse",
                ("answer", "prompt"): "id: answer"}
    for key, needle in expected.items():
        assert key in found, f"{key} missing from:\n{report}"
        assert all(e.line == line_of(MANY_MISTAKES, needle) and e.pipeline == "ask" for e in found[key]), report
    assert all(str(e).startswith(f"{path}:{e.line}, pipeline 'ask', step ") for e in errors), report
    assert "unknown field 'colour'" in str(found[("sparse", "colour")][0])
    assert "unknown parameter 'kk'" in str(found[("sparse", "with.kk")][0])
    assert "'ten'" in str(found[("dense", "with.k")][0])
    prompts = " | ".join(e.message for e in found[("answer", "prompt")])
    assert ("prompt template 'mine.j2' uses undefined variable 'foo' on line 3 "
            "(the stage provides: conversation, documents, examples, instruction, question, refusal)") in prompts
    assert "prompt template '_documents.j2' (included from 'mine.j2') uses undefined variable 'bar'" in prompts
    assert len(errors) == 6, report


def test_pipeline_level_mistake_does_not_hide_step_errors(make_project):
    text = BASE_RESOURCES + """
pipelines:
  search:
    kind: query
    batch_size: lots
    steps:
      - {id: dense, task: retrieve_dense, with: {k: ten}}
"""
    found = by_field(validate_file(make_project(text)))
    assert set(found) == {(None, "batch_size"), ("dense", "with.k")}


def test_bad_settings_do_not_hide_pipeline_errors(make_project):
    text = "settings: {prompts_dir: prompts, colour: blue}\n" + BASE_RESOURCES + """
pipelines:
  search:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: ten}}
"""
    found = by_field(validate_file(make_project(text)))
    assert set(found) == {(None, "settings.colour"), ("dense", "with.k")}


def test_default_template_is_checked_too(make_project):
    text = BASE_RESOURCES + LLM + """
pipelines:
  ask:
    kind: query
    steps:
      - {id: rewrite, task: rewrite, with: {mode: hyde}}
"""
    path = make_project(text, prompts={"rewrite_hyde": "Q: {{ question }} {{ history }}"})
    error, = validate_file(path)
    assert (error.step, error.field, error.line) == ("rewrite", "prompt", line_of(text, "id: rewrite"))
    assert ("prompt template 'rewrite_hyde.j2' uses undefined variable 'history' on line 1 "
            "(the stage provides: n, question)") in error.message


def test_templates_rendered_with_prompt_for_are_checked(make_project):
    text = BASE_RESOURCES + LLM + """
pipelines:
  check:
    kind: query
    steps:
      - {id: verify, task: verify}
"""
    ok = "{{ question }} {{ answer }} {{ documents }}"
    path = make_project(text, prompts={"fact_check_support": ok, "fact_check_contradict": ok + " {{ verdict }}"})
    messages = [e.message for e in validate_file(path) if e.field == "prompt"]
    assert messages == ["prompt template 'fact_check_contradict.j2' uses undefined variable 'verdict' on line 1 "
                        "(the stage provides: answer, documents, question)"]


def test_shipped_templates_fit_every_mode(make_project):
    """Every default template of every LLM stage uses only what its stage passes."""
    modes = {"rewrite": ["conversational", "multi_query", "hyde", "decompose", "instruction"],
             "rerank_llm": ["pointwise", "listwise"], "verify": ["binary", "three_way"]}
    field = {"rewrite": "mode", "rerank_llm": "method", "verify": "method"}
    steps = [f"      - {{id: {t}_{m}, task: {t}, with: {{{field[t]}: {m}}}, after: []}}"
             for t, ms in modes.items() for m in ms]
    steps += [f"      - {{id: {t}, task: {t}, after: []}}"
              for t in ("generate", "generate_flare", "refine_extract", "refine_notes")]
    text = BASE_RESOURCES + LLM + "pipelines:\n  p:\n    kind: query\n    steps:\n" + "\n".join(steps) + "\n"
    path = make_project(text)
    (path.parent / "prompts").rmdir()
    (path.parent / "prompts").symlink_to(__import__("pathlib").Path(__file__).resolve().parents[3] / "prompts")
    problems = [str(e) for e in validate_file(path) if e.field == "prompt"]
    assert problems == []


def test_render_time_undefined_names_the_template_and_line(tmp_path):
    (tmp_path / "ask.j2").write_text("Question: {{ question }}\n\n{{ foo }}\n")
    step = StepContext(pipeline="ask", step_id="answer", prompt_name="ask",
                       render_prompt=PromptLibrary(tmp_path).render)
    with pytest.raises(Exception, match=r"prompt template 'ask\.j2' line 3: 'foo' is undefined"):
        step.prompt(question="why?")


def test_overrides_check_the_new_template_variables(make_project):
    text = BASE_RESOURCES + LLM + """
pipelines:
  ask:
    kind: query
    steps:
      - {id: rewrite, task: rewrite, with: {mode: hyde}}
"""
    prompts = {"rewrite_hyde": "{{ question }}", "rewrite_decompose": "{{ question }} {{ history }}"}
    pipeline = load_project(make_project(text, prompts=prompts)).pipeline("ask")
    with pytest.raises(Exception, match="rewrite_decompose.j2' uses undefined variable 'history'"):
        pipeline.with_overrides({"rewrite": {"mode": "decompose"}})
