"""Self-query on a real index: SciFact abstracts with a `year` and a `venue` in their JSONL
metadata, real embeddings, embedded Chroma and BM25. "Papers from 2020 about X" returns only 2020
documents from a hybrid pipeline; with the client's own filter the result is the intersection;
the server's access clause still applies (the 2020 pubmed abstracts are for hr only)."""
from __future__ import annotations

import pytest

from ragline.flows.run import engine
from ragline.flows.serve.query_service import access_for
from ragline.flows.spec.compile import load_project
from tests.helpers.data import BASE_RESOURCES, scifact_records, write_jsonl

YEARS = [2018, 2019, 2020, 2021]
VENUES = ["pubmed", "arxiv"]

PIPELINES = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [docs], acl_field: groups}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  plain:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
  self_query:
    kind: query
    steps:
      - id: filter
        task: self_query
        with:
          fields:
            year: {type: int, min: 1900, max: 2100}
            venue: {type: enum, values: [pubmed, arxiv]}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [filter]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
  fallback:
    kind: query
    steps:
      - id: filter
        task: self_query
        with:
          fallback: unfiltered
          fields:
            year: {type: int, min: 1900, max: 2100}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [filter]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("self_query")
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES)
    (folder / "prompts").mkdir()
    records = [{**r, "metadata": {"year": YEARS[i % 4], "venue": VENUES[(i // 4) % 2]}}
               for i, r in enumerate(scifact_records(80))]
    for record in records:  # the 2020 pubmed abstracts are for hr only
        if (record["metadata"]["year"], record["metadata"]["venue"]) == (2020, "pubmed"):
            record["metadata"]["groups"] = "hr"
    write_jsonl(folder / "docs" / "scifact.jsonl", records)
    loaded = load_project(path)
    engine.run(loaded.pipeline("index"), orchestrate=False)
    return loaded, records


def search(project, pipeline: str, text: str, **query):
    loaded, _ = project
    return engine.run(loaded.pipeline(pipeline), {"query": {"text": text, **query}}, orchestrate=False)


def test_papers_from_2020_returns_only_2020_documents(project):
    _, records = project
    target = records[2]  # a 2020 pubmed abstract
    topic = target["title"]
    unfiltered = search(project, "plain", f"papers from 2020 about {topic}")
    assert {p.metadata["year"] for p in unfiltered} > {2020}  # the words alone do not filter
    found = search(project, "self_query", f"papers from 2020 about {topic}")
    assert found and {p.metadata["year"] for p in found} == {2020}
    assert found[0].metadata["doc_id"] == target["_id"]
    ranged = search(project, "self_query", f"studies between 2019 and 2020 on {topic}")
    assert {p.metadata["year"] for p in ranged} == {2019, 2020}


def test_the_clients_filter_and_access_narrow_it_further(project):
    _, records = project
    topic = records[2]["title"]
    both = search(project, "self_query", f"papers from 2020 about {topic}", filters={"venue": "arxiv"})
    assert both and {(p.metadata["year"], p.metadata["venue"]) for p in both} == {(2020, "arxiv")}
    text = f"papers from 2020 about {topic}"
    intersection = search(project, "plain", text, filters={"$and": [{"venue": "arxiv"}, {"year": 2020}]})
    assert [p.chunk_id for p in both] == [p.chunk_id for p in intersection]
    # the self-query filter cannot widen what the client asked: a year it excludes stays excluded
    none = search(project, "self_query", f"papers from 2020 about {topic}", filters={"year": 2018})
    assert none == []
    # the server's access clause stays: an eng principal gets the 2020 documents it may read
    restricted = search(project, "self_query", f"papers from 2020 about {topic}", access=access_for({"eng"}))
    assert restricted and {(p.metadata["year"], p.metadata["venue"]) for p in restricted} == {(2020, "arxiv")}


def test_fallback_searches_without_a_filter_that_matches_nothing_it_may_read(project, caplog):
    _, records = project
    topic = records[2]["title"]
    assert search(project, "self_query", f"papers from 1999 about {topic}") == []  # no 1999 documents
    with caplog.at_level("WARNING"):
        widened = search(project, "fallback", f"papers from 1999 about {topic}")
    assert widened and widened[0].metadata["doc_id"] == records[2]["_id"]
    assert "matches no document this query may read" in caplog.text
    found = search(project, "fallback", f"papers from 2020 about {topic}")
    assert {p.metadata["year"] for p in found} == {2020}  # a filter that matches is kept
    # the 2020 pubmed abstracts exist but are hr's: for eng the filter matches nothing it may read, and
    # the search without it stays within the client's filter and eng's access
    eng = search(project, "fallback", f"papers from 2020 about {topic}", filters={"venue": "pubmed"},
                 access=access_for({"eng"}))
    assert eng and all(p.metadata["venue"] == "pubmed" and p.metadata["year"] != 2020 for p in eng)
