"""`ragline serve` deploys each collection's ingestion as its own deployment (issue 19 item 1): named
``<template>@<collection>``, with the collection's schedule (or the template's), one run at a time;
the template itself is not deployed (no query would read what it wrote)."""
from __future__ import annotations

import textwrap

from ragline.flows.serve.supervise.service import build_deployments, deployment_options
from ragline.flows.spec.compile import load_project
from tests.helpers.collection_specs import PIPELINES, RESOURCES


def test_each_collection_is_its_own_scheduled_deployment(tmp_path):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + """
collections:
  handbook: {paths: [handbook], schedule: {interval_seconds: 600}}
  papers:   {paths: [papers]}
""" + PIPELINES))
    options = deployment_options(load_project(path, tuned=False))

    assert list(options) == ["index@handbook", "index@papers", "search"]
    assert [s.interval.total_seconds() for s in options["index@handbook"]["schedules"]] == [600]
    assert [s.cron for s in options["index@papers"]["schedules"]] == ["0 * * * *"]  # the template's
    assert options["index@papers"]["parameters"]["pipeline"] == "index@papers"
    assert options["index@papers"]["concurrency_limit"].limit == 1
    assert "collection 'papers'" in options["index@papers"]["description"]
    assert [d.name for d in build_deployments(path)] == ["index@handbook", "index@papers", "search"]


def test_a_job_over_the_templates_index_is_deployed_per_collection_with_its_schedule(tmp_path):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
""" + PIPELINES + """
  tune:
    kind: job
    schedule: {cron: "0 3 * * 0"}
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
"""))
    options = deployment_options(load_project(path, tuned=False))

    assert [name for name in options if name.startswith("tune")] == ["tune@handbook", "tune@papers"]
    assert [s.cron for s in options["tune@papers"]["schedules"]] == ["0 3 * * 0"]
    assert options["tune@papers"]["parameters"]["pipeline"] == "tune@papers"
    assert "collection 'papers'" in options["tune@papers"]["description"]


def test_an_ingest_request_starts_its_collections_run_and_names_the_field_when_ambiguous(tmp_path):
    import pytest

    from ragline.flows.serve.query_service import ApiError
    from ragline.flows.serve.ingestion_runs import IngestRequest
    from ragline.flows.serve.routers.runs import _collection_pipeline

    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
""" + PIPELINES))
    project = load_project(path, tuned=False)

    assert _collection_pipeline(project, IngestRequest(collection="papers")) == "index@papers"
    assert _collection_pipeline(project, IngestRequest(pipeline="index@handbook")) == "index@handbook"
    for request, said in ((IngestRequest(), "--collection"), (IngestRequest(collection="hr"), "no collection 'hr'")):
        with pytest.raises(ApiError) as refused:
            _collection_pipeline(project, request)
        assert refused.value.status == 400 and refused.value.param == "collection"
        assert refused.value.message.startswith("field 'collection'") and said in refused.value.message


def test_a_job_without_a_schedule_is_deployed_only_when_the_operator_asks(tmp_path, monkeypatch):
    """Issue 39 item 1: a job deployment re-tunes or re-summarises what queries read, and anyone on
    the Prefect API can start a deployment: an unscheduled job is deployed only on request."""
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + PIPELINES + """
  tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
  weekly:
    kind: job
    schedule: {cron: "0 3 * * 0"}
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
"""))
    project = load_project(path, tuned=False)
    monkeypatch.delenv("RAGLINE_SERVE_JOBS", raising=False)

    assert "tune" not in deployment_options(project) and "weekly" in deployment_options(project)
    assert "tune" in deployment_options(project, serve_jobs=True)
    monkeypatch.setenv("RAGLINE_SERVE_JOBS", "1")
    assert "tune" in deployment_options(project)
    assert "tune" not in deployment_options(project, serve_jobs=False)
