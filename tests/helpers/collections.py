"""Projects with named collections, shared by the collections tests (integration/test_cli_collections.py,
tasks/test_collection_stages.py, integration/api/test_collections_http.py, flows/serve/test_mcp.py): one template ingestion
pipeline that a `collections:` block compiles into `index@<name>` per collection, the files on disk,
and each collection indexed by its own pipeline."""
from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragline.flows.run import engine
from ragline.flows.serve.auth.keys import KeyStore, keys_file
from ragline.flows.spec.compile import load_project
from tests.helpers.data import BASE_RESOURCES, REPO

# Two collections of a company's documents: a handbook and research papers (chunked finer), four files
HANDBOOK_AND_PAPERS = "  handbook: {paths: [handbook]}\n  papers:   {paths: [papers], steps: {chunk: {size: 40}}}\n"
HANDBOOK_AND_PAPERS_FILES = {
    "handbook/vacation.md": "# Vacation\n\nEmployees take 25 vacation days a year; the vacation policy allows "
                            "carrying five days over.\n",
    "handbook/security.md": "# Security\n\nLaptops lock after five minutes; badges open the office doors.\n",
    "papers/results.md": "# Results\n\nThe experiment results show a 12 percent gain over the baseline in every "
                         "trial.\n",
    "papers/method.md": "# Method\n\nThe experiment used three cohorts and a held-out validation set.\n",
}

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


def handbook_and_papers(folder: Path, queries: str, llm_url: str, timeout_seconds: int) -> Path:
    """The two collections' files, the repository's prompts and a pipelines.yaml with ``queries`` and
    an LLM at ``llm_url``, each collection indexed: the served tests' project (its pipelines.yaml)."""
    write_files(folder, HANDBOOK_AND_PAPERS_FILES)
    shutil.copytree(REPO / "prompts", folder / "prompts")
    path = folder / "pipelines.yaml"
    path.write_text(collections_yaml(HANDBOOK_AND_PAPERS, queries,
                                     llm=scripted_llm(llm_url, timeout_seconds=timeout_seconds)))
    index_collections(path, {"handbook": 2, "papers": 2})
    return path


def handbook_keys(project: Path) -> dict[str, str]:
    """Two API keys of the project: ``all`` may query every collection, ``handbook`` only that one."""
    store = KeyStore(keys_file(project.parent))
    return {"all": store.create("all", ["query"], ["*"])[1],
            "handbook": store.create("handbook-only", ["query"], ["handbook"])[1]}


@contextlib.contextmanager
def served_with_query_log(project: Path) -> Iterator[str]:
    """The project's API served (real uvicorn) with the query log on; yields its URL."""
    from ragline.flows.serve.supervise.service import api_app
    from tests.helpers.api_harness import running

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGLINE_QUERY_LOG", "1")
        with running(api_app(project)) as url:
            yield url
