"""Milvus: dense vectors, BM25 full-text search and metadata filters in one engine that scales out.

``uri`` is a local ``.db`` file (milvus-lite: the Milvus engine embedded, one process at a time; while
``ragline serve`` owns the file, every process reaches its managed engine over gRPC instead,
``flows/ops/milvus_server.py``) or a server (``http://host:19530``: Milvus standalone or a cluster, with
its own sharding and replication).
The same resource serves both index roles: ``store`` (the embedder's vectors, as Chroma) and
``sparse`` (BM25 computed by the engine from the chunk text at write time, as the ``bm25`` index):
name it for both in a pipeline and one engine answers hybrid queries. The incremental protocol is
unchanged: the index state (SQLite) is the truth, ingestion writes the store batch by batch and
``sync`` records the state's generation once the run's writes are in.

Why a hashed primary key: pymilvus's ``get``/``delete`` by id quote ids without escaping them, and a
Milvus string literal cannot hold a line break, so a chunk id (a path) could break or change the
expression. The key is the SHA-256 of the chunk id (hex); the id itself is a field. Every expression
is built here, every value escaped (``expression``); no caller's text reaches Milvus unescaped.

What milvus-lite (2.5) lacks, and what is done instead: no graph index (embedded mode searches
exactly, FLAT; a server builds ``index``), no collection properties (the embedder and the published
generation live in a small side collection ``<collection>_ragline``), no ``not`` (``$ne``/``$nin``
translate to ``!=``/``not in``, which Milvus already lets through for chunks without the key, as
``filters.matches`` does).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragline.flows import failpoints
from ragline.flows.access import ACL_PREFIX, GROUP_PATTERN, PUBLIC_KEY, groups_of
from ragline.flows.contracts import Chunk, Passage
from ragline.flows.errors import ConfigError, DependencyUnavailable, InputError
from ragline.flows.resources.stores import filters
from ragline.flows.resources.base import Health, Lazy, Resource
from ragline.flows.resources.stores.bm25 import tokenize
from ragline.flows.resources.stores.chroma import EmbedderMismatch, chroma_metadata, space_scores
from ragline.flows.resources.stores.state import REMEDY, IndexState, StoreMissing, store_health
from ragline.flows.resources.stores.store_owner import Owned

log = logging.getLogger("ragline.milvus")
T = TypeVar("T")

TEXT_BYTES = 65_535  # Milvus VARCHAR limit (bytes)
ID_PAGE = 1_000  # keys per `key in [...]` expression
WEIGHTED_DEPTH = 16_384  # hits per term of a weighted query (Milvus's largest search limit)
TERMS_FORMAT = 1  # how the `terms` field is written (analyzer ragline); a change rebuilds collections
META_SUFFIX = "_ragline"  # side collection: embedder key, published generation, BM25 settings, rebuild phase
COLUMN_PREFIX = "m_"  # a metadata key kept as a typed column too (``filter_fields``): ``m_<key>``
FILTER_FIELDS = ["source", "root", "file_name", "format"]  # the loader's provenance keys: on every document
ACCESS_FIELD = "access"  # ARRAY of the groups that may read a chunk, "*" when public (``_access_elements``);
# not indexed: milvus-lite indexes no array ("only int, varchar, float, double and bool fields support scalar index")
ACCESS_COLUMN = ACL_PREFIX  # how the access field is named among a collection's columns (no filter field can be)
ACCESS_CAPACITY = 4096  # groups a chunk's access field holds at most (Milvus's largest array)
PUBLIC_ELEMENT = "*"  # no group name has it (GROUP_PATTERN)
REBUILD_SUFFIX = "_rebuild"  # the rows while the collection is made again with other settings
REBUILD_PHASE = "rebuild"  # side-collection key: "restoring" while the rows come back from <name>_rebuild
PHASE_READ_SECONDS = 1.0  # a query process reads the rebuild phase again after this long
_METRIC = {"cosine": "COSINE", "ip": "IP", "l2": "L2"}


class MilvusSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["milvus"]
    uri: str = Field(".ragline/milvus.db", description="a local .db file (milvus-lite, relative to the data folder) "
                                                       "or a server, http(s)://host:19530")
    token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                  description="environment variable holding the server's token ('user:password' or "
                                              "an API key; the token stays out of the config)")
    database: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,254}$", description="server database")
    collection: str = Field("ragline", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,200}$",
                            description="letters, digits, '_' and '-' (a name Milvus refuses, e.g. with '-', is "
                                        "stored under a valid one derived from it)")
    space: Literal["cosine", "l2", "ip"] = Field("cosine", description="distance; fixed at creation")
    index: Literal["HNSW", "AUTOINDEX", "IVF_FLAT", "FLAT"] = Field(
        "HNSW", description="dense index on a server (milvus-lite always searches exactly: FLAT); fixed at creation")
    max_neighbors: int = Field(32, ge=4, le=128, description="HNSW M; fixed at creation")
    ef_construction: int = Field(200, ge=10, description="HNSW build breadth; fixed at creation")
    ef_search: int = Field(200, ge=10, description="HNSW search breadth (recall vs latency)")
    full_text: bool = Field(True, description="BM25 computed by Milvus from the chunk text (the `sparse` role)")
    analyzer: Literal["ragline", "english", "standard"] = Field(
        "ragline", description="BM25 terms: `ragline` splits, drops stop words and stems exactly as the bm25 index "
                               "(bm25s's tokenizer, PyStemmer) and Milvus indexes those terms, so BM25 ranks as the "
                               "bm25 index does; `english`/`standard` are Milvus's own analyzers on the raw text "
                               "(they keep one-letter tokens); fixed at creation")
    stemmer: Literal["english", "none"] = Field("english", description="Snowball stemmer (analyzer `ragline`, as the "
                                                                       "bm25 index's); fixed at creation")
    stopwords: Literal["en", "none"] = Field("en", description="stop words (analyzer `ragline`, as the bm25 "
                                                               "index's); fixed at creation")
    k1: float = Field(1.2, gt=0, le=3, description="BM25 k1 (as the bm25 index); fixed at creation")
    b: float = Field(0.75, ge=0, le=1, description="BM25 b; fixed at creation")

    @property
    def method(self) -> str:
        """The bm25s variant Milvus's BM25 ranks as (Lucene's idf and length normalisation), for the
        stages that score BM25 settings in memory (tune, adapt) as they do on a bm25 index."""
        return "lucene"
    filter_fields: list[str] = Field(
        default_factory=lambda: list(FILTER_FIELDS), max_length=16,
        description="metadata keys also kept as VARCHAR columns, so an equality or `$in`/`$nin` filter on them "
                    "reads a typed column instead of parsing every chunk's JSON metadata (milvus-lite indexes no JSON "
                    "path); set when the collection is created: a change rebuilds it from its own rows")
    write_batch_size: int = Field(1000, ge=1, le=10_000, description="chunks per upsert call")
    retries: int = Field(6, ge=0, le=100, description="retries of a server call that failed to connect")
    retry_max_seconds: float = Field(30.0, gt=0, le=3600, description="give up retrying one call after this long")
    timeout_seconds: float = Field(60.0, gt=0, le=3600, description="per call to the server")

    @property
    def host(self) -> str | None:
        """The server (None: embedded), read like ``ChromaSpec.host`` by integrity checks and messages."""
        return self.uri if is_server(self.uri) else None

    @field_validator("filter_fields")
    @classmethod
    def _column_names(cls, value: list[str]) -> list[str]:
        for key in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
                raise ValueError(f"{key!r}: a filter field is a metadata key of letters, digits and '_' (up to 64)")
            if key.startswith(ACL_PREFIX):
                raise ValueError(f"{key!r}: access is kept in its own field (every collection has it)")
        if len(set(value)) != len(value):
            raise ValueError("a filter field is named twice")
        return value

    @field_validator("uri")
    @classmethod
    def _known_uri(cls, value: str) -> str:
        if is_server(value) or value.endswith(".db"):
            return value
        raise ValueError(f"{value!r} is neither a milvus-lite file (a path ending in .db) nor a server "
                         f"(http://host:19530, https://..., tcp://...)")


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "tcp://", "grpc://"))


class MilvusUnavailable(DependencyUnavailable):
    """The Milvus server (or the embedded engine's file) could not be reached; the message names it."""

    dependency = "milvus"


def is_transient(exc: BaseException | None) -> bool:
    """A failure to reach the server (worth retrying), not a request it refused."""
    import grpc
    from pymilvus.exceptions import MilvusException, MilvusUnavailableException

    if isinstance(exc, MilvusUnavailableException):
        return True
    if isinstance(exc, MilvusException):
        return "Fail connecting to server" in str(exc.message)
    return isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                             grpc.StatusCode.DEADLINE_EXCEEDED)


class _Retrying:
    """A MilvusClient whose calls go through ``MilvusStore._retrying`` (server mode)."""

    def __init__(self, client: Any, store: MilvusStore):
        self._client, self._store = client, store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: self._store._retrying(name, lambda: attr(*args, **kwargs))


class MilvusStore(Owned, Resource):
    """One collection, both roles: the dense store and (``full_text``) the engine's own BM25 index."""

    preload = ("pymilvus",)

    Spec = MilvusSpec
    located = True

    def __init__(self, spec: MilvusSpec, base_dir: Path | None = None):
        super().__init__(spec, base_dir)
        self._lock = threading.RLock()
        self._client = Lazy(self._new_client, self._lock)
        self._ready: set[str] = set()  # collections known to exist and loaded in this process
        self._columns: dict[str, frozenset[str]] = {}  # a loaded collection's filter columns (the keys)
        self._restoring_read: tuple[float, bool] = (-math.inf, False)  # (when, whether a rebuild was restoring)

    @classmethod
    def relocated(cls, spec: MilvusSpec, name: str) -> MilvusSpec:
        """A relative file moves with the data folder; an absolute one or a server becomes ``<name>.db`` in it."""
        if is_server(spec.uri) or Path(spec.uri).is_absolute():
            return spec.model_copy(update={"uri": f"{name}.db"})
        return spec

    @classmethod
    def fingerprint_fields(cls, spec: MilvusSpec) -> dict[str, Any]:
        """What changes indexed content: not where it lives, nor search-time or write-batch settings, nor
        the BM25 settings or the filter columns (a collection made with others is rebuilt from its own rows,
        ``sync``: changing them, or tuning them, re-embeds nothing)."""
        return spec.model_dump(exclude={"type", "uri", "token_env", "database", "collection", "ef_search",
                                        "write_batch_size", "timeout_seconds", "retries", "retry_max_seconds",
                                        "analyzer", "stemmer", "stopwords", "k1", "b", "filter_fields"})

    @property
    def server(self) -> str | None:
        """The configured Milvus server (None: a milvus-lite file, served or embedded)."""
        return self.spec.uri if is_server(self.spec.uri) else None

    @property
    def remote(self) -> str | None:
        """Where this process's calls go over gRPC: the configured server, or the managed engine
        (``flows/ops/milvus_server.py``) that serves the file; None when it opens the file itself."""
        return self.server or (self._owner.url if self._served_by() is not None else None)

    @property
    def path(self) -> Path:
        """The milvus-lite file (embedded mode)."""
        return (self.base_dir / self.spec.uri).resolve()

    @property
    def location(self) -> str:
        where = self.server or (f"{self.path} (served by {self._owner.url})" if self._owner else self.path)
        return f"milvus {where} collection {self.spec.collection}"

    @property
    def name(self) -> str:
        """The Milvus collection (``collection_name`` of the configured one)."""
        return collection_name(self.spec.collection)

    @property
    def meta_collection(self) -> str:
        return self.name + META_SUFFIX

    # ------------------------------------------------------------------ connection
    def _new_client(self):
        from pymilvus import MilvusClient

        if self.remote and not self.server:  # the managed engine of the file (loopback, no token)
            return self._server_client(self.remote, token="", database="")
        if self.server:
            token = ""
            if self.spec.token_env:
                token = os.environ.get(self.spec.token_env, "")
                if not token:
                    raise ValueError(f"{self.location}: environment variable {self.spec.token_env} (the token) is not set")
            return self._server_client(self.server, token=token, database=self.spec.database or "")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._open_lite(MilvusClient)
        except Exception as exc:
            raise MilvusUnavailable(
                f"{self.location}: milvus-lite could not open the file ({_first_line(exc)}); it serves one process "
                f"at a time: is another ragline process using it? (`ragline serve` runs one engine for the file that all its "
                f"processes share; or run a Milvus server)") from exc

    def _open_lite(self, client_class, attempts: int = 3):
        """A client of milvus-lite's engine for the file. An engine that died after starting (seen on a
        loaded machine: its socket never appears) stays registered for the path, so every later open
        would fail the same way: release it and start a fresh one, a bounded number of times (a file
        another process holds fails otherwise and is not retried)."""
        import tenacity
        from pymilvus.client.types import Status
        from pymilvus.exceptions import MilvusException

        def restart(retry_state: tenacity.RetryCallState) -> None:
            log.warning("%s: milvus-lite's engine did not answer (%s); starting it again", self.location,
                        _first_line(retry_state.outcome.exception()))
            _release_lite(str(self.path))

        for attempt in tenacity.Retrying(
                retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, MilvusException)
                                                  and exc.code == Status.CONNECT_FAILED),
                stop=tenacity.stop_after_attempt(attempts), before_sleep=restart, reraise=True):
            with attempt, warnings.catch_warnings():  # milvus-lite 2.5 imports pkg_resources, deprecated
                warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
                return client_class(uri=str(self.path), timeout=self.spec.timeout_seconds)

    def _server_client(self, uri: str, token: str, database: str):
        from pymilvus import MilvusClient

        try:
            return MilvusClient(uri=uri, token=token, db_name=database, timeout=self.spec.timeout_seconds)
        except Exception as exc:
            raise MilvusUnavailable(f"Milvus server {uri} unreachable ({type(exc).__name__}: "
                                    f"{_first_line(exc)}); is it running?") from exc

    def _connect(self):
        """The client; against a server, each call retries connection failures (``_retrying``)."""
        client = self._client.get()
        return _Retrying(client, self) if self.remote else client

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying connection failures with backoff until ``retries`` or
        ``retry_max_seconds`` runs out, then MilvusUnavailable naming the server. Every call is
        idempotent (upsert and delete by key, reads), so a retry is safe."""
        import tenacity
        from pymilvus.exceptions import ErrorCode, MilvusException

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_attempt(self.spec.retries + 1) | tenacity.stop_before_delay(self.spec.retry_max_seconds),
            wait=tenacity.wait_exponential_jitter(initial=0.25, max=5.0, jitter=0.05),
            before_sleep=lambda state: log.warning("Milvus server %s: %s failed (%s); retry %d/%d", self.remote,
                                                   what, _first_line(state.outcome.exception()),
                                                   state.attempt_number, self.spec.retries))
        try:
            return retrying(call)
        except MilvusException as exc:
            if exc.code != ErrorCode.COLLECTION_NOT_FOUND:
                raise
            with self._lock:  # dropped by another process (a new embedding model): look it up again next time
                self._ready.clear()
            raise StoreMissing(f"{self.location}: the collection does not exist ({_first_line(exc)}); {REMEDY}") from exc
        except tenacity.RetryError as err:
            cause = err.last_attempt.exception()
            raise MilvusUnavailable(
                f"Milvus server {self.remote} unreachable: {what} failed {err.last_attempt.attempt_number} times "
                f"({_first_line(cause)}); is it running? (retries={self.spec.retries}, "
                f"retry_max_seconds={self.spec.retry_max_seconds})") from cause

    def _exists(self) -> bool:
        """Whether the collection exists; never creates the embedded file (a read creates nothing)."""
        if not self.server and not self.path.is_file():
            return False
        return self._connect().has_collection(self.name)

    def _collection(self, create_dim: int | None = None) -> str:
        """The loaded collection's name; created with ``create_dim`` dimensions if absent and given,
        else StoreMissing naming it."""
        name = self.name
        with self._lock:
            if name in self._ready:
                return name
            client = self._connect() if (self.server or self.path.is_file() or create_dim) else None
            if client is None or not client.has_collection(name):
                if create_dim is None:
                    where = "the collection does not exist" if client else f"there is no store at {self.path}"
                    raise StoreMissing(f"{self.location}: {where}; {REMEDY}")
                self._create(client, create_dim)
            elif create_dim is not None and (recorded := self.recorded_settings()) is not None:
                raise InputError(f"{self.location}: the collection's BM25 was created with {recorded}, pipelines.yaml "
                                 f"sets {self.settings}; its schema holds them, so writing into it would mix two "
                                 f"analyzers: run the ingestion pipeline (its integrity check rebuilds the "
                                 f"collection) or use a new collection name")
            return self._load(client, name)

    def _load(self, client: Any, name: str) -> str:
        """``name`` loaded and its columns described (held: ``self._lock``)."""
        client.load_collection(name)
        self._columns[name] = _described_columns(client, name)
        self._ready.add(name)
        return name

    @property
    def columns(self) -> frozenset[str]:
        """The metadata keys the loaded collection keeps as columns (``filter_fields`` when created),
        and ``ACCESS_COLUMN`` where it has the access field."""
        return self._columns.get(self.name, frozenset())

    @property
    def wanted_columns(self) -> frozenset[str]:
        """The columns a collection made now has: ``filter_fields`` and the access field."""
        return frozenset(self.spec.filter_fields) | {ACCESS_COLUMN}

    def _reading(self, fresh: bool = False) -> str:
        """The collection a query reads: the configured one, or, while a rebuild copies the rows back
        into it (partial until that ends), the copy it restores them from, which holds every row. The
        phase is read at most once a second (``fresh``: now); StoreMissing when neither exists."""
        try:
            return self._read_target(fresh)
        except StoreMissing:
            if fresh:
                raise
            return self._read_target(fresh=True)  # a restore may have begun since the phase was read

    def _read_target(self, fresh: bool) -> str:
        if self._restoring(fresh):
            try:
                return self._loaded(self.name + REBUILD_SUFFIX)
            except StoreMissing:  # the restore ended and dropped its copy
                pass
        return self._collection()

    def _restoring(self, fresh: bool) -> bool:
        when, restoring = self._restoring_read
        now = time.monotonic()
        if fresh or now - when > PHASE_READ_SECONDS:
            restoring = self._get_meta().get(REBUILD_PHASE) == "restoring"
            self._restoring_read = (now, restoring)
        return restoring

    def _loaded(self, name: str) -> str:
        """``name`` loaded, its columns described (a collection another process made); else StoreMissing."""
        with self._lock:
            if name in self._ready:
                return name
            client = self._connect()
            if not client.has_collection(name):
                raise StoreMissing(f"{self.location}: collection {name} does not exist")
            return self._load(client, name)

    def _filtered(self, where: dict[str, Any] | None, call: Callable[[str, str], T]) -> T:
        """``call(collection, expression)`` on the collection a query reads (``_reading``), with ``where``
        as its filter expression. A process that loaded the collection keeps its columns; another one may
        rebuild it with other ``filter_fields`` (a reader under ``ragline serve`` while an ingestion run
        rebuilds), and a column the reader names that is gone makes the engine refuse the expression: the
        columns are described again and the call made once more with them (their JSON keys read where a
        column went). A collection dropped under the call (a rebuild beginning or ending) is looked up
        again, once."""
        from pymilvus.exceptions import MilvusException

        name = self._reading()
        used = self._columns.get(name, frozenset())
        try:
            return call(name, expression(where, used))
        except StoreMissing:
            name = self._reading(fresh=True)
            return call(name, expression(where, self._columns.get(name, frozenset())))
        except MilvusException:
            if not where or not used:
                raise
            described = _described_columns(self._connect(), name)
            if described == used:
                raise
            with self._lock:
                self._columns[name] = described
            log.info("%s: the collection's filter columns changed (%s -> %s); read again", self.location,
                     ", ".join(sorted(used)), ", ".join(sorted(described)) or "none")
            return call(name, expression(where, described))

    def _create(self, client: Any, dim: int, name: str | None = None) -> None:
        """The collection ``name`` (the configured one by default, recording its BM25 settings)."""
        from pymilvus import DataType, Function, FunctionType

        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("chunk_id", DataType.VARCHAR, max_length=TEXT_BYTES)
        own_terms = self.spec.full_text and self.spec.analyzer == "ragline"
        analyzed = self.spec.full_text and not own_terms
        schema.add_field("text", DataType.VARCHAR, max_length=TEXT_BYTES, enable_analyzer=analyzed,
                         **({"analyzer_params": {"type": self.spec.analyzer}} if analyzed else {}))
        if own_terms:  # ragline's terms, space-separated: Milvus only splits them on whitespace
            schema.add_field("terms", DataType.VARCHAR, max_length=TEXT_BYTES, enable_analyzer=True,
                             analyzer_params={"tokenizer": "whitespace"})
        schema.add_field("metadata", DataType.JSON)
        for key in self.spec.filter_fields:
            schema.add_field(COLUMN_PREFIX + key, DataType.VARCHAR, max_length=TEXT_BYTES)
        schema.add_field(ACCESS_FIELD, DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=ACCESS_CAPACITY,
                         max_length=64)
        schema.add_field("dense", DataType.FLOAT_VECTOR, dim=dim)
        index = client.prepare_index_params()
        index.add_index("dense", metric_type=_METRIC[self.spec.space], **self._dense_index())
        for key in self.spec.filter_fields:
            index.add_index(COLUMN_PREFIX + key, index_type="INVERTED")
        if self.spec.full_text:
            schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
            schema.add_function(Function(name="bm25", function_type=FunctionType.BM25,
                                         input_field_names=["terms" if own_terms else "text"],
                                         output_field_names=["sparse"]))
            index.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                            params={"bm25_k1": self.spec.k1, "bm25_b": self.spec.b})
        # Strong: a read sees every write acknowledged before it (a server's default, Bounded, may not).
        client.create_collection(name or self.name, schema=schema, index_params=index, consistency_level="Strong")
        self._columns[name or self.name] = self.wanted_columns
        if name is None:
            self._put_meta({"settings": self.settings})
            log.info("%s: created (%d dimensions)", self.location, dim)

    def _rebuild(self) -> None:
        """The collection made again with the configured BM25 settings and filter columns from its own
        rows (vectors, text and metadata kept; nothing re-embedded). Milvus fixes a field's analyzer at
        creation and milvus-lite cannot rename a collection: the rows go to ``<name>_rebuild``, the side
        collection records that the copy is whole (``rebuild: restoring``), the collection is dropped and
        created anew, and the rows come back. Killed before that record, the collection is the truth and
        the copy is dropped; after it, the copy is, and the next writer finishes the restore (``resume``)
        before it reads or writes anything, so a crash never costs a re-embedding."""
        client = self._connect()
        name, temp = self.name, self.name + REBUILD_SUFFIX
        with self._lock:
            dim = _dimension(client, name)
            if client.has_collection(temp):  # a rebuild killed while copying out: the collection is the truth
                client.drop_collection(temp)
            self._create(client, dim, temp)
            client.load_collection(temp)
            copied = self._copy(name, temp)
            self._put_meta({REBUILD_PHASE: "restoring"})
            client.drop_collection(name)
            self._ready.discard(name)
            failpoints.hit("milvus.after_drop")
            self._restore(client, dim)
        log.warning("%s: rebuilt with BM25 settings %s and filter columns %s (%d chunks copied)", self.location,
                    self.settings, sorted(self.spec.filter_fields), copied)

    def _restore(self, client: Any, dim: int) -> None:
        """Make the collection anew with the configured settings (what a killed restore left of it is
        dropped) and fill it from ``<name>_rebuild``, which holds every row; then drop that copy and the
        record of the restore."""
        name, temp = self.name, self.name + REBUILD_SUFFIX
        if client.has_collection(name):
            client.drop_collection(name)
        self._create(client, dim)  # (records the columns it made)
        client.load_collection(name)
        self._ready.add(name)
        client.load_collection(temp)
        self._copy(temp, name)
        client.drop_collection(temp)
        self._put_meta({REBUILD_PHASE: ""})

    def resume(self) -> bool:
        """Finish a rebuild that was killed while restoring the rows (``_rebuild``). The ingestion run
        calls it under its writer lease before its integrity check, which would otherwise find rows
        missing and re-embed them; readers never write."""
        if self._get_meta().get(REBUILD_PHASE) != "restoring":
            return False
        client = self._connect()
        temp = self.name + REBUILD_SUFFIX
        with self._lock:
            if not client.has_collection(temp):  # the restore finished; only its record was left
                self._put_meta({REBUILD_PHASE: ""})
                return False
            dim = _dimension(client, temp)
            log.warning("%s: finishing a rebuild that was interrupted (the rows come back from %s)",
                        self.location, temp)
            self._restore(client, dim)
            return True

    def _copy(self, source: str, target: str) -> int:
        """Every row of ``source`` into the new, empty ``target`` (its terms and filter columns written
        anew), in pages: inserted, as nothing in ``target`` can share a key (an upsert looks each key up
        first, which milvus-lite pays for by the collection's size: twice the time per page at 600,000 rows)."""
        client = self._connect()
        iterator = client.query_iterator(source, batch_size=self.spec.write_batch_size, filter="",
                                         output_fields=["key", "chunk_id", "text", "metadata", "dense"])
        copied = 0
        try:
            while batch := iterator.next():
                rows = [{f: row[f] for f in ("key", "chunk_id", "text", "metadata", "dense")} for row in batch]
                self._add_terms(rows)
                _add_columns(rows, self._columns[target])
                client.insert(target, rows)
                copied += len(rows)
                failpoints.hit("milvus.copied_out" if target.endswith(REBUILD_SUFFIX) else "milvus.copied_back")
        finally:
            iterator.close()
        return copied

    def _dense_index(self) -> dict[str, Any]:
        if not self.server or self.spec.index == "FLAT":  # milvus-lite builds FLAT, IVF_FLAT or AUTOINDEX only
            return {"index_type": "FLAT"}
        if self.spec.index == "HNSW":
            return {"index_type": "HNSW", "params": {"M": self.spec.max_neighbors,
                                                     "efConstruction": self.spec.ef_construction}}
        return {"index_type": self.spec.index}

    def _search_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"metric_type": _METRIC[self.spec.space]}
        if self.server and self.spec.index == "HNSW":
            params["params"] = {"ef": self.spec.ef_search}
        return params

    # ------------------------------------------------------------------ side collection
    def _meta_ready(self, create: bool) -> bool:
        from pymilvus import DataType

        name = self.meta_collection
        with self._lock:
            if name in self._ready:
                return True
            if not self.server and not self.path.is_file() and not create:
                return False
            client = self._connect()
            if not client.has_collection(name):
                if not create:
                    return False
                schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
                schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=128)
                schema.add_field("value", DataType.VARCHAR, max_length=TEXT_BYTES)
                schema.add_field("unused", DataType.FLOAT_VECTOR, dim=2)  # Milvus requires a vector field
                index = client.prepare_index_params()
                index.add_index("unused", index_type="FLAT", metric_type="L2")
                client.create_collection(name, schema=schema, index_params=index, consistency_level="Strong")
            client.load_collection(name)
            self._ready.add(name)
            return True

    def _get_meta(self) -> dict[str, str]:
        if not self._meta_ready(create=False):
            return {}
        rows = self._connect().query(self.meta_collection, filter='key != ""', output_fields=["key", "value"])
        return {row["key"]: row["value"] for row in rows}

    def _put_meta(self, values: dict[str, str]) -> None:
        self._meta_ready(create=True)
        self._connect().upsert(self.meta_collection, [{"key": k, "value": v, "unused": [0.0, 0.0]}
                                                      for k, v in values.items()])

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self) -> None:
        """Connect and load the collection (a store never written is left alone: nothing is created)."""
        try:
            if self._exists():
                self._collection()
        except StoreMissing:
            return

    def health(self, index_state: Any = None) -> Health:
        """Reachable, and holding as many chunks as ``index_state`` names (when given). Read-only."""
        try:
            return store_health(self.location, self.count, index_state)
        except Exception as exc:  # noqa: BLE001 - a probe reports, never raises
            return Health.down(f"{self.location}: {type(exc).__name__}: {_first_line(exc)}")

    def close(self) -> None:
        with self._lock:
            self._ready.clear()
            self._columns.clear()
            client = self._client.reset()
        if client is not None:
            client.close()
            if not self.remote:  # milvus-lite's engine for the file stops once released (its lock file)
                _release_lite(str(self.path))

    # ------------------------------------------------------------------ the store role
    def reset(self) -> None:
        """Drop the collection (the embedding model, hence the dimension, changed)."""
        with self._lock:
            if self._exists():
                self._connect().drop_collection(self.name)
                if self._connect().has_collection(self.name + REBUILD_SUFFIX):
                    self._connect().drop_collection(self.name + REBUILD_SUFFIX)
            if self._meta_ready(create=False):
                self._connect().drop_collection(self.meta_collection)
            self._ready.clear()

    def present(self, ids: list[str]) -> set[str]:
        """Which of these chunk ids the collection holds."""
        return set(self.rows(ids, ["chunk_id"]))

    def all_ids(self) -> set[str]:
        try:
            name = self._collection()
        except StoreMissing:
            return set()
        iterator = self._connect().query_iterator(name, batch_size=5_000, filter="", output_fields=["chunk_id"])
        ids: set[str] = set()
        try:
            while batch := iterator.next():
                ids.update(row["chunk_id"] for row in batch)
        finally:
            iterator.close()
        return ids

    def vectors(self, ids: list[str]) -> dict[str, np.ndarray]:
        """Stored vectors by chunk id, from the collection queries read (``_reading``: the whole copy
        while a rebuild restores the collection), as the passages they are asked for came from there."""
        if not ids:
            return {}
        rows = self.rows(ids, ["dense"], collection=self._reading())
        return {cid: np.asarray(row["dense"], dtype=np.float32) for cid, row in rows.items()}

    def metadatas(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        return {cid: row["metadata"] or {} for cid, row in self.rows(ids, ["metadata"]).items()}

    def score(self, query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        """The score ``query`` gives ``vectors`` as a query's passages carry it (as Chroma's)."""
        return space_scores(self.spec.space, query, vectors)

    def upsert(self, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        name = self._collection(create_dim=len(chunks[0].embedding))
        for start in range(0, len(chunks), self.spec.write_batch_size):
            batch = chunks[start:start + self.spec.write_batch_size]
            rows = [_row(c) for c in batch]
            self._add_terms(rows)
            _add_columns(rows, self._columns[name])
            self._connect().upsert(name, rows)

    @property
    def own_terms(self) -> bool:
        """Whether ragline computes the BM25 terms (analyzer ``ragline``) into the ``terms`` field."""
        return self.spec.full_text and self.spec.analyzer == "ragline"

    def _add_terms(self, rows: list[dict[str, Any]]) -> None:
        """Each row's ``terms`` (analyzer ``ragline``): its text's terms, space-separated and padded
        with a space each side (``document_frequencies`` matches `` term ``)."""
        if not self.own_terms:
            return
        for row, terms in zip(rows, self.terms([r["text"] for r in rows])):
            row["terms"] = f" {' '.join(terms)} "
            if len(row["terms"].encode("utf-8")) > TEXT_BYTES:
                raise InputError(f"chunk {row['chunk_id']!r}: its BM25 terms take over Milvus's {TEXT_BYTES:,} bytes "
                                 f"per chunk; chunk smaller (the chunk step's size)")

    def update_metadata(self, metadatas: dict[str, dict[str, Any]]) -> None:
        """Change stored chunks' metadata, vectors and text kept: the keys given are merged in, a key
        given as None is removed (as Chroma's ``update``). Milvus 2.5 rewrites whole rows: read, merge, upsert."""
        rows = self.rows(sorted(metadatas), ["chunk_id", "text", "metadata", "dense"])
        merged = []
        for cid, row in rows.items():
            meta = {**(row["metadata"] or {}), **metadatas[cid]}
            merged.append({"key": chunk_key(cid), "chunk_id": cid, "text": row["text"], "dense": row["dense"],
                           "metadata": {k: v for k, v in meta.items() if v is not None}})
        self._add_terms(merged)
        name = self._collection()
        _add_columns(merged, self._columns[name])
        for start in range(0, len(merged), self.spec.write_batch_size):
            self._connect().upsert(name, merged[start:start + self.spec.write_batch_size])

    def delete(self, ids: Iterable[str]) -> None:
        keys = [chunk_key(cid) for cid in ids]
        if not keys or not self._exists():
            return
        name = self._collection()
        for start in range(0, len(keys), ID_PAGE):
            self._connect().delete(name, filter=_keys_expression(keys[start:start + ID_PAGE]))

    def query(self, embeddings: np.ndarray, k: int, where: dict[str, Any] | None = None,
              retriever: str = "dense") -> list[list[Passage]]:
        """Top ``k`` per vector, filtered by ``where`` (the Chroma-style filter, translated)."""
        vectors = np.asarray(embeddings, dtype=np.float32)
        if len(vectors) == 0:
            return []
        hits = self._filtered(where, lambda name, condition: self._connect().search(
            name, data=vectors.tolist(), anns_field="dense", limit=k, filter=condition,
            search_params=self._search_params(), output_fields=["chunk_id", "text", "metadata"]))
        return [sorted((_passage(hit, self._score(hit["distance"]), retriever) for hit in row),
                       key=lambda p: (-p.score, p.chunk_id)) for row in hits]

    def _score(self, distance: float) -> float:
        return -float(distance) if self.spec.space == "l2" else float(distance)  # COSINE/IP: a similarity

    def rows(self, ids: list[str], fields: list[str], collection: str | None = None) -> dict[str, dict[str, Any]]:
        """The rows of these chunk ids (those present), by chunk id; from ``collection`` (the one a
        query just searched, ``_filtered``), by default the configured one."""
        if not ids:
            return {}
        name = collection or self._collection()
        out: dict[str, dict[str, Any]] = {}
        for start in range(0, len(ids), ID_PAGE):
            keys = [chunk_key(cid) for cid in ids[start:start + ID_PAGE]]
            for row in self._connect().query(name, filter=_keys_expression(keys),
                                             output_fields=sorted({"chunk_id", *fields})):
                out[row["chunk_id"]] = row
        return out

    # ------------------------------------------------------------------ embedder record
    def stored_embedder(self) -> str | None:
        self._collection()  # StoreMissing when there is nothing
        return self._get_meta().get("embedder")

    def record_embedder(self, key: str, model: str) -> None:
        if self._get_meta().get("embedder") != key:
            self._put_meta({"embedder": key, "embedder_model": model})

    def check_embedder(self, key: str, model: str) -> None:
        """Refuse to compare ``model``'s vectors with vectors another embedder made (as Chroma's check)."""
        meta = self._get_meta()
        if meta.get("embedder") in (None, key):
            return
        raise EmbedderMismatch(
            f"{self.location} holds vectors of embedder {meta.get('embedder_model')!r} (settings {meta['embedder']}), "
            f"not of this pipeline's {model!r} (settings {key}): run the ingestion pipeline (e.g. `ragline run "
            f"index`) to re-embed, or point the embedder back at the model the index was built with")

    # ------------------------------------------------------------------ the sparse role
    @property
    def settings(self) -> str:
        """The BM25 settings the collection's full-text index was created with (fixed at creation)."""
        settings: dict[str, Any] = {"analyzer": self.spec.analyzer, "k1": self.spec.k1, "b": self.spec.b}
        if self.spec.analyzer == "ragline":
            settings.update(stemmer=self.spec.stemmer, stopwords=self.spec.stopwords, terms=TERMS_FORMAT)
        return json.dumps(settings, sort_keys=True)

    def published_version(self) -> dict[str, Any] | None:
        """The generation of the index state whose writes the collection holds (``sync`` records it
        at the end of each ingestion run); None before the first. Milvus updates BM25 with each write:
        there are no versions to publish, and readers see an ingestion run's batches as they land."""
        meta = self._get_meta()
        if "generation" not in meta:
            return None
        return {"generation": int(meta["generation"]), "settings": meta.get("settings", ""), "count": self.count()}

    def sync(self, state: IndexState, on_rebuild: Callable[[], None] | None = None, force: bool = False) -> bool:
        """Record the state's generation: the engine indexed the text as it was written. True if it moved."""
        generation = state.generation
        if self._exists() and (self.recorded_settings() is not None or self._other_columns()):  # rebuild: other BM25
            # settings (e.g. tuned), or filter columns other than filter_fields (a collection from before them)
            self._rebuild()
            if on_rebuild is not None:
                on_rebuild()
            force = True
        published = self.published_version() if self._exists() else None
        if not force and published is not None and published["generation"] == generation:
            return False
        self._put_meta({"generation": str(generation)})
        return True

    def _other_columns(self) -> bool:
        """Whether the collection keeps other filter columns than ``filter_fields`` asks for (reads still
        filter right: a key without its column is read from the JSON metadata)."""
        self._collection()
        return self.columns != self.wanted_columns

    def problem(self, state: IndexState | None = None) -> str | None:
        """Why the full-text role cannot serve as configured (None: it can)."""
        if not self.spec.full_text:
            return f"{self.location}: full_text is off, so it cannot be the pipeline's sparse index"
        if (recorded := self.recorded_settings()) is not None:
            return (f"{self.location}: the collection's BM25 was created with {recorded}, pipelines.yaml sets "
                    f"{self.settings} (fixed at creation): run the ingestion pipeline (e.g. `ragline index`), which "
                    f"rebuilds the collection, or use a new collection name")
        return None

    def recorded_settings(self) -> str | None:
        """The BM25 settings the existing collection was created with when they differ from the
        configured ones (None: they agree, or there is no collection). Its schema holds the analyzer,
        so it cannot change in place."""
        recorded = self._get_meta().get("settings")
        return recorded if recorded is not None and recorded != self.settings else None

    def repair_for(self, problem: str) -> str | None:
        """How integrity repairs ``problem``: other BM25 settings rebuild the collection from its own
        rows (``sync``, nothing re-embedded); full_text off is the configuration's to fix."""
        return "rebuild_bm25" if self.spec.full_text and self.recorded_settings() is not None else None

    def published_ids(self) -> list[str]:
        return sorted(self.all_ids())

    def search(self, texts: list[str], k: int, where: dict[str, Any] | None = None,
               **_: Any) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """BM25 hits per text: (chunk id, score, metadata with text, source_id and title), best first."""
        if problem := self.problem():
            raise InputError(problem)
        if not texts:
            return []
        queries = [" ".join(t) for t in self.terms(texts)] if self.own_terms else list(texts)
        asked = [i for i, q in enumerate(queries) if q.strip()]  # no terms (stop words only): no hits
        out: list[list[tuple[str, float, dict[str, Any]]]] = [[] for _ in texts]
        if not asked:
            return out
        try:
            hits = self._filtered(where, lambda name, condition: self._connect().search(
                name, data=[queries[i] for i in asked], anns_field="sparse", limit=k, filter=condition,
                search_params={"metric_type": "BM25"}, output_fields=["chunk_id", "text", "metadata"]))
        except StoreMissing:
            return out
        for i, row in zip(asked, hits):
            found = [(hit["entity"]["chunk_id"], self._bm25_score(hit["distance"]),
                      {**_shown(hit["entity"]["metadata"]), "text": hit["entity"]["text"]}) for hit in row]
            out[i] = sorted(found, key=lambda h: (-h[1], h[0]))
        return out

    def _bm25_score(self, distance: float) -> float:
        """Milvus's BM25 score as the bm25 index gives it: Milvus multiplies Lucene's by (k1 + 1)."""
        return float(distance) / (1.0 + self.spec.k1)

    def _terms_role(self, what: str) -> str:
        """The collection, for a stage that reads ragline's BM25 terms (analyzer ``ragline`` only)."""
        if problem := self.problem():
            raise InputError(problem)
        if not self.own_terms:
            raise InputError(f"{self.location}: {what} reads the BM25 terms, which analyzer {self.spec.analyzer!r} "
                             f"keeps inside Milvus; set `analyzer: ragline` (the default) on the milvus resource")
        return self._reading()

    def terms(self, texts: list[str]) -> list[list[str]]:
        """Texts as this index's terms, as its writes and searches split them (analyzer ``ragline``)."""
        if not self.own_terms:
            raise InputError(f"{self.location}: analyzer {self.spec.analyzer!r} splits text inside Milvus, whose "
                             f"terms ragline cannot read; set `analyzer: ragline` (the default) on the milvus resource")
        return tokenize(texts, self.spec.stemmer, self.spec.stopwords)

    def count(self, where: dict[str, Any] | None = None) -> int:
        """How many chunks the collection holds that satisfy ``where`` (all when None)."""
        try:  # (no file: StoreMissing before any connection, a read creates none)
            rows = self._filtered(where, lambda name, condition: self._connect().query(
                name, filter=condition, output_fields=["count(*)"]))
        except StoreMissing:
            if where is None:
                raise
            return 0
        return int(rows[0]["count(*)"])

    def document_frequencies(self, terms: Iterable[str]) -> tuple[dict[str, int], int]:
        """How many chunks hold each term (terms no chunk holds are left out), and the chunk count.
        milvus-lite has no TEXT_MATCH: each term is a ``LIKE "% term %"`` count over the padded
        ``terms`` field, a scan per term in the engine (the bm25 index reads its postings)."""
        try:
            name = self._terms_role("document frequency")
        except StoreMissing:
            return {}, 0
        found: dict[str, int] = {}
        for term in sorted(set(terms)):
            if not term or any(c.isspace() for c in term):
                continue
            pattern = "% " + re.sub(r"([\\%_])", r"\\\1", term) + " %"
            rows = self._connect().query(name, filter=f"terms like {literal(pattern)}", output_fields=["count(*)"])
            if n := int(rows[0]["count(*)"]):
                found[term] = n
        return found, self.count()

    def search_weighted(self, queries: list[dict[str, float]], k: int, where: dict[str, Any] | None = None,
                        ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """``search`` for weighted term queries (already this index's terms): a passage scores the
        weighted sum of its BM25 scores for the terms (RM3-expanded queries), as the bm25 index's.
        Milvus's BM25 takes text, not weights: each term is searched alone (one call for all of a
        query's terms) and the per-term scores summed here. Exact while a term is in at most
        ``WEIGHTED_DEPTH`` chunks (Milvus's largest limit); beyond, the passages past a term's first
        ``WEIGHTED_DEPTH`` miss that term's share."""
        try:
            self._terms_role("a weighted (expanded) query")
        except StoreMissing:
            return [[] for _ in queries]
        results = []
        for weights in queries:
            known = [(t, w) for t, w in sorted(weights.items()) if w > 0 and t and not any(c.isspace() for c in t)]
            if not known:
                results.append([])
                continue
            searched, hits = self._filtered(where, lambda name, condition: (name, self._connect().search(
                name, data=[t for t, _ in known], anns_field="sparse", limit=WEIGHTED_DEPTH, filter=condition,
                search_params={"metric_type": "BM25"}, output_fields=["chunk_id"])))
            scores: dict[str, float] = {}
            for (_, weight), row in zip(known, hits):
                for hit in row:
                    cid = hit["entity"]["chunk_id"]
                    scores[cid] = scores.get(cid, 0.0) + weight * self._bm25_score(hit["distance"])
            best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
            rows = self.rows([cid for cid, _ in best], ["text", "metadata"], collection=searched)
            results.append([(cid, score, {**_shown(rows[cid]["metadata"]), "text": rows[cid]["text"]})
                            for cid, score in best if cid in rows])
        return results


# ---------------------------------------------------------------------------------------------- rows
def collection_name(name: str) -> str:
    """A ragline collection's Milvus collection: its name when Milvus allows it, else made of allowed
    characters with a hash of the name, so two names never share one (``a-b`` and ``a_b``)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,200}", name):
        return name
    return "c_" + re.sub(r"[^A-Za-z0-9_]", "_", name) + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]


def check_roles(store: Any, sparse: Any) -> None:
    """The milvus sparse index is its store's own full-text index: both roles must be one resource."""
    if isinstance(sparse, MilvusStore) and sparse is not store:
        raise ConfigError(f"{sparse.location}: a milvus `sparse` index is the BM25 of the chunks its own `store` "
                          f"holds: name the same milvus resource for both (store: x, sparse: x)")


def chunk_key(chunk_id: str) -> str:
    """The primary key of a chunk: hex, so every id expression is safe whatever the id holds."""
    return hashlib.sha256(chunk_id.encode("utf-8")).hexdigest()


def _row(chunk: Chunk) -> dict[str, Any]:
    if len(chunk.text.encode("utf-8")) > TEXT_BYTES:
        raise InputError(f"chunk {chunk.chunk_id!r}: {len(chunk.text.encode('utf-8')):,} bytes of text, over "
                         f"Milvus's {TEXT_BYTES:,} per chunk; chunk smaller (the chunk step's size)")
    return {"key": chunk_key(chunk.chunk_id), "chunk_id": chunk.chunk_id, "text": chunk.text,
            "metadata": chroma_metadata(chunk), "dense": [float(x) for x in chunk.embedding]}


def _add_columns(rows: list[dict[str, Any]], keys: frozenset[str]) -> None:
    """Each row's filter columns from its metadata: the value when it is a string a column holds, else ""
    (absent, another type, or too long: ``_column_compares`` sends filters on those to the JSON); and
    its access field where the collection has one (``ACCESS_COLUMN`` among ``keys``)."""
    access = ACCESS_COLUMN in keys
    for row in rows:
        meta = row["metadata"] or {}
        for key in keys:
            if key == ACCESS_COLUMN:
                continue
            value = meta.get(key)
            row[COLUMN_PREFIX + key] = value if _column_holds(value) else ""
        if access:
            row[ACCESS_FIELD] = _access_elements(meta, row["chunk_id"])


def _access_elements(meta: dict[str, Any], chunk_id: str) -> list[str]:
    """The access field of a chunk: each group whose key (``ragline_acl.<group>``) is true, and "*"
    when ``ragline_acl_public`` is. ``_acl_element`` reads a filter the same way, so a filter on the
    field matches exactly the chunks the JSON comparison does (a key that names no valid group is
    read from the JSON)."""
    elements = [PUBLIC_ELEMENT] if meta.get(PUBLIC_KEY) is True else []
    elements += [g for g in groups_of(meta) if _GROUP.match(g)]
    if len(elements) > ACCESS_CAPACITY:
        raise InputError(f"chunk {chunk_id[:200]!r} may be read by {len(elements)} groups; a Milvus collection's "
                         f"access field holds {ACCESS_CAPACITY}")
    return elements


_GROUP = re.compile(GROUP_PATTERN)


def _group_of(key: str) -> str | None:
    """The group an access key names (``ragline_acl.<group>``), None for any other key."""
    if not key.startswith(ACL_PREFIX + "."):
        return None
    group = key[len(ACL_PREFIX) + 1:]
    return group if _GROUP.match(group) else None


def _acl_element(key: str, op: str, value: Any) -> str | None:
    """The access-field element a comparison asks for (``<acl key> == true``), None for any other."""
    if op != "$eq" or value is not True:
        return None
    return PUBLIC_ELEMENT if key == PUBLIC_KEY else _group_of(key)


def _acl_any(branches: list[Any]) -> list[str] | None:
    """The elements an ``$or`` of access comparisons asks for (any of them), None if it is anything else."""
    elements = []
    for branch in branches:
        if not isinstance(branch, dict) or len(branch) != 1:
            return None
        [(key, cond)] = branch.items()
        if isinstance(cond, dict):
            if len(cond) != 1:
                return None
            [(op, value)] = cond.items()
        else:
            op, value = "$eq", cond
        element = _acl_element(key, op, value)
        if element is None:
            return None
        elements.append(element)
    return elements


def _column_holds(value: Any) -> bool:
    return isinstance(value, str) and value != "" and len(value.encode("utf-8")) <= TEXT_BYTES


def _dimension(client: Any, name: str) -> int:
    """The collection's vector dimension (its ``dense`` field)."""
    fields = client.describe_collection(name)["fields"]
    return int(next(f for f in fields if f["name"] == "dense")["params"]["dim"])


def _described_columns(client: Any, name: str) -> frozenset[str]:
    names = [f["name"] for f in client.describe_collection(name)["fields"]]
    access = {ACCESS_COLUMN} if ACCESS_FIELD in names else set()
    return frozenset(n[len(COLUMN_PREFIX):] for n in names if n.startswith(COLUMN_PREFIX)) | access


def _shown(meta: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (meta or {}).items() if k != "ordinal"}


def _passage(hit: dict[str, Any], score: float, retriever: str) -> Passage:
    entity = hit["entity"]
    meta = _shown(entity.get("metadata"))
    return Passage(chunk_id=entity["chunk_id"], source_id=str(meta.pop("source_id", "")),
                   title=str(meta.pop("title", "")), text=entity.get("text") or "", score=score,
                   retriever=retriever, metadata=meta)


def _keys_expression(keys: list[str]) -> str:
    return f"key in [{', '.join(literal(k) for k in keys)}]"


def _release_lite(path: str) -> None:
    """Stop milvus-lite's engine for the file (the client's close leaves it running for the process)."""
    try:
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(path)
    except Exception as exc:  # noqa: BLE001 - best effort; the process's exit stops it too
        log.debug("milvus-lite %s not released: %s", path, exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


# ---------------------------------------------------------------------------------------------- filters
_OPERATORS = {"$eq": "==", "$ne": "!=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_NOTHING, _EVERYTHING = 'key == ""', 'key != ""'  # no chunk has an empty key


def expression(where: dict[str, Any] | None, columns: frozenset[str] = frozenset()) -> str:
    """A Chroma-style filter (``flows/resources/stores/filters.py``: ``$and``/``$or``, ``$eq``..``$nin``,
    already validated, access clauses ANDed in) as a Milvus boolean expression over the JSON
    ``metadata`` field, or over a key's column where the collection keeps one (``columns``) and the
    comparison reads the same there (``_column_compares``), and the access clause (``access.clause``)
    over the access field (``array_contains_any``); "" matches everything. Keys and values
    are escaped literals (a column's name is a validated identifier), so nothing in them can change
    the expression."""
    where = filters.normalize(where)
    return "" if where is None else _clause(where, columns)


def _clause(where: dict[str, Any], columns: frozenset[str]) -> str:
    parts = []
    for key, cond in where.items():
        if key == "$or" and ACCESS_COLUMN in columns and cond and (elements := _acl_any(cond)) is not None:
            parts.append(f"array_contains_any({ACCESS_FIELD}, [{', '.join(literal(e) for e in elements)}])")
        elif key in ("$and", "$or"):
            inner = [_clause(c, columns) for c in cond]
            if not inner:
                parts.append(_EVERYTHING if key == "$and" else _NOTHING)
            else:
                parts.append(f" {key[1:]} ".join(f"({c})" for c in inner))
        elif key.startswith("$"):
            raise filters.FilterError(f"unknown filter operator {key!r}")
        elif isinstance(cond, dict):
            parts.extend(_compare(key, op, value, columns) for op, value in cond.items())
        else:
            parts.append(_compare(key, "$eq", cond, columns))
    return " and ".join(f"({p})" for p in parts) if len(parts) > 1 else parts[0]


def _compare(key: str, op: str, value: Any, columns: frozenset[str] = frozenset()) -> str:
    if ACCESS_COLUMN in columns and (element := _acl_element(key, op, value)) is not None:
        return f"array_contains({ACCESS_FIELD}, {literal(element)})"
    field = COLUMN_PREFIX + key if key in columns and _column_compares(op, value) else f"metadata[{literal(key)}]"
    if op in ("$in", "$nin"):
        if not value:  # Milvus cannot parse `in []`
            return _NOTHING if op == "$in" else _EVERYTHING
        values = ", ".join(literal(v) for v in value)
        return f"{field} {'in' if op == '$in' else 'not in'} [{values}]"
    if op not in _OPERATORS:
        raise filters.FilterError(f"unknown filter operator {op!r} on field {key!r}")
    return f"{field} {_OPERATORS[op]} {literal(value)}"


def _column_compares(op: str, value: Any) -> bool:
    """Whether a key's column answers this comparison as its JSON value does. The column holds the
    value when it is a non-empty string within its size, else "" (``_add_columns``): so equality and
    ``$in`` with such strings match the same chunks, and ``$ne``/``$nin`` let the same ones through
    (a chunk without the key, or with another type, passes both ways); ranges and other values read
    the JSON."""
    if op in ("$eq", "$ne"):
        return _column_holds(value)
    if op in ("$in", "$nin"):
        return bool(value) and all(_column_holds(v) for v in value)
    return False


def literal(value: Any) -> str:
    """A value as a Milvus literal. Strings: double-quoted, backslash and quote escaped (Milvus's
    grammar decodes no other escape); a line break has no literal form, so it is refused."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise filters.FilterError(f"{value} is not a number a filter can compare")
        return repr(value)
    if isinstance(value, str):
        if "\n" in value or "\r" in value:
            raise filters.FilterError(f"the milvus store cannot filter on a value with a line break: {value[:40]!r}")
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise filters.FilterError(f"a filter value must be a string, number or boolean, got {value!r}")
