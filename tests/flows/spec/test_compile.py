"""Compiling a pipelines file: every error at once, in file order, each located (file, line,
pipeline, step, field); the compiled steps in dependency order with their wiring; user-stage
modules allowed from the project's pyproject.toml, whose own mistakes are located there too.
(Each check's wording: test_spec.py, test_bad_config.py; the allowlist's sources: test_allowlist.py.)"""
from __future__ import annotations

import textwrap

import pytest

from ragline.flows.spec import registry
from ragline.flows.spec.compile import external_allowlist, load_project, project_allowlist, validate_file
from ragline.flows.errors import ConfigError
from ragline.flows.spec.parse import SpecValidationError
from tests.helpers.data import index_and_search_yaml

GOOD = """
pipelines:
  search:
    kind: query
    steps:
      - {id: fuse,   task: fuse, after: [dense, sparse]}
      - {id: sparse, task: retrieve_sparse, after: []}
      - {id: dense,  task: retrieve_dense}
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
"""

THREE_MISTAKES = """
resources:
  store: {type: chroma, path: idx/chroma, collection: test}
pipelines:
  search:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 0}}
      - {id: other, task: nope}
      - {id: fuse,  task: fuse, after: [dense, missing]}
"""


@pytest.fixture(autouse=True)
def no_external_allowlist(monkeypatch):
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    registry.set_allowed_modules([])
    yield
    registry.set_allowed_modules([])


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), start=1) if needle in line)


def test_a_good_file_compiles_in_dependency_order(make_project):
    path = make_project(GOOD)
    assert validate_file(path) == []
    project = load_project(path, tuned=False)
    search = project.pipeline("search")
    order = [s.id for s in search.steps]
    assert order.index("fuse") > order.index("dense") and order.index("fuse") > order.index("sparse")
    assert sorted(search.step("fuse").wiring["rankings"]) == ["dense", "sparse"]
    assert search.step("dense").resources == {"store": "store", "embedder": "embedder"}
    assert project.path == path.resolve() and project.source is None


def test_every_error_is_reported_at_once_in_file_order_and_located(make_project):
    path = make_project(THREE_MISTAKES)
    with pytest.raises(SpecValidationError) as info:
        load_project(path)
    errors = info.value.errors
    located = [(e.line, e.step, e.field, e.message) for e in errors]
    dense, other, fuse = (line_of(THREE_MISTAKES, f"id: {step}") for step in ("dense", "other", "fuse"))
    assert located == [
        (dense, "dense", "with.k", "Input should be greater than or equal to 1 (got 0)"),
        (dense, "dense", "uses", "task 'retrieve_dense' needs a sentence_transformer resource for 'embedder' and the "
                                 "file has no resource: name one in `uses`"),
        (other, "other", "task", "unknown task 'nope'"),
        (fuse, "fuse", "after.1", "unknown step 'missing'"),
    ]
    assert all(e.file == str(path.resolve()) and e.pipeline == "search" for e in errors)
    assert validate_file(path) == errors


def test_the_raised_error_is_a_config_error_naming_the_first_problem(make_project):
    path = make_project(THREE_MISTAKES)
    with pytest.raises(ConfigError) as info:
        load_project(path)
    first = info.value.errors[0]
    assert (info.value.file, info.value.line, info.value.field) == (first.file, first.line, first.field)
    assert str(info.value).splitlines()[0] == str(first)
    assert str(first).startswith(f"{path.resolve()}:{first.line}, pipeline 'search', step '{first.step}', field '")


@pytest.mark.parametrize("text, line", [
    ("pipelines:\n  search: [unclosed\n", 3),  # where the YAML parser saw the end it missed
    ("pipelines:\n  search:\n    kind: query\n    kind: ingestion\n    steps: []\n", 4),
])
def test_a_file_that_does_not_parse_is_located(make_project, text, line):
    path = make_project(text)
    [error] = validate_file(path)
    assert error.file == str(path.resolve()) and error.line == line


def test_a_missing_file_is_one_error_naming_it(tmp_path):
    errors = validate_file(tmp_path / "absent.yaml")
    assert len(errors) == 1 and str(tmp_path / "absent.yaml") in str(errors[0])


# ----------------------------------------------------------------------------- the project's allowlist
DOTTED = GOOD.replace("task: fuse,", "task: ragline.tasks.retrieve.fuse.fuse,")


def test_a_user_stage_compiles_when_the_nearest_pyproject_allows_its_module(tmp_path):
    path = tmp_path / "app" / "pipelines.yaml"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(DOTTED))
    assert "is not allowed" in validate_file(path)[0].message
    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["elsewhere"]\n')
    (path.parent / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.ragline]\nallow_modules = ["ragline.tasks"]\n')
    assert project_allowlist(path) == (("ragline.tasks",), [])  # the nearest, not the parent's
    assert validate_file(path) == []
    assert load_project(path).pipeline("search").step("fuse").stage.name == "fuse"


def test_a_bad_allowlist_in_pyproject_is_located_there(tmp_path, make_project):
    path = make_project(GOOD)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n\n[tool.ragline]\nallow_modules = "ragline.tasks"\n')
    [error] = validate_file(path)
    assert (error.file, error.line) == (str(pyproject), 5)
    assert error.message == "[tool.ragline] allow_modules must be a list of dotted module names"


def test_an_unreadable_pyproject_is_an_error_naming_it(tmp_path, make_project):
    path = make_project(GOOD)
    (tmp_path / "pyproject.toml").write_text("[tool.ragline\n")
    [error] = validate_file(path)
    assert error.file == str(tmp_path / "pyproject.toml") and error.message.startswith("cannot read [tool.ragline]:")


def test_a_bad_environment_allowlist_is_an_error_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ALLOW_ENV, "good.module,not a module")
    path = tmp_path / "pipelines.yaml"
    modules, [error] = external_allowlist(path, ["extra"])
    assert modules == () and error.file == str(path) and "not a dotted module name: 'not a module'" in error.message


def test_the_external_allowlist_joins_code_extra_and_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["from_pyproject"]\n')
    registry.set_allowed_modules(["from_code"])
    assert external_allowlist(tmp_path / "pipelines.yaml", ["from_flag"]) == (
        ("from_code", "from_flag", "from_pyproject"), [])


def test_an_unknown_or_wrong_kind_of_pipeline_is_a_typed_input_error_naming_the_field(make_project):
    """The CLI and the API decide by the error's class (issue 37.4): no builtin exception reaches them."""
    from ragline.flows.spec.model import UnknownPipeline, WrongPipelineKind, require_kinds

    project = load_project(make_project(GOOD), tuned=False)
    with pytest.raises(UnknownPipeline) as unknown:
        project.pipeline("serch")
    assert str(unknown.value).startswith("no pipeline 'serch'") and "did you mean 'search'" in str(unknown.value)
    assert unknown.value.field == "pipeline" and unknown.value.exit_code == 2 and unknown.value.http_status == 404
    assert isinstance(unknown.value, KeyError)  # the lookups that catch a KeyError still do
    with pytest.raises(WrongPipelineKind, match="pipeline 'search' is a query pipeline; this needs an ingestion"):
        require_kinds(project, ingestion="search")


BROKEN_ELSEWHERE = GOOD.replace("\nresources:", """
  ask:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 0}}
resources:""")


def test_only_compiles_the_pipelines_named_and_leaves_the_rest_to_validate(make_project):
    """A query from the terminal compiles what it runs (issue 38): a mistake in another pipeline does
    not stop it, and `ragline validate` (the whole file) still reports it."""
    path = make_project(BROKEN_ELSEWHERE)
    project = load_project(path, tuned=False, only=["search"])
    assert list(project.pipelines) == ["search"] and project.partial
    assert [s.id for s in project.pipeline("search").steps][-1] == "fuse"
    assert project.relocated(path.parent / "elsewhere").partial
    with pytest.raises(SpecValidationError, match="k"):
        load_project(path, tuned=False)
    assert [e.pipeline for e in validate_file(path)] == ["ask"]
    with pytest.raises(SpecValidationError):  # the broken one asked for: its errors
        load_project(path, tuned=False, only=["ask"])


def test_only_with_a_name_the_file_lacks_compiles_everything_for_the_error(make_project):
    from ragline.flows.spec.model import UnknownPipeline

    project = load_project(make_project(GOOD), tuned=False, only=["serch"])
    assert not project.partial and list(project.pipelines) == ["search"]
    with pytest.raises(UnknownPipeline, match="did you mean 'search'"):
        project.pipeline("serch")


def test_only_compiles_the_templates_of_the_files_collections(make_project):
    text = textwrap.dedent(index_and_search_yaml()) + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
"""
    full = load_project(make_project(text), tuned=False)
    project = load_project(make_project(text), tuned=False, only=["search"])
    assert sorted(project.pipelines) == sorted(full.pipelines) == ["index@handbook", "index@papers", "search"]
    assert project.pipeline("search").step("dense").collections == full.pipeline("search").step("dense").collections
