"""An access site for the document-access tests (integration/test_access.py, and over HTTP
integration/test_access_paths.py and integration/api/test_access_http.py): one folder per group under docs/ (each folder's notes say a
word only they say), loaded as root `kb` with per-prefix access rules, indexed with real embeddings,
Chroma and BM25, and a scripted LLM that cites what it is given."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import Script
from tests.helpers.data import BASE_RESOURCES, REPO
from tests.scripted_llm import ScriptedLLM

# The resources, with the LLM at LLM_URL; then the ingestion of docs/ as root `kb` with the rules ACCESS.
RESOURCES = BASE_RESOURCES.replace("resources:\n", "resources:\n  llm: {type: openai_compatible, base_url: LLM_URL, "
                                                   "max_retries: 0, timeout_seconds: 10}\n", 1)
INDEX = """
pipelines:
  index:
    kind: ingestion
    steps:
      - id: load
        task: load
        with:
          paths:
            - path: docs
              name: kb
              access: ACCESS
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: CHUNK_SIZE, overlap: 0}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
"""


def site_yaml(access: str, queries: str, chunk_size: int = 48) -> str:
    """pipelines.yaml text with LLM_URL still to fill: the resources, the ingestion (chunks of
    ``chunk_size`` tokens) with the access rules ``access`` (a YAML flow list) and the query
    pipelines ``queries``."""
    return RESOURCES + INDEX.replace("ACCESS", access).replace("CHUNK_SIZE", str(chunk_size)) + queries


@contextmanager
def citing_llm() -> Iterator[ScriptedLLM]:
    """The scripted LLM, answering with citations of the first two documents it was given."""
    script = Script()
    script.answer = "It is in the notes [1] and [2]."
    with ScriptedLLM(script, chunk_delay=0.001) as server:
        yield server


def write_notes(folder: Path, words: dict[str, str], notes: int, text: Callable[[str, int, str], str]) -> None:
    """docs/<name>/note<n>.md for each folder name and its word, ``text(name, n, word)`` each, and the
    repository's prompts."""
    for name, word in words.items():
        for number in range(notes):
            path = folder / "docs" / name / f"note{number}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text(name, number, word))
    shutil.copytree(REPO / "prompts", folder / "prompts")


def write_pipelines(folder: Path, text: str, llm_url: str) -> Path:
    path = folder / "pipelines.yaml"
    path.write_text(text.replace("LLM_URL", json.dumps(llm_url)))
    return path


def index_site(path: Path, added: int) -> Path:
    """The site indexed in process (every note added)."""
    assert engine.run(load_project(path).pipeline("index"), orchestrate=False).added == added
    return path


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}
