"""`ragline index` and `ragline search` over named collections (issue 19 item 1): without --collection
the index command writes every collection (each its own run and index); --collection picks one, an
unknown name is a usage error naming it; search --collection returns that collection's passages only,
each saying where it came from."""
from __future__ import annotations

import json

import pytest

from ragline.flows.cli import main
from ragline.flows.errors import EX_USAGE
from ragline.flows.resources import clear_cache
from tests.helpers.collections import collections_yaml, write_files

pytestmark = pytest.mark.integration

PIPELINES = collections_yaml("  handbook: {paths: [handbook]}\n  papers:   {paths: [papers]}\n", """
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 10}}
      - {id: sparse, task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 10}}
""")


def test_index_every_collection_then_search_one(tmp_path, capsys):
    write_files(tmp_path, {"handbook/vacation.md": "# Vacation\n\nThe vacation policy grants 25 days.\n",
                           "papers/results.md": "# Results\n\nThe experiment shows a 12 percent gain.\n"})
    project = tmp_path / "pipelines.yaml"
    project.write_text(PIPELINES)
    try:
        assert main(["validate", str(project)]) == 0
        assert "collections: handbook (index@handbook), papers (index@papers)" in capsys.readouterr().out
        assert main(["index", "-f", str(project), "--no-prefect"]) == 0
        out = capsys.readouterr().out
        assert "index@handbook: " in out and "index@papers: " in out

        assert main(["index", "-f", str(project), "--no-prefect", "--collection", "memos"]) == EX_USAGE
        assert "no collection 'memos'" in capsys.readouterr().err

        assert main(["search", "vacation experiment", "-f", str(project), "--json", "--collection", "papers"]) == 0
        passages = json.loads(capsys.readouterr().out)
        assert passages and {(p["metadata"]["collection"], p["source_id"].split("/")[0]) for p in passages} == \
            {("papers", "papers")}

        assert main(["search", "vacation", "-f", str(project), "-k", "1"]) == 0
        assert "handbook/vacation.md (handbook)" in capsys.readouterr().out

        assert main(["quickstart", "-f", str(project), "--no-start-llm"]) == EX_USAGE  # which one to index?
        assert "--collection (handbook, papers)" in capsys.readouterr().err
    finally:
        clear_cache()
