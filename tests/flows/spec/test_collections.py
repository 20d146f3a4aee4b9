"""Named collections in pipelines.yaml (issue 19 item 1): each compiles the ingestion template over its
own sources, schedule and index; query retrievers search every collection; a collection's mistakes
are located at its own fields; adding a collection leaves the others' fingerprints (their indexes) alone."""
from __future__ import annotations

import textwrap

import pytest

from ragline.flows.errors import InputError
from ragline.flows.run.query_runner import coerce_inputs
from ragline.flows.spec.collections import for_collection
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.parse import SpecValidationError
from tests.helpers.collection_specs import HANDBOOK, PAPERS, PIPELINES, RESOURCES, write



def test_each_collection_compiles_the_template_over_its_own_sources_schedule_and_index(tmp_path):
    project = load_project(write(tmp_path, HANDBOOK + PAPERS), tuned=False)

    assert list(project.pipelines) == ["index@handbook", "index@papers", "search"]  # the template is not runnable
    handbook, papers = project.pipeline("index@handbook"), project.pipeline("index@papers")
    assert handbook.spec.schedule.interval_seconds == 600 and papers.spec.schedule.cron == "0 * * * *"  # inherited
    assert papers.spec.description == "Research papers"
    assert handbook.step("load").params.paths[0].path == "handbook"
    assert papers.step("chunk").params.overlap == 16 and handbook.step("chunk").params.overlap == 8
    assert papers.step("write").resources == {"store": "store@papers", "sparse": "sparse@papers",
                                              "state": "state@papers"}
    resources = project.spec.resources
    assert (resources["store@papers"].collection, resources["store@papers"].path) == ("papers", "idx/chroma")
    assert resources["sparse@papers"].path == "idx/collections/papers/bm25" and resources["sparse@papers"].k1 == 0.9
    assert resources["sparse@handbook"].k1 == resources["sparse"].k1
    assert resources["state@handbook"].path == "idx/collections/handbook/state.sqlite"

    search = project.pipeline("search")
    assert search.collections == ["handbook", "papers"]
    assert search.step("dense").collections["papers"] == {"store": "store@papers", "embedder": "embedder"}
    assert search.step("sparse").collections["handbook"] == {"sparse": "sparse@handbook", "state": "state@handbook"}
    assert search.step("fuse").collections == {}


def test_without_collections_nothing_changes(tmp_path):
    project = load_project(write(tmp_path, None), tuned=False)

    assert list(project.pipelines) == ["index", "search"] and project.collections == {}
    assert all(not s.collections for s in project.pipeline("search").steps)
    assert not any("@" in name for name in project.spec.resources)


def test_a_query_may_name_only_the_collections_its_pipeline_searches(tmp_path):
    search = load_project(write(tmp_path, HANDBOOK + PAPERS), tuned=False).pipeline("search")

    assert coerce_inputs(search, {"query": {"text": "q", "collections": ["papers"]}})["query"].collections == ["papers"]
    with pytest.raises(InputError, match="unknown collection 'memos'; it searches handbook, papers") as caught:
        coerce_inputs(search, {"query": {"text": "q", "collections": ["papers", "memos"]}})
    assert caught.value.field == "collections"


def test_adding_a_collection_keeps_the_others_fingerprints(tmp_path):
    before = load_project(write(tmp_path, HANDBOOK, "one.yaml"), tuned=False)
    after = load_project(write(tmp_path, PAPERS + HANDBOOK, "two.yaml"), tuned=False)

    def fingerprint(project, name):
        pipeline = project.pipeline(name)
        return pipeline.fingerprint([s for s in pipeline.steps if s.stage.plan is None])

    assert fingerprint(after, "index@handbook") == fingerprint(before, "index@handbook")
    assert fingerprint(after, "index@papers") != fingerprint(after, "index@handbook")  # its own chunking and BM25


def test_a_collection_that_mirrors_the_implicit_index_keeps_its_fingerprint(tmp_path):
    """Moving a file's one index into `collections:` re-indexes nothing when its settings stay the same."""
    plain = load_project(write(tmp_path, None, "plain.yaml"), tuned=False).pipeline("index")
    same = """
  test:
    resources: {sparse: {path: idx/bm25}, state: {path: idx/state.sqlite}}
"""
    named = load_project(write(tmp_path, same, "named.yaml"), tuned=False).pipeline("index@test")

    assert named.fingerprint(named.steps[:-1]) == plain.fingerprint(plain.steps[:-1])


MISTAKES = """
  ok-one:
    paths: [a]
  x:
    paths: [b]
  bad-template:
    template: search
  bad-resource:
    resources:
      spares: {k1: 1}
      store: {collection: other}
      sparse: {k1: -3}
  bad-step:
    steps:
      chunck: {overlap: 1}
      chunk: {overlap: -1}
  bad-field:
    schedul: {cron: "0 * * * *"}
"""


def test_every_collection_mistake_is_located_at_its_own_line_and_field(tmp_path):
    path = write(tmp_path, MISTAKES)
    lines = path.read_text().splitlines()

    def line_of(text: str) -> int:
        return next(i for i, line in enumerate(lines, start=1) if text in line)

    with pytest.raises(SpecValidationError) as caught:
        load_project(path, tuned=False)
    found = {(e.line, e.field): e.message for e in caught.value.errors}

    assert "must be 3-63 letters" in found[(line_of("  x:"), "collections.x")]
    assert "'search' is not an ingestion pipeline" in found[(line_of("template: search"),
                                                             "collections.bad-template.template")]
    assert "did you mean 'sparse'" in found[(line_of("spares:"), "collections.bad-resource.resources.spares")]
    assert "keeps its collection: the collection's name, 'bad-resource'" in found[(line_of("store: {collection"),
                                                       "collections.bad-resource.resources.store.collection")]
    assert "greater than 0" in found[(line_of("sparse: {k1: -3}"), "collections.bad-resource.resources.sparse.k1")]
    assert "no step 'chunck' (did you mean 'chunk'?)" in found[(line_of("chunck:"),
                                                                "collections.bad-step.steps.chunck")]
    assert "(got -1)" in found[(line_of("chunk: {overlap: -1}"), "collections.bad-step.steps.chunk.overlap")]
    assert "unknown field 'schedul'" in found[(line_of("schedul:"), "collections.bad-field.schedul")]
    assert len(found) == 8, found


TUNE_JOB = """
  tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
"""


def test_a_job_reading_the_template_index_is_compiled_per_collection_and_run_for_one(tmp_path):
    path = write(tmp_path, HANDBOOK + PAPERS)
    path.write_text(path.read_text() + TUNE_JOB)
    project = load_project(path, tuned=False)

    assert list(project.pipelines) == ["index@handbook", "index@papers", "search", "tune@handbook", "tune@papers"]
    assert project.pipeline("tune@papers").step("tune").resources["sparse"] == "sparse@papers"
    assert project.pipeline("tune@papers").step("pairs").resources == {"state": "state@papers"}
    with pytest.raises(InputError, match=r"name it with --collection \(handbook, papers\)"):
        for_collection(project, "tune", None)
    with pytest.raises(InputError, match="no collection 'paper' .*did you mean 'papers'"):
        for_collection(project, "tune", "paper")
    assert for_collection(project, "tune", "papers") == "tune@papers"
    assert for_collection(project, "index", "handbook") == "index@handbook"
    assert for_collection(project, "search", None) == "search"

    path.write_text(path.read_text().replace(HANDBOOK, ""))
    assert for_collection(load_project(path, tuned=False), "tune", None) == "tune@papers"  # the only one


def test_without_collections_a_job_keeps_its_name(tmp_path):
    path = write(tmp_path, None)
    path.write_text(path.read_text() + TUNE_JOB)
    project = load_project(path, tuned=False)
    assert for_collection(project, "tune", None) == "tune" and "tune" in project.pipelines
    with pytest.raises(InputError, match="not compiled per collection"):
        for_collection(project, "tune", "papers")


def test_a_collection_whose_own_parameters_read_a_resource_binds_it_or_says_at_that_line(tmp_path):
    """A step the template leaves without an LLM (enrich, context: title) that a collection turns to
    context: llm reads the LLM: bound in that collection's pipeline, or, without one in the file, an
    error at the collection's own field (it failed only when that collection was indexed)."""
    enriched = PIPELINES.replace("      - {id: embed,", "      - {id: enrich,  task: enrich, with: {context: title}}\n"
                                                       "      - {id: embed,")
    collections = """
  plain:
    paths: [a]
  summarised:
    paths: [b]
    steps:
      enrich:
        context: llm
"""
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + f"collections:{collections}" + enriched))
    with pytest.raises(SpecValidationError) as caught:
        load_project(path, tuned=False)
    [error] = caught.value.errors
    line = next(i for i, text in enumerate(path.read_text().splitlines(), start=1) if "context: llm" in text)
    assert (error.line, error.field) == (line, "collections.summarised.steps.enrich.context")
    assert "context 'llm' has the LLM write a sentence per document" in error.message
    path.write_text(path.read_text().replace("resources:\n", 'resources:\n  llm: {type: openai_compatible, '
                                                             'base_url: "http://127.0.0.1:9/v1"}\n', 1))
    project = load_project(path, tuned=False)
    assert project.pipeline("index@summarised").step("enrich").resources == {"llm": "llm"}
    assert project.pipeline("index@plain").step("enrich").resources == {}
