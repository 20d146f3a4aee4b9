"""ChromaDB vector store: embedded PersistentClient by default, HttpClient when a host is set.

Both modes behave the same. An embedded process that has only read opens a private copy of the
folder (``read_snapshot``: embedded Chroma writes its files whenever a process opens them), so a
query never writes the store; its first write switches it to the folder itself. Against a server every Chroma call retries transient connection
failures (server restarting, connection reset, timeout) with exponential backoff until
``retries`` or ``retry_max_seconds`` runs out, then raises ``ChromaUnavailable`` naming the
server. In both modes a cached collection handle that went stale (the collection was dropped
or recreated elsewhere) is re-opened once. Every call is idempotent, so a retry is safe.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.contracts import Chunk, Passage
from ragline.flows.errors import DependencyUnavailable, IndexUnavailable
from ragline.flows.resources.stores import chroma_reader, read_snapshot
from ragline.flows.resources.base import Health, Lazy, Resource
from ragline.flows.resources.stores.store_owner import Owned
from ragline.flows.resources.stores.state import REMEDY, StoreMissing, disk_fault, store_health

log = logging.getLogger("ragline.chroma")
T = TypeVar("T")

_BACKOFF_FIRST_SECONDS = 0.25  # first wait; doubles each retry, with up to 20% jitter
_BACKOFF_MAX_SECONDS = 5.0  # cap on one wait, so a server back after an outage is noticed quickly
_LOCKED_ATTEMPTS = 6  # an embedded call refused by SQLite's lock: ~3 s of waits in all
_TOKEN_PROVIDER = "chromadb.auth.token_authn.TokenAuthClientProvider"


def _is_locked(exc: BaseException) -> bool:
    """SQLite's SQLITE_BUSY as Chroma's Rust engine reports it (``(code: 5) database is locked``)."""
    return "database is locked" in str(exc)


def space_scores(space: str, query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The score ``query`` gives each of ``vectors`` in a distance ``space`` (l2, ip, cosine), higher
    is closer: what a store's passages carry, for stages that re-score vectors they fetched."""
    query, vectors = np.asarray(query, dtype=np.float32), np.asarray(vectors, dtype=np.float32)
    if space == "l2":
        return -((vectors - query) ** 2).sum(axis=-1)
    if space == "ip":
        return vectors @ query
    norms = np.linalg.norm(vectors, axis=-1) * max(float(np.linalg.norm(query)), 1e-12)
    return (vectors @ query) / np.maximum(norms, 1e-12)


class ChromaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["chroma"]
    path: str = Field(".ragline/chroma", description="folder of the embedded store (ignored with host)")
    host: str | None = Field(None, description="Chroma server host; set to use HttpClient")
    port: int = Field(8000, ge=1, le=65535, description="Chroma server port")
    ssl: bool = Field(False, description="https to the server")
    auth_token_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the server's auth token (the token stays out of the config)")
    auth_header: Literal["Authorization", "X-Chroma-Token"] = Field(
        "Authorization", description="header that carries the token (Authorization sends 'Bearer <token>')")
    retries: int = Field(6, ge=0, le=100, description="retries of a server call that failed to connect")
    retry_max_seconds: float = Field(30.0, gt=0, le=3600, description="give up retrying one call after this long")
    timeout_seconds: float = Field(120.0, gt=0, le=3600,
                                   description="per HTTP request; Chroma's own client would wait forever")
    collection: str = Field("ragline", min_length=3, max_length=512)
    space: Literal["cosine", "l2", "ip"] = Field("cosine", description="distance; fixed at creation")
    # Measured on SciFact embeddings (bench/hnsw_recall.py): these keep recall@10 >= 0.99.
    ef_construction: int = Field(200, ge=10, description="HNSW build breadth; fixed at creation")
    max_neighbors: int = Field(32, ge=4, le=128, description="HNSW M; fixed at creation")
    ef_search: int = Field(200, ge=10, description="HNSW search breadth (recall vs latency)")
    write_batch_size: int = Field(4096, ge=1, le=40_000, description="vectors per add call")
    sync_threshold: int = Field(
        100, ge=100, le=100_000,
        description="HNSW: vectors added between two saves of the index to disk. A process opening an embedded "
                    "store first re-applies up to this many unsaved ones (~4 ms each on 2 cores; Chroma's default "
                    "1,000 cost every ingestion run and API start up to 4 s); saving every 100 cost nothing "
                    "measurable at ingestion")


class ChromaUnavailable(DependencyUnavailable):
    """The Chroma server did not answer within the retry budget; the message names it."""

    dependency = "chroma"


class EmbedderMismatch(IndexUnavailable):
    """The collection's vectors were made by another embedder than the one asked to search them
    (the model changed, e.g. pointed at an adapted one, and ingestion has not re-embedded yet)."""

    error_code = "index_needs_reembedding"


# Collection metadata naming the embedder whose vectors it holds (EmbedderSpec.vectors_key).
EMBEDDER_KEY, EMBEDDER_MODEL = "ragline:embedder", "ragline:embedder_model"


def is_transient(exc: BaseException | None) -> bool:
    """A failure to reach the server (worth retrying), as opposed to a request it refused."""
    import httpx
    from chromadb.errors import RateLimitError

    network = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError, RateLimitError)
    if isinstance(exc, network):
        return True
    # Client construction re-raises network errors as ValueError("Could not connect to a Chroma server...").
    return isinstance(exc, ValueError) and isinstance(exc.__context__, network)


@dataclass(eq=False)
class _Copy:
    """A private reading copy, while reads are in flight on it: its client, once retired (stale), is
    closed by the last of them."""

    folder: Path
    mark: tuple
    reads: int = 0
    client: Any = None


class ChromaStore(Owned, Resource):
    """One collection. The client is created lazily and shared (Chroma clients are thread-safe)."""

    preload = ("chromadb",)

    Spec = ChromaSpec
    located = True

    def __init__(self, spec: ChromaSpec, base_dir: Path | None = None):
        super().__init__(spec, base_dir)
        self._collection = None
        self._writable = False  # the cached handle was opened by a writer (created if absent, aligned)
        self._lock = threading.RLock()
        self._client = Lazy(self._new_client, self._lock)
        self._max_batch: int | None = None
        self._writes = False  # this process has written (or means to): the client opens the folder itself
        self._snapshot: Path | None = None  # the private copy a reading client opened instead
        self._copies: list[_Copy] = []  # the current copy (last) and stale ones with reads still in flight

    @property
    def server(self) -> str | None:
        """The server's URL in server mode (configured, or the managed one that owns the embedded
        folder), else None."""
        if self.spec.host:
            return f"{'https' if self.spec.ssl else 'http'}://{self.spec.host}:{self.spec.port}"
        return self._owner.url if self._owner is not None else None

    @property
    def location(self) -> str:
        if self.spec.host:
            where = f"server {self.server}"
        elif self._owner is not None:
            where = f"{self.path} (served by {self._owner.url})"
        else:
            where = str(self.path)
        return f"chroma {where} collection {self.spec.collection}"

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    # ------------------------------------------------------------------ connection
    @property
    def client(self):
        """The client that writes (embedded: over the folder itself, not a reader's copy)."""
        return self._retrying("connect", self._connect)

    @property
    def collection(self):
        """The collection for writing: created (and aligned) if absent."""
        return self._retrying("open the collection", self._open)

    @property
    def existing_collection(self):
        """The collection for reading: creates nothing (StoreMissing when there is no store or
        collection), as ``all_ids`` and the query paths read."""
        return self._retrying("open the collection", lambda: self._open(create=False))

    def _connect(self, write: bool = True):
        """The client; ``write=False`` (a read) lets an embedded one open a private copy. The first
        write drops a copy's client: from then on this process works on the folder itself."""
        with self._lock:
            if write and not self._writes:
                self._writes = True
                if self._snapshot is not None:
                    self._drop_client()
            return self._client.get()

    def _new_client(self):
        if self.spec.host or self._served_by() is not None:
            import chromadb

            host, port = (self.spec.host, self.spec.port) if self.spec.host else (self._owner.host, self._owner.port)
            client = chromadb.HttpClient(host=host, port=port, ssl=self.spec.ssl and bool(self.spec.host),
                                         settings=self._settings())
            _set_http_timeout(client, self.spec.timeout_seconds)
            return client
        folder = self.path if self._writes else self._reading_copy()
        folder.mkdir(parents=True, exist_ok=True)
        if not self._writes:  # a reading copy: Chroma's engine without its Python package, where it can
            try:
                return chroma_reader.open_reader(folder)
            except chroma_reader.ReaderUnsupported as why:
                log.debug("%s: reading with chromadb's client (%s)", self.location, why)
        import chromadb

        try:
            return chromadb.PersistentClient(path=str(folder), settings=self._settings())
        except Exception:
            _forget_system(str(folder))
            raise

    def _reading_copy(self) -> Path:
        """A private copy of the folder for a process that has not written (``read_snapshot``)."""
        if not (self.path / "chroma.sqlite3").is_file():
            raise StoreMissing(f"{self.location}: there is no store at {self.path}; {REMEDY}")
        started = time.perf_counter()
        mark = read_snapshot.mark(self.path)  # before the copy: a write during it retakes it at the next read
        self._snapshot = read_snapshot.take(self.path, self.location)
        self._copies.append(_Copy(self._snapshot, mark))
        log.debug("%s: reading a private copy at %s (%.2f s to copy)", self.location, self._snapshot,
                  time.perf_counter() - started)
        return self._snapshot

    def _drop_client(self) -> None:
        """Close the client and remove the copy it read (the lock held)."""
        self._copies = [copy for copy in self._copies if copy.folder != self._snapshot]
        self._collection = None
        client, snapshot = self._client.reset(), self._snapshot
        self._snapshot = None
        try:
            if client is not None:
                client.close()
        finally:
            if snapshot is not None:
                _forget_system(str(snapshot))
                read_snapshot.discard(snapshot)

    def _settings(self):
        """Telemetry off in both modes; a token goes through Chroma's own provider, read from the env."""
        from chromadb.config import Settings

        options: dict[str, Any] = {"anonymized_telemetry": False, "allow_reset": False}
        name = self.spec.auth_token_env
        if self.spec.host and name:  # (a managed server of an embedded folder has no token)
            token = os.environ.get(name)
            if not token:
                raise ValueError(f"{self.location}: environment variable {name} (the auth token) is not set")
            options.update(chroma_client_auth_provider=_TOKEN_PROVIDER, chroma_client_auth_credentials=token,
                           chroma_auth_token_transport_header=self.spec.auth_header)
        return Settings(**options)

    def _open(self, create: bool = True):
        """The collection; ``create=False`` (read paths) creates nothing: no store folder, no
        collection, StoreMissing naming them instead. A writer's handle is opened once (a handle a
        read opened is replaced by one at the first write) and aligned as it is opened."""
        with self._lock:
            if self._collection is None or (create and not self._writable):
                self._collection = self._writer_handle() if create else self._existing()
                self._writable = create
            return self._collection

    def _writer_handle(self):
        """The collection, created if absent, with ``sync_threshold`` set: a collection created with
        another one (Chroma's default of 1,000, before this option) is set to this one by its first
        writer (a reader changes nothing); Chroma allows it after creation, and the next process that
        opens the store uses it."""
        collection = self._connect().get_or_create_collection(
            self.spec.collection, embedding_function=None, configuration=self._configuration())
        saved = ((collection.configuration or {}).get("hnsw") or {}).get("sync_threshold")
        if saved is not None and saved != self.spec.sync_threshold:
            collection.modify(configuration={"hnsw": {"sync_threshold": self.spec.sync_threshold}})
        return collection

    def _existing(self):
        if not self.spec.host and not (self.path / "chroma.sqlite3").is_file():
            raise StoreMissing(f"{self.location}: there is no store at {self.path}; {REMEDY}")
        try:
            return self._connect(write=False).get_collection(self.spec.collection, embedding_function=None)
        except Exception as exc:
            if not _not_found(exc):
                raise
            raise StoreMissing(f"{self.location}: the collection does not exist; {REMEDY}") from exc

    def _configuration(self) -> dict[str, Any]:
        return {"hnsw": {"space": self.spec.space, "ef_construction": self.spec.ef_construction,
                         "max_neighbors": self.spec.max_neighbors, "ef_search": self.spec.ef_search,
                         "sync_threshold": self.spec.sync_threshold}}

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self) -> None:
        """Open the collection and search it once (Chroma loads its HNSW index on the first query).
        A store never written is left alone: a query path creates nothing."""
        if not self.spec.host and self._served_by() is None and not (self.path / "chroma.sqlite3").is_file():
            return
        try:
            sample = self._call("read one vector", lambda c: c.get(limit=1, include=["embeddings"]), create=False)
        except StoreMissing:
            return
        if len(sample["embeddings"]):
            self.query(np.asarray(sample["embeddings"][:1], dtype=np.float32), 1)

    def health(self, index_state: Any = None) -> Health:
        """Reachable, and holding as many vectors as ``index_state`` names chunks (when given).
        Read-only: nothing is created here."""
        return store_health(self.location, self.count, index_state, unit="vectors")

    def close(self) -> None:
        with self._lock:
            self._drop_client()
            self._close_retired()

    # ------------------------------------------------------------------ faults
    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``; against a server, retry connection failures with backoff up to the deadline."""
        if not self.spec.host and self._served_by() is None:
            return self._on_disk(what, lambda: self._unlocked(what, call))  # embedded: no connection to lose
        import tenacity

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_attempt(self.spec.retries + 1)
            | tenacity.stop_before_delay(self.spec.retry_max_seconds),
            wait=tenacity.wait_exponential_jitter(multiplier=_BACKOFF_FIRST_SECONDS, max=_BACKOFF_MAX_SECONDS,
                                                  jitter=_BACKOFF_FIRST_SECONDS / 5),
            before_sleep=lambda state: self._log_retry(what, state))
        started = time.monotonic()
        try:
            return retrying(call)
        except tenacity.RetryError as err:
            cause = err.last_attempt.exception()
            raise ChromaUnavailable(
                f"Chroma server {self.server} unreachable: {what} failed {err.last_attempt.attempt_number} times "
                f"in {time.monotonic() - started:.1f}s ({type(cause).__name__}: {cause}); is it running? "
                f"(retries={self.spec.retries}, retry_max_seconds={self.spec.retry_max_seconds})") from cause

    def _unlocked(self, what: str, call: Callable[[], T]) -> T:
        """Run an embedded call, again after SQLite's ``database is locked``. Why: Chroma keeps its
        metadata in SQLite without WAL, and a transaction that reads and then writes while another
        connection (its own pool's, or another process's) holds the write lock is refused at once,
        never waited for (SQLite's deadlock rule: its 1,000 s busy timeout does not apply); SQLite's
        remedy is to run the transaction again. Seen when a collection's first writer set its
        configuration just after another process had recreated it. Every call here is idempotent
        (upserts and deletes by id, reads)."""
        import tenacity

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_locked), stop=tenacity.stop_after_attempt(_LOCKED_ATTEMPTS),
            wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0, jitter=0.05),
            before_sleep=lambda state: log.warning("%s: %s found the database locked (attempt %d of %d); again",
                                                   self.location, what, state.attempt_number, _LOCKED_ATTEMPTS))
        try:
            return retrying(call)
        except tenacity.RetryError as err:
            raise IndexUnavailable(
                f"{self.location}: {what} found {self.path / 'chroma.sqlite3'} locked {_LOCKED_ATTEMPTS} times; "
                f"is another process writing this store? ({err.last_attempt.exception()})"
            ) from err.last_attempt.exception()

    def _on_disk(self, what: str, call: Callable[[], T]) -> T:
        """Run an embedded call; a full, read-only or forbidden disk becomes a StorageError naming
        the store's folder and the reason. Why: Chroma reports ENOSPC as ``Error in compaction:
        Failed to apply logs to the metadata segment`` or ``(code: 13) database or disk is full``
        and EROFS as ``attempt to write a readonly database``, never with the folder. The client
        is closed (Chroma stops its engine for the folder once no client uses it): the engine that
        failed a compaction sometimes hung on its next call, once the disk had room again (2 of 5
        runs), so the next call opens the store afresh."""
        try:
            return call()
        except Exception as exc:

            fault = disk_fault(exc, self.path, f"chroma {what} in")
            if fault is None:
                raise
            try:
                with self._lock:
                    self._drop_client()
            except Exception as close_error:  # noqa: BLE001 - the disk fault is the error to report
                log.warning("%s: could not close the client after %s: %s", self.location, what, close_error)
            raise fault from exc

    def _log_retry(self, what: str, state: Any) -> None:
        exc = state.outcome.exception()
        log.warning("Chroma server %s: %s failed (%s: %s); retry %d/%d in %.2fs", self.server, what,
                    type(exc).__name__, exc, state.attempt_number, self.spec.retries, state.upcoming_sleep)

    def _call(self, what: str, op: Callable[[Any], T], create: bool = True) -> T:
        """Apply ``op`` to the collection, with retries; re-open a stale handle once. Reads pass
        ``create=False``: a query never creates the store or its collection."""
        return self._retrying(what, lambda: self._fresh(what, op, create))

    def _fresh(self, what: str, op: Callable[[Any], T], create: bool = True) -> T:
        handle, reads = self._open_counted(create)
        try:
            try:
                return op(handle)
            except Exception as exc:
                if not _not_found(exc):
                    raise
                with self._lock:  # dropped or recreated by someone else: look it up again (by name)
                    if self._collection is handle:
                        self._collection = None
                log.warning("%s: collection handle went stale during %s; re-opening it", self.location, what)
                return op(self._open(create))
        finally:
            self._read_done(reads)

    def _open_counted(self, create: bool) -> tuple[Any, _Copy | None]:
        """The collection, and for a read on a private copy that copy, its read counted. A copy the
        folder has changed since (another process, or this one, wrote) is retired first: its client
        closes once its last read in flight ends, and this read opens a new copy."""
        with self._lock:
            current = self._current_copy()
            if not create and current is not None and read_snapshot.mark(self.path) != current.mark:
                log.debug("%s: the folder changed since its copy was taken; reading a new copy", self.location)
                current.client, self._collection, self._snapshot = self._client.reset(), None, None
            handle = self._open(create)
            current = self._current_copy()
            if current is not None:
                current.reads += 1
            return handle, current

    def _current_copy(self) -> _Copy | None:
        """The copy the client reads now (None: it reads the folder, or a server)."""
        return self._copies[-1] if self._copies and self._copies[-1].folder == self._snapshot else None

    def _read_done(self, copy: _Copy | None) -> None:
        if copy is not None:
            with self._lock:
                copy.reads -= 1
                self._close_retired()

    def _close_retired(self) -> None:
        """Close every retired copy no read uses any more (the lock held)."""
        for copy in [c for c in self._copies if c.folder != self._snapshot and c.reads <= 0]:
            self._copies.remove(copy)
            try:
                if copy.client is not None:
                    copy.client.close()
            except Exception as exc:  # noqa: BLE001 - a stale copy that will not close is only removed
                log.warning("%s: could not close a stale reading copy: %s", self.location, exc)
            finally:
                _forget_system(str(copy.folder))
                read_snapshot.discard(copy.folder)

    # ------------------------------------------------------------------ operations
    def reset(self) -> None:
        """Drop the collection (used when the embedding model, hence the dimension, changes)."""
        from chromadb.errors import NotFoundError

        def drop() -> None:
            try:
                self._connect().delete_collection(self.spec.collection)
            except NotFoundError:  # an absent collection is fine
                pass

        self._retrying("drop the collection", drop)
        with self._lock:
            self._collection = None

    def count(self) -> int:
        return self._call("count", lambda c: c.count(), create=False)

    def present(self, ids: list[str]) -> set[str]:
        """Which of these chunk ids the collection holds (the integrity check's sample)."""
        if not ids:
            return set()
        return set(self._call("get ids", lambda c: c.get(ids=ids, include=[])["ids"], create=False))

    def stored_embedder(self) -> str | None:
        """The embedder key the collection's vectors were made with (None: not recorded)."""
        meta = self.existing_collection.metadata or {}
        return meta.get(EMBEDDER_KEY)

    def record_embedder(self, key: str, model: str) -> None:
        """Name the embedder whose vectors the collection holds (written with its first vectors)."""
        meta = dict(self.collection.metadata or {})
        if meta.get(EMBEDDER_KEY) != key:
            meta.update({EMBEDDER_KEY: key, EMBEDDER_MODEL: model})
            self._call("record the embedder", lambda c: c.modify(metadata=meta))

    def check_embedder(self, key: str, model: str) -> None:
        """Refuse to compare ``model``'s vectors with vectors another embedder made: the scores
        would be meaningless, silently. A collection that names no embedder (written before this
        check existed) is trusted. The handle's metadata may predate a re-embedding by another
        process, so a mismatch is confirmed on a freshly opened handle."""
        stored = self.stored_embedder()
        if stored in (None, key):
            return
        with self._lock:
            self._collection = None
        meta = self.existing_collection.metadata or {}
        if meta.get(EMBEDDER_KEY) in (None, key):
            return
        raise EmbedderMismatch(
            f"{self.location}: the collection '{self.spec.collection}' holds vectors of embedder "
            f"{meta.get(EMBEDDER_MODEL)!r} (settings {meta.get(EMBEDDER_KEY)}), not of this pipeline's {model!r} "
            f"(settings {key}): run the ingestion pipeline (e.g. `ragline run index`) to re-embed, or point "
            f"the embedder back at the model the index was built with")

    def all_ids(self) -> set[str]:
        """Every chunk id the collection holds; none when there is no store or collection (as Milvus).
        Read-only: ``ragline check`` lists them, and a check creates nothing and changes no setting."""
        ids: set[str] = set()
        offset, page = 0, 20_000
        while True:
            try:
                got = self._call("list ids", lambda c: c.get(include=[], limit=page, offset=offset)["ids"],
                                 create=False)
            except StoreMissing:
                if offset:  # dropped while listed: a partial list would pass for the whole
                    raise
                return ids
            ids.update(got)
            if len(got) < page:
                return ids
            offset += page

    def vectors(self, ids: list[str]) -> dict[str, np.ndarray]:
        """The stored embeddings of these chunks (absent ids are left out)."""
        found: dict[str, np.ndarray] = {}
        for start in range(0, len(ids), 1000):
            batch = ids[start:start + 1000]
            got = self._call("get vectors", lambda c: c.get(ids=batch, include=["embeddings"]), create=False)
            found.update(zip(got["ids"], np.asarray(got["embeddings"], dtype=np.float32)))
        return found

    def score(self, query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        """The score ``query`` gives ``vectors`` as a query's passages carry it (see ``_passage``)."""
        return space_scores(self.spec.space, query, vectors)

    def _batch_size(self, write: bool = True) -> int:
        """write_batch_size, capped at what the client accepts per call (5461 for embedded Chroma)."""
        if self._max_batch is None:
            self._max_batch = self._retrying("read the batch limit",
                                             lambda: self._connect(write=write).get_max_batch_size())
        limit = self._max_batch
        return min(self.spec.write_batch_size, limit) if limit > 0 else self.spec.write_batch_size

    def upsert(self, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        size = self._batch_size()
        for start in range(0, len(chunks), size):
            batch = chunks[start:start + size]
            ids = [c.chunk_id for c in batch]
            embeddings = np.asarray([c.embedding for c in batch], dtype=np.float32)
            documents = [c.text for c in batch]
            metadatas = [chroma_metadata(c) for c in batch]
            self._call("upsert", lambda col: col.upsert(ids=ids, embeddings=embeddings, documents=documents,
                                                         metadatas=metadatas))

    def metadatas(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored metadata of these chunks (those present)."""
        out: dict[str, dict[str, Any]] = {}
        size = self._batch_size(write=False)
        for start in range(0, len(ids), size):
            batch = ids[start:start + size]
            got = self._call("get metadata", lambda c: c.get(ids=batch, include=["metadatas"]), create=False)
            out.update(zip(got["ids"], (m or {} for m in got["metadatas"])))
        return out

    def update_metadata(self, metadatas: dict[str, dict[str, Any]]) -> None:
        """Change stored chunks' metadata in place (vectors and text kept): Chroma merges the keys
        given into each chunk's metadata, and a key given as None is removed. A write: from here on
        this process works on the folder itself, not on a private reading copy (the update would be
        lost with the copy); the collection is still never created here."""
        ids = sorted(metadatas)
        if ids:
            self._retrying("connect", self._connect)
        size = self._batch_size()
        for start in range(0, len(ids), size):
            batch = ids[start:start + size]
            changes = [metadatas[i] for i in batch]
            self._call("update metadata", lambda col: col.update(ids=batch, metadatas=changes), create=False)

    def delete(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        if not ids:
            return
        size = self._batch_size()
        for start in range(0, len(ids), size):
            batch = ids[start:start + size]
            self._call("delete", lambda col: col.delete(ids=batch))

    def query(self, embeddings: np.ndarray, k: int, where: dict[str, Any] | None = None,
              retriever: str = "dense") -> list[list[Passage]]:
        """Top ``k`` per vector. No count() first: Chroma 1.5 returns fewer hits (or none) when k exceeds
        the collection, so an empty or small collection needs no extra round trip per query."""
        vectors = np.asarray(embeddings, dtype=np.float32)
        if len(vectors) == 0:
            return []
        result = self._call("query", lambda c: c.query(query_embeddings=vectors, n_results=k, where=where or None,
                                                       include=["documents", "metadatas", "distances"]),
                            create=False)
        return [  # equal distances by chunk id: HNSW's own order depends on the order of writes
            sorted((_passage(cid, doc, meta, dist, self.spec.space, retriever)
                    for cid, doc, meta, dist in zip(ids, docs, metas, dists)), key=lambda p: (-p.score, p.chunk_id))
            for ids, docs, metas, dists in zip(result["ids"], result["documents"],
                                               result["metadatas"], result["distances"])
        ]


def _not_found(exc: BaseException) -> bool:
    """Chroma's NotFoundError (from its client or its engine). Why not ``except NotFoundError``:
    importing ``chromadb.errors`` imports the whole ``chromadb`` package, which a reader through
    ``chroma_reader`` never needs; an exception of that class means its module is loaded."""
    errors = sys.modules.get("chromadb.errors")
    return errors is not None and isinstance(exc, errors.NotFoundError)


def _forget_system(path: str) -> None:
    """Drop Chroma's (1.5) cached engine for a folder no client uses. Chroma keeps the engine of a
    PersistentClient that failed to start (a read-only or full folder) in its per-folder cache,
    and every later client for that folder, in this process, gets the broken one ("'RustBindingsAPI'
    object has no attribute 'bindings'") even once the folder is writable again; and a removed
    reading copy's engine would stay cached for the life of the process. (Private attributes:
    skipped silently if a Chroma release renames them.)"""
    if "chromadb.api.shared_system_client" not in sys.modules:  # no client made here: nothing cached
        return
    try:
        from chromadb.api.shared_system_client import SharedSystemClient

        if not SharedSystemClient._identifier_to_refcount.get(path):
            SharedSystemClient._identifier_to_system.pop(path, None)
    except Exception:  # noqa: BLE001 - best effort, the original error is the one to report
        pass


def _set_http_timeout(client: Any, seconds: float) -> None:
    """Chroma's HttpClient sends with timeout=None; a hung server must not outlast the retry deadline.
    (Private attribute: skipped silently if a Chroma release renames it.)"""
    import httpx

    session = getattr(getattr(client, "_server", None), "_session", None)
    if isinstance(session, httpx.Client):
        session.timeout = httpx.Timeout(seconds, connect=min(seconds, 10.0))


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
