"""The roles a store plays, as protocols: what stages, the engine and the server may ask of a dense
vector store (Chroma, Milvus), a keyword index (BM25, Milvus) and the index state (SQLite,
PostgreSQL). Stages annotate these, not a backend's class, so a backend is anything that plays the
role; ``tests/flows/resources/stores/test_store_conformance.py`` runs the same cases against every
implementation (issue 37.1).

The index state's role is ``state.IndexState`` itself: the PostgreSQL state subclasses the SQLite one
and ``tests/flows/resources/stores/test_state.py`` runs its cases on both. Community summaries are a
role of their own (``SummaryStore``) that the state hands out (``IndexState.summaries()``): a file
beside SQLite's, rows of PostgreSQL's meta table, so each collection has its own
(``tests/flows/resources/stores/test_summaries.py`` runs the same cases on both).

Contracts every implementation keeps (the conformance cases check them):
- ids are chunk ids; ``upsert`` of an id already there replaces it (no duplicate), ``delete`` of an
  absent id is no error;
- ``where`` is the Chroma-style filter of ``resources.filters`` (``$and``, ``$or``, ``$eq``, ``$ne``,
  ``$in``, ``$nin``, ``$gt``...), applied before ``k``: a filtered query returns up to ``k`` matching
  chunks, best first;
- reads never write (a query path never changes a store).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ragline.flows.contracts import Chunk, Passage, SummaryReport

if TYPE_CHECKING:
    from ragline.flows.resources.stores.state import IndexState


@runtime_checkable
class DenseStore(Protocol):
    """Vectors, text and metadata of chunks, searched by vector similarity."""

    @property
    def location(self) -> str:
        """Where it lives, for messages (a path or a server URL; never a secret)."""

    def upsert(self, chunks: list[Chunk]) -> None:
        """Write chunks with their embeddings (an id already there is replaced)."""

    def delete(self, ids: Iterable[str]) -> None:
        """Remove these chunks (absent ids are ignored)."""

    def query(self, embeddings: np.ndarray, k: int, where: dict[str, Any] | None = None,
              retriever: str = "dense") -> list[list[Passage]]:
        """The ``k`` most similar chunks per query vector that match ``where``, best first."""

    def count(self) -> int:
        """How many chunks it holds."""

    def present(self, ids: list[str]) -> set[str]:
        """Which of these ids it holds."""

    def all_ids(self) -> set[str]:
        """Every chunk id it holds (none when nothing was written yet)."""

    def vectors(self, ids: list[str]) -> dict[str, np.ndarray]:
        """The stored embeddings of these chunks (absent ids left out)."""

    def score(self, query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        """The score ``query`` gives ``vectors``, on the scale ``query``'s passages carry."""

    def metadatas(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored metadata of these chunks (absent ids left out)."""

    def update_metadata(self, metadatas: dict[str, dict[str, Any]]) -> None:
        """Change stored chunks' metadata in place (vectors and text kept); keys given replace theirs."""

    def stored_embedder(self) -> str | None:
        """The key of the embedder whose vectors it holds (None: not recorded)."""

    def record_embedder(self, key: str, model: str) -> None:
        """Name the embedder whose vectors it holds."""

    def check_embedder(self, key: str, model: str) -> None:
        """Refuse (``EmbedderMismatch``) to compare ``model``'s vectors with another embedder's."""

    def reset(self) -> None:
        """Drop every chunk (the embedder, hence the dimension, changed)."""


@runtime_checkable
class SparseIndex(Protocol):
    """Chunks' text searched by keywords (BM25), published as versions the index state names."""

    @property
    def location(self) -> str:
        """Where it lives, for messages."""

    @property
    def settings(self) -> str:
        """What a published version must have been built with (a change means a rebuild)."""

    def search(self, texts: list[str], k: int, where: dict[str, Any] | None = None,
               ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """Top-``k`` (chunk id, score, metadata with text) per query text that match ``where``."""

    def search_weighted(self, queries: list[dict[str, float]], k: int, where: dict[str, Any] | None = None,
                        ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """``search`` for weighted term queries already in this index's terms (``terms``)."""

    def terms(self, texts: list[str]) -> list[list[str]]:
        """Texts split as this index splits them (its stemmer and stop words)."""

    def document_frequencies(self, terms: Iterable[str]) -> tuple[dict[str, int], int]:
        """How many published chunks hold each term (absent terms left out), and the chunk count."""

    def count(self, where: dict[str, Any] | None) -> int:
        """How many published chunks match ``where`` (all when None)."""

    def published_ids(self) -> list[str]:
        """The chunk ids of the published version."""

    def published_version(self) -> dict[str, Any] | None:
        """The published version's record (generation, settings, count), None before the first."""

    def problem(self, state: IndexState | None = None) -> str | None:
        """Why the published version cannot be searched as ``state`` says it should, or None."""

    def sync(self, state: IndexState, on_rebuild: Callable[[], None] | None = None, force: bool = False) -> bool:
        """Publish the state's generation when it lags (whole with ``force``); True if it published.
        Writers only."""


@runtime_checkable
class SummaryStore(Protocol):
    """The community summaries of one index (GraphRAG-style), published whole by the summarize job
    and read by ``retrieve_summaries``: a reader sees the previous set or the new one, never a mix."""

    @property
    def location(self) -> str:
        """Where they live, for reports and messages (never a password)."""

    def load(self) -> SummaryReport | None:
        """The published summaries (None: never built); a damaged set says so with its location."""

    def publish(self, report: SummaryReport) -> SummaryReport:
        """Replace the published summaries with ``report`` in one step; the report says where."""


ROLES: dict[str, type] = {"dense": DenseStore, "sparse": SparseIndex}
