"""Resources: heavy shared objects (models, stores) configured in pipelines.yaml.

Each is created once per process (keyed by its configuration) and shared by every stage
that ``uses`` it; construction is cheap and the heavy part loads on first use. Also here: the
index state (``state``), store integrity (``integrity``), the managed-server record of a store
(``chroma_owner``), moving sources without re-embedding (``source_ids``) and parsing LLM output
(``llm_output``).

May import the base modules only (``contracts``, ``errors``, ``settings``, ``context``,
``failpoints``); every layer above may import it, stages included.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Field

from ragline.flows.resources.bm25 import BM25Index, BM25Spec
from ragline.flows.resources.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.cross_encoder import CrossEncoderModel, CrossEncoderSpec
from ragline.flows.resources.embedder import Embedder, EmbedderSpec
from ragline.flows.resources.llm import LLMClient, LLMSpec
from ragline.flows.resources.state import IndexState, StateSpec

_FACTORIES: dict[str, Any] = {
    "sentence_transformer": Embedder,
    "chroma": ChromaStore,
    "bm25": BM25Index,
    "index_state": IndexState,
    "openai_compatible": LLMClient,
    "cross_encoder": CrossEncoderModel,
}
_SPECS: list[Any] = [EmbedderSpec, ChromaSpec, BM25Spec, StateSpec, LLMSpec, CrossEncoderSpec]

ResourceSpec = Annotated[Union[tuple(_SPECS)], Field(discriminator="type")]  # type: ignore[valid-type]
RESOURCE_TYPES = tuple(_FACTORIES)

_cache: dict[tuple[str, str, str], Any] = {}
_lock = threading.Lock()


LOCATED_TYPES = frozenset({"chroma", "bm25", "index_state"})  # resources stored under the data folder


def get_resource(spec: Any, base_dir: Path) -> Any:
    """The process-wide instance for this configuration (created on first request). Models and
    clients are shared across data folders; stores are per folder."""
    key = (spec.type, spec.model_dump_json(), str(base_dir.resolve()) if spec.type in LOCATED_TYPES else "")
    with _lock:
        if key not in _cache:
            factory = _FACTORIES[spec.type]
            _cache[key] = factory(spec, base_dir)
        return _cache[key]


def clear_cache() -> None:
    """Forget every resource (tests use it to simulate a new process)."""
    with _lock:
        for res in _cache.values():
            close = getattr(res, "close", None)
            if close:
                close()
        _cache.clear()
    if "chromadb" in sys.modules:  # Chroma keeps one system per path; drop them too
        from chromadb.api.client import SharedSystemClient

        SharedSystemClient.clear_system_cache()
