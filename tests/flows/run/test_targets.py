"""What an ingestion asked from outside the file runs (flows/run/targets.py): the collections' pipelines,
folders given instead of the file's own (resolved where they were given), no waiting for another
writer when asked, and every refusal typed and naming its field."""
from __future__ import annotations

import re

import pytest

from ragline.flows.errors import InputError
from ragline.flows.run.targets import ingestion_for, ingestion_names, source_locations
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.model import WrongPipelineKind
from tests.helpers.collection_specs import HANDBOOK, PAPERS, write


@pytest.fixture
def project(tmp_path):
    return load_project(write(tmp_path, HANDBOOK + PAPERS), tuned=False)


def test_the_collections_of_a_template_are_run_by_default_or_as_named(project):
    assert ingestion_names(project, "index", None, []) == ["index@handbook", "index@papers"]
    assert ingestion_names(project, "index", ["papers", "papers"], []) == ["index@papers"]
    assert ingestion_names(project, "search", None, []) == ["search"]


@pytest.mark.parametrize("collections, paths, says", [
    (None, ["notes"], "folders given for 'index', which indexes 2 collections (handbook, papers): name one"),
    (["papers", "handbook"], ["notes"], "folders given for several collections"),
    (["nope"], [], "no collection 'nope' of pipeline 'index'"),
])
def test_folders_for_several_collections_or_an_unknown_one_are_refused(project, collections, paths, says):
    with pytest.raises(InputError, match=re.escape(says)) as refused:
        ingestion_names(project, "index", collections, paths)
    assert refused.value.field == "collection"


def test_given_folders_replace_the_files_own_resolved_where_they_were_given(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")
    pipeline = ingestion_for(project, "index@papers", ["notes"], wait=False)
    assert [str(p.path) for p in pipeline.step("load").params.paths] == [str((tmp_path / ".." / "notes").resolve())]
    assert pipeline.step("write").params.wait is False
    assert source_locations(pipeline) == [str((tmp_path / ".." / "notes").resolve())]
    own = ingestion_for(project, "index@papers")
    assert own.step("write").params.wait is True and source_locations(own) == [str(tmp_path / "papers")]


def test_a_query_pipeline_is_refused_as_an_ingestion_before_anything_runs(project):
    with pytest.raises(WrongPipelineKind, match="pipeline 'search' is a query pipeline; this needs an ingestion"):
        ingestion_for(project, "search", ["notes"])
