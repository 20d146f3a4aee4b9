"""Bad queries (issue 9) through the engine and the `ragline` command on a real index: each is
refused before any step runs with an error naming the field (exit 2, a usage error), or answered
normally; none of them changes the index. (The HTTP API's cases live in tests/flows/test_api*.py.)"""
from __future__ import annotations

import json
import time

import pytest

from ragline.flows.run import engine
from ragline.flows.cli import main
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.data import index_and_search_yaml
from tests.helpers.harness import snapshot

DOCS = {"okapi.md": "# Okapi\n\nOkapi BM25 ranks documents by term frequency and document length.\n",
        "zebrafish.txt": "Zebrafish regenerate their fins and heart muscle.",
        "telomere.md": "# Telomeres\n\nTelomerase keeps the ends of chromosomes long in stem cells.\n"}


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """(pipelines.yaml, snapshot of the index) for a small indexed project."""
    folder = tmp_path_factory.mktemp("bad_queries")
    (folder / "docs").mkdir()
    for name, text in DOCS.items():
        (folder / "docs" / name).write_text(text)
    (folder / "prompts").mkdir()
    project = folder / "pipelines.yaml"
    project.write_text(index_and_search_yaml())
    assert engine.run(load_project(project).pipeline("index"), orchestrate=False).added == 3
    before = snapshot(project)
    yield project, before
    assert snapshot(project) == before, "a bad query changed the index"  # after the last test of this file
    clear_cache()


def search(project, *args: str) -> int:
    return main(["search", *args, "-f", str(project)])


@pytest.mark.parametrize("text", ["", "   \n\t  "], ids=["empty", "whitespace"])
def test_an_empty_question_is_a_usage_error_naming_the_field(indexed, capsys, text):
    project, _ = indexed
    assert search(project, text) == 2
    expected = "error: pipeline 'search': invalid query (text: Value error, the question is empty)"
    assert capsys.readouterr().err.strip() == expected
    with pytest.raises(ValueError, match="the question is empty"):
        engine.run(load_project(project).pipeline("search"), {"query": text}, orchestrate=False)


def test_a_100000_character_question_is_answered(indexed):
    """Dense retrieval reads the model's 256 tokens, BM25 every word: no error, no blow-up."""
    project, _ = indexed
    question = ("okapi ranking " * 7200)[:100_000]
    started = time.process_time()  # CPU time: a loaded machine does not inflate it as it does the wall clock
    passages = engine.run(load_project(project).pipeline("search"), {"query": question}, orchestrate=False)
    assert passages[0].source_id.endswith("okapi.md")
    assert time.process_time() - started < 60  # a few seconds; the bound only catches a pathological path


@pytest.mark.parametrize("where, problem", [
    ('{"year": {"$between": [1, 2]}}', "unknown filter operator '$between' on field 'year'"),
    ('{"$nor": [{"format": "text"}]}', "unknown filter operator '$nor'"),
    ('{"format": {"$in": "markdown"}}', "$in on field 'format' needs a list, got 'markdown'"),
    ('{"$or": [{"format": "text"}, {"year": {"$like": 1}}]}', "unknown filter operator '$like' on field 'year'"),
    ('{"$and": {"format": "text"}}', "$and needs a list of filters, got {'format': 'text'}"),
], ids=["unknown-operator", "unknown-top-level", "in-not-a-list", "hidden-in-or", "and-not-a-list"])
def test_a_bad_where_filter_is_a_usage_error_naming_the_filter(indexed, capsys, where, problem):
    """Regression: a bad filter failed the run as a step failure (exit 1, 'step dense failed: FilterError')."""
    project, _ = indexed
    assert search(project, "okapi", "--where", where) == 2
    assert capsys.readouterr().err.strip() == f"error: pipeline 'search': invalid query (filters: {problem})"


def test_a_where_filter_that_is_not_a_mapping_is_named(indexed, capsys):
    project, _ = indexed
    assert search(project, "okapi", "--where", "[1, 2]") == 2
    assert "invalid query (filters: Input should be a valid dictionary)" in capsys.readouterr().err


def test_a_where_filter_that_is_not_json_is_a_usage_error(indexed, capsys):
    project, _ = indexed
    with pytest.raises(SystemExit) as exited:
        search(project, "okapi", "--where", "{format: markdown}")
    assert exited.value.code == 2 and "argument --where: invalid JSON '{format: markdown}': Expecting property name" in \
        capsys.readouterr().err


def test_a_where_filter_matching_nothing_is_an_empty_answer_not_an_error(indexed, capsys):
    project, _ = indexed
    assert search(project, "okapi", "--where", '{"format": "pdf"}') == 0
    assert capsys.readouterr().out.strip() == "no passages found"


def test_a_misspelt_query_field_is_refused_not_ignored(indexed):
    """Regression: {"filter": ...} was dropped silently and the search ran unfiltered."""
    project, _ = indexed
    with pytest.raises(ValueError, match=r"invalid query \(filter: Extra inputs are not permitted\)"):
        engine.run(load_project(project).pipeline("search"),
                   {"query": {"text": "okapi", "filter": {"format": "text"}}}, orchestrate=False)


@pytest.mark.parametrize("inputs, message", [
    ("{}", "error: pipeline 'search' needs a 'query' input"),
    ('{"query": 5}', "error: pipeline 'search': invalid query (query: Input should be a valid dictionary"),
    ('{"query": {"text": "okapi", "history": "not a list"}}', "history: Input should be a valid list"),
], ids=["no-query", "query-not-an-object", "history-not-a-list"])
def test_run_with_a_malformed_input_names_it(indexed, capsys, inputs, message):
    project, _ = indexed
    assert main(["run", "search", "-f", str(project), "--no-prefect", "--input", inputs]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, hint", [("serch", " (did you mean 'search'?)"), ("nope", "")],
                         ids=["typo", "unknown"])
def test_an_unknown_pipeline_is_named_with_the_ones_that_exist(indexed, capsys, name, hint):
    project, _ = indexed
    assert search(project, "okapi", "-p", name) == 2
    expected = f"error: no pipeline '{name}' in {project}{hint}; available: index, search"
    assert capsys.readouterr().err.strip() == expected


def test_a_mistake_in_another_pipeline_stops_neither_search_nor_the_kind_check(indexed, capsys, tmp_path):
    """A query compiles the pipeline it runs (issue 38); `validate` reports the other's mistake, and
    asking for an ingestion pipeline still names every query pipeline of the file."""
    project, _ = indexed
    broken = project.parent / "broken.yaml"
    broken.write_text(project.read_text() + "  ask:\n    kind: query\n    steps:\n"
                                            "      - {id: dense, task: retrieve_dense, with: {k: 0}}\n")
    capsys.readouterr()
    assert search(broken, "telomerase stem cells", "--json") == 0
    assert json.loads(capsys.readouterr().out)[0]["source_id"].endswith("telomere.md")
    assert main(["validate", "-f", str(broken)]) == 2
    assert "pipeline 'ask', step 'dense'" in capsys.readouterr().err
    broken.write_text(project.read_text() + "  search_dense:\n    kind: query\n    steps:\n"
                                            "      - {id: dense, task: retrieve_dense}\n")
    assert search(broken, "okapi", "-p", "index") == 2
    assert capsys.readouterr().err.strip().endswith("(query pipelines in broken.yaml: search, search_dense)")


def test_the_good_query_still_works_after_the_bad_ones(indexed, capsys):
    project, before = indexed
    capsys.readouterr()
    assert search(project, "telomerase stem cells", "--json") == 0
    assert json.loads(capsys.readouterr().out)[0]["source_id"].endswith("telomere.md")
    assert snapshot(project) == before
