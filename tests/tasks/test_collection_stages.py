"""Query stages that read the index but are not spread across collections (issue 19 item 1): with
collections declared the template's BM25 index is never written, so `self_query`'s match count and
`expand_prf`'s document frequencies and FLARE's re-retrieval read the collections the query searches
(before: an empty index, so every self-query filter was dropped as matching nothing, max_df kept every
term and FLARE's searches found nothing)."""
from __future__ import annotations

import pytest

from ragline.flows.resources import clear_cache
from ragline.flows.run import engine
from tests.helpers.collections import collections_yaml, index_collections, scripted_llm, write_files
from tests.helpers.data import REPO
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration  # real ingestion, Chroma and BM25

COLLECTIONS = "  notes: {paths: [notes]}\n  memos: {paths: [memos]}\n"
QUERIES = """
  filtered:
    kind: query
    steps:
      - {id: sq, task: self_query, with: {fallback: unfiltered,
                                          fields: {format: {type: enum, values: [markdown, html]}}}}
  expanded:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 10}}
      - {id: fuse,   task: fuse, with: {top_k: 10}}
      - {id: prf,    task: expand_prf, with: {docs: 4, terms: 20, max_df: 0.5, dense: false}}
  flare:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 1}}
      - {id: fuse,   task: fuse, with: {top_k: 1}}
      - {id: insert, task: insert, with: {max_documents: 1}}
      - {id: answer, task: generate_flare, with: {mode: instruct, k: 2, max_retrievals: 1}}
"""
DOCS = {  # "harbour" is in every document: max_df 0.5 leaves it out of the feedback terms. The memos share no
    # term with FLARE's question, so its first search finds the ferry note alone: two collections' best
    # passages tie under RRF, and a tie is broken by chunk id (a hash), which is no test of FLARE
    "notes/ferry.md": "# Ferry\n\nThe harbour ferry leaves at dawn; tickets are sold at the pier kiosk.\n",
    "notes/tides.md": "# Tides\n\nHarbour tides peak twice a day; the ferry waits for the high tide.\n",
    "memos/cranes.md": "# Cranes\n\nThe harbour cranes unload containers; crane operators work in shifts.\n",
    "memos/fees.md": "# Fees\n\nHarbour fees are billed per container and per crossing.\n",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("collection-stages")
    write_files(root, DOCS)
    (root / "prompts").symlink_to(REPO / "prompts")
    with ScriptedLLM(flare_reply) as llm:
        (root / "pipelines.yaml").write_text(collections_yaml(COLLECTIONS, QUERIES, chunk_size=64,
                                                              llm=scripted_llm(llm.base_url)))
        yield index_collections(root / "pipelines.yaml", {"notes": 2, "memos": 2}, tuned=False)
    clear_cache()


def flare_reply(prompt: str) -> str:
    """Asks for the cranes until a document about them is in the prompt, then cites it."""
    documents = prompt.split("Question:")[0]
    return "Crane operators work in shifts [2]." if "cranes unload" in documents else "[Search(harbour cranes)]"


def test_self_query_counts_matches_in_the_collections_the_query_searches(project):
    filtered = project.pipeline("filtered")
    kept = engine.run(filtered, {"query": "markdown notes on the ferry"}, orchestrate=False)
    assert kept.filters == {"format": "markdown"}  # documents match it: kept
    dropped = engine.run(filtered, {"query": "html pages on the ferry"}, orchestrate=False)
    assert dropped.filters is None  # none match: searched without it


def test_expand_prf_reads_document_frequencies_of_the_collections(project):
    query = engine.run(project.pipeline("expanded"), {"query": "ferry crane containers"}, orchestrate=False)
    terms = query.feedback.terms
    assert terms and "harbour" not in terms  # in every document of both collections


def test_flares_search_finds_passages_in_the_collections(project):
    answer = engine.run(project.pipeline("flare"), {"query": "ferry tickets at the pier kiosk"}, orchestrate=False)
    assert answer.retrievals == 1
    assert "shifts" in answer.text and [s.collection for s in answer.sources] == ["memos"]
    only_notes = engine.run(project.pipeline("flare"), {"query": {"text": "ferry tickets at the pier kiosk",
                                                                  "collections": ["notes"]}}, orchestrate=False)
    assert not any(s.collection == "memos" for s in only_notes.sources)  # FLARE searches what the query may
