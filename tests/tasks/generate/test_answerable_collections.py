"""The answerability gate's floor over named collections (issue 19 item 1): each collection's ingestion
records its own floor in its own state; a query over some collections is gated by the lowest floor of
those it searches (a collection without one leaves the gate off), as a file with one index is by its own."""
from __future__ import annotations

import textwrap

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources import clear_cache
from ragline.flows.spec.compile import load_project
from ragline.tasks.generate.answerable import FLOOR_KEY, Floor, indexed_floor
from tests.helpers.collection_specs import PIPELINES, RESOURCES


def test_a_query_is_gated_by_the_floors_of_the_collections_it_searches(tmp_path):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(RESOURCES + """
collections:
  handbook: {paths: [handbook]}
  papers:   {paths: [papers]}
  memos:    {paths: [memos]}
""" + PIPELINES))
    project = load_project(path, tuned=False)
    embedder = project.resource("embedder")
    try:
        for name, value in (("handbook", 0.4), ("papers", 0.3)):
            floor = Floor(min_similarity=value, generation=1, pairs=48, keep=0.98, embedder=embedder.spec.vectors_key())
            project.resource(f"state@{name}").set_meta(FLOOR_KEY, floor.model_dump_json())
        ctx = StepContext(pipeline="search", step_id="gate", project=project)

        assert indexed_floor(ctx, embedder, Query(text="q", collections=["handbook"])) == 0.4
        assert indexed_floor(ctx, embedder, Query(text="q", collections=["handbook", "papers"])) == 0.3
        assert indexed_floor(ctx, embedder, Query(text="q", collections=["memos", "papers"])) is None  # none for memos
        assert indexed_floor(ctx, embedder, Query(text="q")) is None  # all three: memos has none
    finally:
        clear_cache()
