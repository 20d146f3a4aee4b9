"""Bad configuration (issue 9): every mistake in pipelines.yaml is one clear error naming the file,
the line and, where the YAML parses, the pipeline, step and field; nothing runs, so nothing indexed
can be lost. Cases already pinned down elsewhere are listed in RELIABILITY.md with their tests."""
from __future__ import annotations

import time

import pytest

from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.parse import cron_problem
from tests.helpers.data import BASE_RESOURCES

LLM = "  llm:      {type: openai_compatible, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
GOOD = BASE_RESOURCES + LLM + """
pipelines:
  index:
    kind: ingestion
    schedule: {cron: "0 * * * *"}
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 5}}
      - {id: sparse, task: retrieve_sparse, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
      - {id: insert, task: insert}
      - {id: answer, task: generate}
"""


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def changed(*pairs: str) -> str:
    """GOOD with each (old, new) pair replaced once; a pair that does not apply is a broken test."""
    text = GOOD
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def the_error(make_project, text: str, needle: str, prompts: dict[str, str] | None = None):
    """The one error of ``text``, checked to sit on the line containing ``needle`` and to print as
    'file:line, ...'."""
    path = make_project(text, prompts=prompts)
    errors = validate_file(path)
    assert len(errors) == 1, "\n".join(map(str, errors))
    error = errors[0]
    assert error.line == line_of(text, needle), str(error)
    assert str(error).startswith(f"{path}:{error.line}"), str(error)
    return error


def test_the_base_file_is_valid(make_project):
    """Every case below changes one thing in a file that is otherwise correct."""
    assert validate_file(make_project(GOOD)) == []


# ----------------------------------------------------------------------------- YAML itself
def test_yaml_syntax_error_names_where_the_broken_entry_started(make_project):
    text = GOOD + "      - {id: broken, task: fuse\n"
    path = make_project(text)
    [error] = validate_file(path)
    assert error.message.startswith("invalid YAML")
    assert f"started at line {line_of(text, 'id: broken')}" in error.message


@pytest.mark.parametrize("old, new", [("    kind: query", "\tkind: query"),
                                      ("      - {id: fuse", "      -\t{id: fuse")], ids=["indent", "after-dash"])
def test_a_tab_names_its_line_and_column_and_says_to_use_spaces(make_project, old, new):
    text = changed(old, new)
    error = the_error(make_project, text, "\t")
    column = text.splitlines()[error.line - 1].index("\t") + 1
    assert error.message == f"invalid YAML: a tab at column {column}; YAML indents with spaces, never tabs"


@pytest.mark.parametrize("character", ["\x00", "\x07"], ids=["nul", "bell"])
def test_a_control_character_names_its_line(make_project, character):
    """Regression: a NUL in the file gave no line, only 'position N of <unicode string>'."""
    text = changed("kind: query", f"kind: query{character}")
    error = the_error(make_project, text, "kind: query")
    assert error.message == f"invalid YAML: control character #x{ord(character):04x} is not allowed in a YAML file"


def test_a_file_that_is_not_utf8_names_the_line_of_the_bad_byte(tmp_path):
    """Regression: the error had no line, only a byte offset."""
    text = changed("id: sparse", "id: spärse")
    path = tmp_path / "pipelines.yaml"
    path.write_bytes(text.encode("latin-1"))
    [error] = validate_file(path)
    assert (error.line, error.message) == (line_of(text, "spärse"),
                                           "not valid UTF-8: cannot decode byte 0xe4 (save the file as UTF-8)")


@pytest.mark.parametrize("old, new, needle", [
    ("  ask:\n", "  index:\n", "  index:"),
    ("  state:", "  sparse:   {type: bm25, path: idx/other}\n  state:", "idx/other"),
], ids=["pipeline", "resource"])
def test_a_duplicate_name_is_an_error_at_its_second_use(make_project, old, new, needle):
    text = changed(old, new)
    second = [i for i, line in enumerate(text.splitlines(), start=1) if needle in line][-1]
    [error] = validate_file(make_project(text))
    assert error.line == second and "duplicate key" in error.message


def test_a_recursive_alias_is_an_error_not_a_crash(make_project):
    """Regression: `&a [*a]` made validation die with RecursionError."""
    text = GOOD + "  loop: &loop {kind: query, steps: [*loop]}\n"
    error = the_error(make_project, text, "&loop")
    assert "recursive alias" in error.message


def test_an_alias_bomb_is_refused_without_expanding_it(make_project):
    """Regression: nine nested levels of nine aliases (387 M values) hung validation and filled memory."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    started = time.process_time()  # CPU time: a loaded machine does not inflate it as it does the wall clock
    [error] = validate_file(make_project("\n".join(levels) + "\n"))
    assert "expands to more than 20000 values" in error.message and error.line
    assert time.process_time() - started < 30  # about a second; the bound only catches a real expansion


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- a\n- b\n", "just words\n"],
                         ids=["empty", "comment", "list", "scalar"])
def test_a_file_that_is_not_a_mapping(make_project, text):
    [error] = validate_file(make_project(text))
    assert (error.line, error.message) == (1, "the file must be a mapping with 'resources' and 'pipelines'")


def test_a_missing_file_or_a_folder_is_named(tmp_path):
    [missing] = validate_file(tmp_path / "nope.yaml")
    assert str(missing) == f"{tmp_path / 'nope.yaml'}: cannot read file: No such file or directory"
    [folder] = validate_file(tmp_path)
    assert str(folder) == f"{tmp_path}: cannot read file: Is a directory"


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system ['touch MARKER']", "!!python/name:os.system ''"],
                         ids=["object-apply", "name"])
def test_a_yaml_tag_that_would_run_code_runs_nothing(make_project, tmp_path, tag):
    marker = tmp_path / "pwned"
    error = the_error(make_project, changed("k: 5", "k: " + tag.replace("MARKER", str(marker))), "python/")
    assert error.field == "with.k" or "could not determine a constructor" in error.message, str(error)
    assert not marker.exists()


# ----------------------------------------------------------------------------- ${VAR}
def test_an_unset_variable_without_default_names_the_field(make_project, monkeypatch):
    """Regression: the error named no field, and stopped every other check of the file."""
    monkeypatch.delenv("RAGLINE_TEST_UNSET", raising=False)
    text = changed("path: idx/bm25", 'path: "${RAGLINE_TEST_UNSET}/bm25"', "task: fuse,", "task: fusion,")
    path = make_project(text)
    errors = validate_file(path)
    variable, task = sorted(errors, key=lambda e: e.line)
    assert (variable.line, variable.field) == (line_of(text, "RAGLINE_TEST_UNSET"), "resources.sparse.path")
    assert variable.message == "environment variable RAGLINE_TEST_UNSET is not set and has no default"
    assert (task.step, task.field) == ("fuse", "task")  # the rest of the file was still checked


def test_a_variable_with_a_default_or_a_value_is_expanded(make_project, monkeypatch, tmp_path):
    monkeypatch.delenv("RAGLINE_TEST_UNSET", raising=False)
    text = changed("path: idx/bm25", 'path: "${RAGLINE_TEST_UNSET:-idx/fallback}"')
    assert load_project(make_project(text)).spec.resources["sparse"].path == "idx/fallback"
    monkeypatch.setenv("RAGLINE_TEST_UNSET", "idx/set")
    assert load_project(make_project(text)).spec.resources["sparse"].path == "idx/set"


# ----------------------------------------------------------------------------- wrong types and values
@pytest.mark.parametrize("old, new, needle, where, fragment", [
    ("kind: query", "kind: querry", "querry", ("ask", None, "kind"), "'ingestion', 'query'"),
    ("kind: query", "kind: query\n    batch_size: lots", "batch_size", ("ask", None, "batch_size"), "valid integer"),
    ("with: {k: 5}", "with: {k: many}", "k: many", ("ask", "dense", "with.k"), "valid integer"),
    ("with: {k: 5}", "with: {k: 0}", "k: 0", ("ask", "dense", "with.k"), "greater than or equal to 1"),
    ("with: {k: 5}", "with: [k]", "with: [k]", ("ask", "dense", "with"), "valid dictionary"),
    ("after: []}", "after: [], retries: -1}", "retries", ("ask", "sparse", "retries"), "greater than or equal to 0"),
    ("after: []}", "after: [], uses: 5}", "uses: 5", ("ask", "sparse", "uses"), "must be a list of resource names"),
    ("path: idx/bm25", "path: [1, 2]", "path: [1, 2]", (None, None, "resources.sparse.path"), "valid string"),
    ("with: {k: 5}", "with: {k: 5, where: {year: {$between: [1, 2]}}}", "$between", ("ask", "dense", "with.where"),
     "unknown filter operator '$between'"),
    ("with: {paths: [docs]}", "with: {paths: [docs], encoding: klingon}", "klingon",
     ("index", "load", "with.encoding"), "unknown encoding: klingon"),
], ids=["kind", "batch_size", "param-type", "param-bound", "with-not-mapping", "retries", "uses-not-list",
        "resource-field", "where-filter", "encoding"])
def test_a_wrong_type_or_value_names_pipeline_step_and_field(make_project, old, new, needle, where, fragment):
    error = the_error(make_project, changed(old, new), needle)
    assert (error.pipeline, error.step, error.field) == where and fragment in error.message, str(error)


def test_a_deployment_prefix_that_prefect_could_not_name_is_refused(make_project):
    text = "settings: {deployment_prefix: 'my docs/'}\n" + GOOD
    error = the_error(make_project, text, "deployment_prefix")
    assert error.field == "settings.deployment_prefix" and "pattern" in error.message, str(error)


def test_uses_of_the_wrong_shape_is_one_error_not_one_per_form(make_project):
    """Regression: `uses: 5` gave two errors on fields 'uses.list[str]' and 'uses.dict[str,str]'."""
    error = the_error(make_project, changed("after: []}", "after: [], uses: {sparse: [a, b]}}"), "uses:")
    assert error.field == "uses" and "[" not in error.field


@pytest.mark.parametrize("schedule, field, fragment", [
    ("{cron: 'every day'}", "schedule.cron", "'every day' has 2 fields; expected 5"),
    ("{cron: '61 * * * *'}", "schedule.cron", "'61' is not a valid minute (from 0 to 59)"),
    ("{cron: '0 3 * * *', timezone: Europe/Berln}", "schedule.timezone", "did you mean 'Europe/Berlin'"),
    ("{interval_seconds: 0}", "schedule.interval_seconds", "greater than 0"),
], ids=["cron-words", "cron-range", "timezone", "interval"])
def test_a_bad_schedule_is_caught_by_validate_not_by_serve(make_project, schedule, field, fragment):
    """Regression: cron and time zone were first checked when `ragline serve` registered the
    deployment, with no file, line or field."""
    text = changed('schedule: {cron: "0 * * * *"}', f"schedule: {schedule}")
    error = the_error(make_project, text, "schedule:")
    assert (error.pipeline, error.field) == ("index", field) and fragment in error.message, str(error)


CRON_CASES = ["0 * * * *", "*/15 * * * *", "0 3 * * MON-FRI", "0 3 * * mon", "0 0 1 JAN *", "0 0 L * *",
              "0 0 * * 5#2", "0 0 ? * *", "@hourly", "@daily", "0 0 * * * *", "0 0 * * * * 2030", "0 0 * * 7",
              "1-5/2 * * * *", "5-1 * * * *", "0,30 * * * *", "0-59/61 * * * *", "0 0 * JAN-MAR *", "00 00 * * *",
              "0 0 1,L * *", "0 0 * * 5L", "0 0 * * L", "? 0 * * *", "@reboot", "every day", "61 * * * *",
              "* 24 * * *", "0 0 0 * *", "0 0 32 * *", "0 0 * 13 *", "0 0 * * 8", "*/0 * * * *", "0, 30 * * * *",
              "", "* * * *", "0 0 LW * *", "H * * * *", "R * * * *", "a * * * *", "0 0 * * 1#6", "0 0 L-2 * *",
              "-1 * * * *", "0 0 * * 5-",
              "* * 15W * *", "0 0 * * 0-7", "0 0 * * * 0 1969"]  # 15W: a newer croniter than Prefect's accepts it


def test_the_cron_check_agrees_with_prefect():
    """ragline checks cron without importing Prefect (seconds per command); it must accept exactly
    what Prefect's own validator accepts."""
    from prefect._internal.schemas.validators import validate_cron_string

    def prefect_accepts(expression: str) -> bool:
        try:
            validate_cron_string(expression)
        except ValueError:
            return False
        return True

    disagreements = [c for c in CRON_CASES if (cron_problem(c) is None) != prefect_accepts(c)]
    assert disagreements == []


# ----------------------------------------------------------------------------- names that do not exist
def test_an_unknown_parameter_is_located_with_the_nearest_name(make_project):
    error = the_error(make_project, changed("with: {k: 5}", "with: {kk: 5}"), "kk: 5")
    assert (error.step, error.field) == ("dense", "with.kk")
    assert error.message == "unknown parameter 'kk' (did you mean 'k'?)"


def test_an_unknown_resource_is_located_with_the_nearest_name(make_project):
    error = the_error(make_project, changed("after: []}", "after: [], uses: [sparce]}"), "sparce")
    assert (error.pipeline, error.step, error.field) == ("ask", "sparse", "uses.0")
    assert error.message == "unknown resource 'sparce' (did you mean 'sparse'?)"


def test_an_unknown_resource_type_is_located(make_project):
    error = the_error(make_project, changed("type: bm25", "type: bm52"), "bm52")
    assert error.field == "resources.sparse" and "unknown resource type 'bm52'" in error.message


def test_a_dotted_path_to_a_missing_module_is_located_even_when_allowed(make_project, monkeypatch):
    monkeypatch.setenv("RAGLINE_ALLOW_MODULES", "ragline_no_such_pkg")
    error = the_error(make_project, changed("task: fuse,", "task: ragline_no_such_pkg.stages.fuse,"), "no_such")
    assert (error.step, error.field, error.message) == ("fuse", "task", "No module named 'ragline_no_such_pkg'")


def test_a_dotted_path_to_the_standard_library_is_refused(make_project, monkeypatch):
    monkeypatch.delenv("RAGLINE_ALLOW_MODULES", raising=False)
    error = the_error(make_project, changed("task: fuse,", "task: os.system,"), "os.system")
    assert (error.step, error.field) == ("fuse", "task") and "module 'os' is not allowed" in error.message


# ----------------------------------------------------------------------------- the DAG
@pytest.mark.parametrize("old, new, needle, field, fragment", [
    ("with: {k: 5}}", "with: {k: 5}, after: [fuse]}", "after: [fuse]", "after", "cycle between steps dense, fuse"),
    ("after: []}", "after: [sparse]}", "after: [sparse]", "after.0", "step 'sparse' cannot run after itself"),
    ("{id: insert, task: insert}", "{id: insert, task: insert, after: [answer]}", "after: [answer]", "after",
     "cycle between steps insert, answer"),
], ids=["two-steps", "itself", "through-the-default-order"])
def test_a_cycle_names_the_step_and_its_after(make_project, old, new, needle, field, fragment):
    error = the_error(make_project, changed(old, new), needle)
    assert (error.pipeline, error.field) == ("ask", field) and fragment in error.message, str(error)


# ----------------------------------------------------------------------------- prompt templates
def test_a_missing_template_is_located_with_the_nearest_name(make_project):
    error = the_error(make_project, changed("task: generate}", "task: generate, prompt: answer_with_citatons}"),
                      "citatons")
    assert (error.step, error.field) == ("answer", "prompt")
    assert "prompt template 'answer_with_citatons.j2' not found" in error.message
    assert error.message.endswith("(did you mean 'answer_with_citations'?)")


def test_a_template_syntax_error_names_the_step_and_the_template_line(make_project):
    """Regression: a broken template got a nonsense '(did you mean <itself>?)'."""
    broken = "{{ question }}\n{% for d in documents %}\n{{ d.number }\n{% endfor %}\n"
    error = the_error(make_project, changed("task: generate}", "task: generate, prompt: mine}"), "prompt: mine",
                      prompts={"mine": broken})
    assert (error.step, error.field) == ("answer", "prompt")
    assert error.message == "prompt template 'mine.j2' line 3: unexpected '}'"


def test_a_template_using_an_undefined_variable_is_located(make_project):
    error = the_error(make_project, changed("task: generate}", "task: generate, prompt: mine}"), "prompt: mine",
                      prompts={"mine": "{{ question }}\n{{ context }}\n"})
    assert error.message == ("prompt template 'mine.j2' uses undefined variable 'context' on line 2 "
                             "(the stage provides: conversation, documents, examples, instruction, question, refusal)")


# ----------------------------------------------------------------------------- nothing runs
def test_a_bad_file_stops_index_before_anything_is_opened(make_project, tmp_path, capsys):
    """Validation comes first: with a broken file no store is opened, so nothing indexed can change."""
    path = make_project(changed("with: {paths: [docs]}", "with: {paths: [docs], colour: red}"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("text")
    assert main(["index", "-f", str(path), "--no-prefect"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line_of(GOOD, 'id: load')}, pipeline 'index', step 'load', field 'with.colour'" in err
    assert not (tmp_path / "idx").exists()
