"""pipelines.yaml validation: every error names file, line, pipeline, step and field, all at once."""
from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel

from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.registry import stage
from ragline.flows.spec.parse import SpecValidationError
from tests.helpers.data import BASE_RESOURCES


class _PromptParams(BaseModel):
    model_config = {"extra": "forbid"}


@stage("test_prompted", params=_PromptParams, produces="passages", kind="query", prompt="test_default_prompt")
def _prompted(query) -> list:  # a stage with a prompt, to check template validation
    return []


GOOD = BASE_RESOURCES + """
pipelines:
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 5}}
      - {id: sparse, task: retrieve_sparse, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing ``needle``, as the file is written."""
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


DENSE, SPARSE, FUSE = line_of(GOOD, "id: dense"), line_of(GOOD, "id: sparse"), line_of(GOOD, "id: fuse")


def errors_of(make_project, text, **kwargs):
    return validate_file(make_project(text, **kwargs))


def only(errors):
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


def test_valid_file_compiles(make_project):
    project = load_project(make_project(GOOD))
    fuse = project.pipeline("search").step("fuse")
    assert fuse.wiring == {"rankings": ["dense", "sparse"]}
    assert project.pipeline("search").step("sparse").upstream == []


def test_malformed_yaml_names_the_line(make_project):
    text = GOOD + "      - {id: broken, task: fuse\n"
    error = only(errors_of(make_project, text))
    assert "invalid YAML" in error.message and f"started at line {line_of(text, 'broken')}" in error.message
    assert str(error).startswith(f"{error.file}:{error.line}: invalid YAML")


def test_duplicate_yaml_key_is_an_error(make_project):
    error = only(errors_of(make_project, GOOD.replace("kind: query", "kind: query\n    kind: query")))
    assert "duplicate key 'kind'" in error.message and error.line == line_of(GOOD, "kind:") + 1


def test_unknown_task_suggests_nearest(make_project):
    error = only(errors_of(make_project, GOOD.replace("task: retrieve_dense", "task: retreive_dense")))
    assert (error.pipeline, error.step, error.field, error.line) == ("search", "dense", "task", DENSE)
    assert "unknown task 'retreive_dense'" in error.message and "did you mean 'retrieve_dense'" in error.message


def test_unknown_parameter(make_project):
    error = only(errors_of(make_project, GOOD.replace("with: {k: 5}", "with: {kk: 5}")))
    assert (error.step, error.field) == ("dense", "with.kk") and "unknown parameter 'kk'" in error.message


def test_badly_typed_parameter(make_project):
    error = only(errors_of(make_project, GOOD.replace("with: {k: 5}", "with: {k: many}")))
    assert (error.step, error.field, error.line) == ("dense", "with.k", DENSE)
    assert "integer" in error.message and "'many'" in error.message


def test_out_of_bounds_parameter(make_project):
    error = only(errors_of(make_project, GOOD.replace("with: {k: 5}", "with: {k: 0}")))
    assert error.field == "with.k" and "greater than or equal to 1" in error.message


def test_wrong_type_of_pipeline_field(make_project):
    text = GOOD.replace("kind: query", "kind: query\n    batch_size: lots")
    error = only(errors_of(make_project, text))
    assert (error.pipeline, error.field, error.line) == ("search", "batch_size", line_of(GOOD, "kind:") + 1)


def test_unknown_resource_suggests(make_project):
    error = only(errors_of(make_project, GOOD.replace("after: []}", "after: [], uses: [sparce]}")))
    assert error.step == "sparse" and error.field == "uses.0"
    assert "unknown resource 'sparce'" in error.message and "did you mean 'sparse'" in error.message


def test_resource_of_wrong_type(make_project):
    error = only(errors_of(make_project, GOOD.replace("after: []}", "after: [], uses: {sparse: store}}")))
    assert error.field == "uses.sparse" and "is a chroma; role 'sparse' needs bm25" in error.message


def test_unknown_resource_type(make_project):
    error = only(errors_of(make_project, GOOD.replace("type: bm25", "type: bm52")))
    assert "unknown resource type 'bm52'" in error.message and error.line == line_of(GOOD, "type: bm25")


def test_cycle(make_project):
    text = GOOD.replace("after: []}", "after: [fuse]}")
    error = only(errors_of(make_project, text))
    assert "cycle between steps" in error.message and "sparse" in error.message and "fuse" in error.message


def test_dangling_after_suggests(make_project):
    error = only(errors_of(make_project, GOOD.replace("after: [dense, sparse]", "after: [dense, sprase]")))
    assert (error.step, error.field, error.line) == ("fuse", "after.1", FUSE)
    assert "unknown step 'sprase'" in error.message and "did you mean 'sparse'" in error.message


def test_duplicate_step_id(make_project):
    errors = errors_of(make_project, GOOD.replace("{id: sparse,", "{id: dense,"))
    assert any("duplicate step id 'dense'" in e.message and e.line == SPARSE for e in errors), errors


def test_stage_kind_mismatch(make_project):
    text = GOOD.replace("task: retrieve_dense, with: {k: 5}", "task: embed")
    errors = errors_of(make_project, text)
    assert any("ingestion stage, not usable in a query pipeline" in e.message for e in errors)


def test_input_without_producer(make_project):
    text = BASE_RESOURCES + """
pipelines:
  p:
    kind: query
    steps:
      - {id: fuse, task: fuse}
"""
    error = only(errors_of(make_project, text))
    assert "input 'rankings'" in error.message and error.step == "fuse"


def test_missing_prompt_template(make_project):
    text = GOOD.replace("- {id: fuse,   task: fuse, after: [dense, sparse]}",
                        "- {id: fuse,   task: fuse, after: [dense, sparse]}\n      - {id: gen, task: test_prompted}")
    error = only(errors_of(make_project, text))
    assert error.step == "gen" and error.field == "prompt"
    assert "prompt template 'test_default_prompt.j2' not found" in error.message


def test_named_prompt_found_and_broken_prompt_reported(make_project):
    text = GOOD + "      - {id: gen, task: test_prompted, prompt: mine}\n"
    assert errors_of(make_project, text, prompts={"mine": "Q: {{ query }}"}) == []
    error = only(errors_of(make_project, text, prompts={"mine": "Q: {{ query "}))
    assert "line 1" in error.message and error.field == "prompt"


def test_prompt_on_stage_without_prompt(make_project):
    error = only(errors_of(make_project, GOOD.replace("task: fuse, after", "task: fuse, prompt: x, after")))
    assert "takes no prompt" in error.message


def test_dotted_stage_needs_allowlist(make_project, monkeypatch):
    monkeypatch.delenv("RAGLINE_ALLOW_MODULES", raising=False)
    text = GOOD.replace("task: fuse", "task: ragline.tasks.retrieve.fuse.fuse")
    assert "is not allowed: set RAGLINE_ALLOW_MODULES" in only(errors_of(make_project, text)).message
    widened = errors_of(make_project, "settings: {allow_modules: [ragline.tasks]}\n" + text)
    assert any(e.field == "settings.allow_modules.0" and "not allowed" in e.message for e in widened), widened
    monkeypatch.setenv("RAGLINE_ALLOW_MODULES", "ragline.tasks")
    assert errors_of(make_project, text) == []


def test_all_errors_reported_at_once(make_project):
    text = (GOOD.replace("task: retrieve_dense", "task: nope")
                .replace("after: [dense, sparse]", "after: [ghost]")
                .replace("type: bm25", "type: bm25, k1: fast"))
    errors = errors_of(make_project, text)
    messages = " | ".join(str(e) for e in errors)
    assert len(errors) >= 2, messages
    assert "k1" in messages
    assert all(e.line for e in errors)


def test_validate_command_prints_every_error_and_fails(make_project, capsys):
    path = make_project(GOOD.replace("task: retrieve_dense", "task: nope").replace("with: {k: 5}", "with: {k: 5}"))
    assert main(["validate", str(path)]) == 2  # bad configuration (issue 24)
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "1 error(s)" in err and f"{path}:{DENSE}" in err


def test_validate_command_ok(make_project, capsys):
    assert main(["validate", str(make_project(GOOD))]) == 0
    assert "OK (1 pipelines: search)" in capsys.readouterr().out


def test_shipped_pipelines_file_is_valid():
    assert validate_file("pipelines.yaml") == []


def test_validate_console_script_exit_code(make_project):
    path = make_project("pipelines: [")
    result = subprocess.run([sys.executable, "-m", "ragline.flows.cli", "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid YAML" in result.stderr


def test_overrides_are_validated(make_project):
    project = load_project(make_project(GOOD))
    with pytest.raises(SpecValidationError) as info:
        project.pipeline("search").with_overrides({"dense": {"k": -1}})
    assert info.value.errors[0].step == "dense" and info.value.errors[0].field == "with.k"
