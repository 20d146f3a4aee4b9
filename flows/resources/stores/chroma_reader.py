"""Reading an embedded Chroma folder through Chroma's own engine without importing the ``chromadb``
Python package (issue 38.1). ``chromadb.PersistentClient`` runs the engine in-process through the
Rust module ``chromadb_rust_bindings`` (shipped in the chromadb wheel; ``chromadb.api.rust`` is its
Python shim); importing that module takes ~0.02 s, importing the package ~0.75 s on 2 cores (every
embedding function it knows, httpx, jsonschema, OpenTelemetry's gRPC exporter): a third of a cold
``ragline search``.

``open_reader`` opens a private reading copy (``read_snapshot``) the way the shim does, except that
the SQLite schema is validated, never migrated, since a query writes nothing. The collection it hands
out answers the calls a reader makes (``get``, ``query``, ``count``, ``metadata``) with what the
client's collection returns for them: the same engine calls, the same result dicts, errors raised as
Chroma's own (the engine raises ``chromadb.errors`` classes, importing them on its first error).
``ReaderUnsupported`` where that is not possible here: the bindings missing or not the shape this
module calls (another Chroma release), or a store whose schema needs a migration; the caller then
opens the copy with ``chromadb.PersistentClient``. Equality with the client is checked by
tests/flows/resources/stores/test_chroma_reader.py on a real store."""
from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import numpy as np

from ragline.flows.errors import RaglineError

TENANT, DATABASE = "default_tenant", "default_database"  # chromadb.config's DEFAULT_TENANT, DEFAULT_DATABASE
GET_INCLUDE = ["metadatas", "documents"]  # the client's defaults (IncludeMetadataDocuments...)
QUERY_INCLUDE = ["metadatas", "documents", "distances"]


class ReaderUnsupported(RaglineError):
    """Why this folder is read with ``chromadb.PersistentClient`` instead (the message says)."""


def open_reader(folder: Path) -> Reader:
    """The engine over ``folder`` (a reading copy), or ``ReaderUnsupported`` saying why not."""
    try:
        import chromadb_rust_bindings as rust
    except ImportError as exc:
        raise ReaderUnsupported(f"chromadb_rust_bindings does not import ({exc})") from exc
    try:
        config = rust.SqliteDBConfig(hash_type=rust.MigrationHash.MD5, migration_mode=rust.MigrationMode.Validate,
                                     url=str(folder / "chroma.sqlite3"))
        # As the shim sizes it: each HNSW index holds 5 files open.
        cache = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 5
        bindings = rust.Bindings(allow_reset=False, sqlite_db_config=config, hnsw_cache_size=cache,
                                 persist_path=str(folder))
    except (AttributeError, TypeError) as exc:
        raise ReaderUnsupported(f"chromadb_rust_bindings is not the release this reader calls ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the schema needs a migration: the client applies it
        raise ReaderUnsupported(f"the engine did not open {folder} read-only ({type(exc).__name__}: {exc})") from exc
    return Reader(bindings)


class Reader:
    """A client's reading calls, over one engine (thread-safe, as the client that shares it)."""

    def __init__(self, bindings: Any):
        self._bindings = bindings

    def get_collection(self, name: str, embedding_function: Any = None) -> ReadingCollection:
        """The collection (``chromadb.errors.NotFoundError`` if there is none, as the client raises)."""
        model = self._bindings.get_collection(name, TENANT, DATABASE)
        return ReadingCollection(self._bindings, str(model.id), model.name, model.metadata, model.configuration)

    def get_max_batch_size(self) -> int:
        return self._bindings.get_max_batch_size()

    def close(self) -> None:
        """The engine closes its files when the last reference goes (the shim's ``stop`` deletes it too)."""
        self._bindings = None


class ReadingCollection:
    """One collection's reads, returning what ``chromadb.Collection`` returns for them."""

    def __init__(self, bindings: Any, collection_id: str, name: str, metadata: dict[str, Any] | None,
                 configuration: dict[str, Any] | None):
        self._bindings, self.id, self.name = bindings, collection_id, name
        self.metadata, self.configuration = metadata, configuration

    def count(self) -> int:
        return self._bindings.count(self.id, TENANT, DATABASE)

    def get(self, ids: list[str] | None = None, where: dict[str, Any] | None = None, limit: int | None = None,
            offset: int | None = None, include: list[str] | None = None) -> dict[str, Any]:
        include = list(GET_INCLUDE if include is None else include)
        got = self._bindings.get(self.id, ids, _json(where), limit, offset or 0, None, include, TENANT, DATABASE)
        return {"ids": got.ids, "embeddings": np.array(got.embeddings) if "embeddings" in include else got.embeddings,
                "documents": got.documents, "uris": None, "data": None, "metadatas": got.metadatas,
                "included": include}

    def query(self, query_embeddings: Any, n_results: int = 10, where: dict[str, Any] | None = None,
              include: list[str] | None = None) -> dict[str, Any]:
        include = list(QUERY_INCLUDE if include is None else include)
        vectors = [np.asarray(v, dtype=np.float32) for v in query_embeddings]
        got = self._bindings.query(self.id, None, vectors, n_results, _json(where), None, include, TENANT, DATABASE)
        embeddings = got.embeddings
        if "embeddings" in include and embeddings is not None:
            embeddings = [np.array(rows) for rows in embeddings]
        return {"ids": got.ids, "embeddings": embeddings, "documents": got.documents, "uris": None, "data": None,
                "metadatas": got.metadatas, "distances": got.distances, "included": include}


def _json(where: dict[str, Any] | None) -> str | None:
    return json.dumps(where) if where else None
