"""ChromaDB vector store: embedded PersistentClient by default, HttpClient when a host is set."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from flows.contracts import Chunk, Passage


class ChromaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["chroma"]
    path: str = Field(".ragline/chroma", description="folder of the embedded store (ignored with host)")
    host: str | None = Field(None, description="Chroma server host; set to use HttpClient")
    port: int = Field(8000, ge=1, le=65535)
    ssl: bool = False
    collection: str = Field("ragline", min_length=3, max_length=512)
    space: Literal["cosine", "l2", "ip"] = Field("cosine", description="distance; fixed at creation")
    # Measured on SciFact embeddings (bench/hnsw_recall.py): these keep recall@10 >= 0.99.
    ef_construction: int = Field(200, ge=10, description="HNSW build breadth; fixed at creation")
    max_neighbors: int = Field(32, ge=4, le=128, description="HNSW M; fixed at creation")
    ef_search: int = Field(200, ge=10, description="HNSW search breadth (recall vs latency)")
    write_batch_size: int = Field(4096, ge=1, le=40_000, description="vectors per add call")


class ChromaStore:
    """One collection. The client is created lazily and shared (Chroma clients are thread-safe)."""

    def __init__(self, spec: ChromaSpec, base_dir: Path | None = None):
        self.spec = spec
        self.base_dir = base_dir or Path.cwd()
        self._collection = None
        self._client = None
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        if self.spec.host:
            return f"chroma http://{self.spec.host}:{self.spec.port} collection {self.spec.collection}"
        return f"chroma {self.path} collection {self.spec.collection}"

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    @property
    def client(self):
        if self._client is None:
            import chromadb
            from chromadb.config import Settings

            settings = Settings(anonymized_telemetry=False, allow_reset=False)
            if self.spec.host:
                self._client = chromadb.HttpClient(host=self.spec.host, port=self.spec.port,
                                                   ssl=self.spec.ssl, settings=settings)
            else:
                self.path.mkdir(parents=True, exist_ok=True)
                self._client = chromadb.PersistentClient(path=str(self.path), settings=settings)
        return self._client

    @property
    def collection(self):
        with self._lock:
            if self._collection is None:
                self._collection = self.client.get_or_create_collection(
                    self.spec.collection, embedding_function=None, configuration=self._configuration())
        return self._collection

    def _configuration(self) -> dict[str, Any]:
        return {"hnsw": {"space": self.spec.space, "ef_construction": self.spec.ef_construction,
                         "max_neighbors": self.spec.max_neighbors, "ef_search": self.spec.ef_search}}

    def reset(self) -> None:
        """Drop the collection (used when the embedding model, hence the dimension, changes)."""
        with self._lock:
            try:
                self.client.delete_collection(self.spec.collection)
            except Exception:  # noqa: BLE001 - absent collection is fine
                pass
            self._collection = None

    def count(self) -> int:
        return self.collection.count()

    def all_ids(self) -> set[str]:
        ids: set[str] = set()
        offset, page = 0, 20_000
        while True:
            got = self.collection.get(include=[], limit=page, offset=offset)["ids"]
            ids.update(got)
            if len(got) < page:
                return ids
            offset += page

    def _batch_size(self) -> int:
        """write_batch_size, capped at what the client accepts per call (5461 for embedded Chroma)."""
        limit = self.client.get_max_batch_size()
        return min(self.spec.write_batch_size, limit) if limit > 0 else self.spec.write_batch_size

    def upsert(self, chunks: list[Chunk]) -> None:
        size = self._batch_size()
        for start in range(0, len(chunks), size):
            batch = chunks[start:start + size]
            self.collection.upsert(
                ids=[c.chunk_id for c in batch],
                embeddings=np.asarray([c.embedding for c in batch], dtype=np.float32),
                documents=[c.text for c in batch],
                metadatas=[chroma_metadata(c) for c in batch],
            )

    def delete(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        size = self._batch_size()
        for start in range(0, len(ids), size):
            self.collection.delete(ids=ids[start:start + size])

    def query(self, embeddings: np.ndarray, k: int, where: dict[str, Any] | None = None,
              retriever: str = "dense") -> list[list[Passage]]:
        if self.count() == 0:
            return [[] for _ in range(len(embeddings))]
        result = self.collection.query(query_embeddings=np.asarray(embeddings, dtype=np.float32),
                                       n_results=k, where=where or None,
                                       include=["documents", "metadatas", "distances"])
        return [
            [_passage(cid, doc, meta, dist, self.spec.space, retriever)
             for cid, doc, meta, dist in zip(ids, docs, metas, dists)]
            for ids, docs, metas, dists in zip(result["ids"], result["documents"],
                                               result["metadatas"], result["distances"])
        ]


RESERVED_META = ("source_id", "title", "ordinal")


def chroma_metadata(chunk: Chunk) -> dict[str, Any]:
    meta = {k: v for k, v in chunk.metadata.items() if v is not None and k not in RESERVED_META}
    meta.update(source_id=chunk.source_id, title=chunk.title, ordinal=chunk.ordinal)
    return meta


def _passage(cid: str, text: str, meta: dict[str, Any], distance: float, space: str, retriever: str) -> Passage:
    meta = dict(meta or {})
    score = 1.0 - distance if space in ("cosine", "ip") else -distance
    return Passage(chunk_id=cid, source_id=str(meta.pop("source_id", "")), title=str(meta.pop("title", "")),
                   text=text or "", score=float(score), retriever=retriever,
                   metadata={k: v for k, v in meta.items() if k != "ordinal"})
