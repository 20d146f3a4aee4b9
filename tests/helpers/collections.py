"""Projects with named collections, shared by the collections tests (integration/test_cli_collections.py,
tasks/test_collection_stages.py, integration/api/test_collections_http.py): one template ingestion
pipeline that a `collections:` block compiles into `index@<name>` per collection, the files on disk,
and each collection indexed by its own pipeline."""
from __future__ import annotations

import json
from pathlib import Path

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.data import BASE_RESOURCES

TEMPLATE_INDEX = """
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [unused]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: CHUNK_SIZE, overlap: 0}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
"""


def collections_yaml(collections: str, queries: str, chunk_size: int = 48, llm: str | None = None) -> str:
    """pipelines.yaml text: the base resources (plus an `llm:` resource whose flow mapping is ``llm``,
    without braces), the `collections:` block, the template index pipeline and the query pipelines."""
    resources = BASE_RESOURCES if llm is None else BASE_RESOURCES.replace("resources:\n", f"resources:\n  llm: {{{llm}}}\n", 1)
    return (resources + "collections:\n" + collections + "pipelines:"
            + TEMPLATE_INDEX.replace("CHUNK_SIZE", str(chunk_size)) + queries)


def scripted_llm(base_url: str, **options) -> str:
    """The `llm:` mapping of an openai_compatible endpoint (the scripted server), without retries."""
    extra = "".join(f", {key}: {value}" for key, value in options.items())
    return f"type: openai_compatible, base_url: {json.dumps(base_url)}, max_retries: 0{extra}"


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def index_collections(path: Path, added: dict[str, int], **load_options):
    """Each collection indexed in process by its own pipeline, each adding ``added[name]`` documents;
    the compiled project."""
    compiled = load_project(path, **load_options)
    for name, count in added.items():
        assert engine.run(compiled.pipeline(f"index@{name}"), orchestrate=False).added == count, name
    return compiled
