"""Sparse BM25 index (bm25s), rebuilt from the index state and swapped in atomically.

bm25s indexes are immutable sparse matrices: rebuilding 50k passages takes ~2.5 s, so the
index is derived from the state record after each ingestion run that changed something,
written to a fresh folder and published by atomically replacing a pointer file. Builders in
any process take an exclusive lock file around build, publish and cleanup, and cleanup spares
the published version and any folder younger than a grace period. A metadata filter is answered
from an index of chunk positions by value saved with each version (``MetadataIndex``), never by
reading every chunk's metadata per query.
"""
from __future__ import annotations

import bisect
import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
import zipfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows import failpoints
from ragline.flows.files import write_atomic
from ragline.flows.resources.filters import FilterError, matches
from ragline.flows.resources.base import Health, Resource
from ragline.flows.resources.state import REMEDY, IndexState, StoreDamaged, StoreMissing, disk_fault, expected_chunks

log = logging.getLogger("ragline.bm25")


def _bm25s():
    """bm25s, with its per-build DEBUG logging (re-enabled by its import) turned down."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


class BM25Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["bm25"]
    path: str = Field(".ragline/bm25", description="folder holding the published index versions")
    k1: float = Field(1.2, gt=0)
    b: float = Field(0.75, ge=0, le=1)
    method: Literal["robertson", "lucene", "bm25l", "bm25+", "atire"] = "lucene"
    stemmer: Literal["english", "none"] = Field("english", description="Snowball stemmer (PyStemmer)")
    stopwords: Literal["en", "none"] = "en"



class BM25Index(Resource):
    """Loads the published version memory-mapped; reloads when a new version is published."""

    Spec = BM25Spec
    located = True

    POINTER = "CURRENT"
    LOCK = "BUILD.lock"
    GRACE_SECONDS = 300.0  # version folders younger than this are never removed

    def __init__(self, spec: BM25Spec, base_dir: Path | None = None):
        super().__init__(spec, base_dir)
        self._loaded: tuple[str, Any, list[str], list[dict[str, Any]], MetadataIndex] | None = None
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    @property
    def location(self) -> str:
        return f"bm25 {self.path}"

    @classmethod
    def fingerprint_fields(cls, spec: BM25Spec) -> dict[str, Any]:
        return spec.model_dump(exclude={"type", "path"})

    def warm_up(self) -> None:
        """Map the published version and search it once (bm25s and the stemmer load on first use)."""
        self.search(["warm-up"], 1)

    def health(self, index_state: IndexState | None = None) -> Health:
        """The published version searchable, and in step with ``index_state`` (when given)."""
        expected = expected_chunks(index_state)
        detail: dict[str, Any] = {} if expected is None else {"state_chunks": expected}
        problem = self.problem(index_state)
        published = None if problem else self.published_version()
        detail["chunks"] = published.get("count", 0) if published else 0
        if problem:
            return Health.down(f"{problem}; {REMEDY}" if REMEDY not in problem else problem, **detail)
        return Health.up(**detail)

    def close(self) -> None:
        with self._lock:
            self._loaded = None

    def _tokenize(self, texts: list[str]):
        return tokenize(texts, self.spec.stemmer, self.spec.stopwords)

    def published_version(self) -> dict[str, Any] | None:
        """The pointer's record (version, generation, settings, count), or None if nothing was
        published; an unreadable pointer raises StoreDamaged naming it (a rebuild replaces it)."""
        pointer = self.path / self.POINTER
        if not pointer.exists():
            return None
        try:
            info = json.loads(pointer.read_text(encoding="utf-8"))
            if not isinstance(info, dict) or not {"version", "generation", "settings"} <= info.keys():
                raise ValueError("not a BM25 version record")
            return info
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise StoreDamaged(f"bm25 pointer {pointer} is unreadable ({type(exc).__name__}: {exc}); "
                               f"{REMEDY} to rebuild BM25 from the index state") from exc

    def problem(self, state: IndexState | None = None) -> str | None:
        """Why the published version cannot be searched as the state says it should, in one line, or
        None. Cheap (the pointer, a stat, two counts): run by every ingestion run and query check.
        Without a state only the pointer and its folder are checked."""
        try:
            published = self.published_version()
        except StoreDamaged as exc:
            return str(exc)
        chunks = None
        if state is not None:
            try:
                chunks = state.counts()[1]
            except StoreMissing:
                chunks = 0
        if published is None:
            return None if not chunks else (f"{self.location}: nothing is published while the index state "
                                             f"holds {chunks} chunks")
        folder = self.path / published["version"]
        if not (folder / "ids.json").is_file():
            return f"{self.location}: the published version {folder} is missing"
        if chunks is not None and published.get("count") != chunks and published["generation"] == state.generation:
            return (f"{self.location}: the published version holds {published.get('count')} passages, the index "
                    f"state {chunks} chunks")
        return None

    @property
    def settings(self) -> str:
        """What a published version must have been built with (the spec minus its location)."""
        return self.spec.model_dump_json(exclude={"path"})

    def lags(self, state: IndexState) -> bool:
        """True when the published version is not the state's generation built with these settings.
        An empty state with nothing published is in step: there is nothing to build."""
        try:
            published = self.published_version()
        except StoreDamaged:
            return True
        generation = state.generation
        if published is None:
            return generation != 0
        if not (self.path / published["version"] / "ids.json").is_file():
            return True  # the published folder was deleted: rebuild it
        return published["generation"] != generation or published["settings"] != self.settings

    def sync(self, state: IndexState, on_rebuild: Callable[[], None] | None = None, force: bool = False) -> bool:
        """Rebuild from the state and publish when the published version lags it (or ``force``);
        True if it did. Only writers call it (ingestion, tune, ``ragline check --repair``): a query
        never builds or publishes.

        Checked again under the build lock, so concurrent callers (threads or processes) rebuild
        once; ``on_rebuild`` runs just before a rebuild (e.g. to log why)."""
        if not force and not self.lags(state):
            return False
        with self._exclusive():
            if not force and not self.lags(state):
                return False
            if on_rebuild is not None:
                on_rebuild()
            generation = state.generation  # read before the rows: a later write only makes it look older
            self._build(state.chunk_rows(), generation, self.settings)
        return True

    def build(self, rows: Iterable[tuple[str, str, dict[str, Any]]], generation: int, settings: str) -> int:
        """Index (chunk_id, text, metadata) rows and publish them; returns the passage count."""
        with self._exclusive():
            return self._build(rows, generation, settings)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One builder at a time: a thread lock in this process, an flock on a file across processes
        (released by the kernel if the holder dies, so a killed build never blocks the next)."""
        with self._build_lock:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / self.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _build(self, rows: Iterable[tuple[str, str, dict[str, Any]]], generation: int, settings: str) -> int:
        bm25s = _bm25s()
        rows = list(rows)
        version = f"v-{generation}-{uuid.uuid4().hex[:8]}"
        folder = self.path / version
        ids = [r[0] for r in rows]
        retriever = None
        if rows:
            retriever = bm25s.BM25(k1=self.spec.k1, b=self.spec.b, method=self.spec.method)
            retriever.index(self._tokenize([r[1] for r in rows]), show_progress=False)
        try:
            folder.mkdir(parents=True, exist_ok=True)  # only now: the folder's age runs from its first write
            if retriever is not None:
                retriever.save(str(folder), show_progress=False)
            _write_json(folder / "ids.json", ids)
            meta = [{**r[2], "text": r[1]} for r in rows]
            _write_json(folder / "meta.json", meta)
            MetadataIndex.build(meta).save(folder)
            failpoints.hit("bm25.before_pointer")
            _write_json(self.path / self.POINTER, {"version": version, "generation": generation,
                                                   "settings": settings, "count": len(ids)})
        except OSError as exc:
            fault = self._unpublished(exc, folder)
            if fault is None:
                raise
            raise fault from exc
        self._remove_stale()
        return len(ids)

    def _unpublished(self, exc: OSError, folder: Path) -> OSError | None:
        """A version that could not be written whole (a full or read-only disk) is never published:
        the pointer still names the previous one. Its folder is removed at once (it would otherwise
        hold the space it took for the grace period); returns the error naming the folder and the
        reason (numpy's and json's own ``[Errno 28] No space left on device`` or ``19738 requested
        and 16352 written`` name neither), or None when the disk is not at fault."""
        shutil.rmtree(folder, ignore_errors=True)

        return disk_fault(exc, folder, "bm25 version not published, writing")

    def _remove_stale(self) -> None:
        """Delete versions that are neither published nor younger than the grace period: a young
        folder may belong to a builder that does not take the lock, or be mid-load by a reader."""
        try:
            published = self.published_version()
        except StoreDamaged:
            return  # a pointer this builder just wrote went bad: remove nothing
        current = published["version"] if published else None
        cutoff = time.time() - self.GRACE_SECONDS
        for child in self.path.iterdir():
            if child.is_dir() and child.name.startswith("v-") and child.name != current \
                    and _mtime(child) < cutoff:
                shutil.rmtree(child, ignore_errors=True)

    def _current(self):
        """The published version, loaded; re-reads the pointer if its folder vanished meanwhile."""
        for attempt in range(3):
            info = self.published_version()
            if info is None:
                return None
            try:
                return self._load(info["version"])
            except FileNotFoundError as exc:
                if attempt == 2:
                    raise StoreDamaged(f"{self.location}: the published version {self.path / info['version']} "
                                       f"is missing; {REMEDY} to rebuild BM25 from the index state") from exc
            except ValueError as exc:  # a damaged ids.json or meta.json
                raise StoreDamaged(f"{self.location}: the published version {self.path / info['version']} is "
                                   f"unreadable ({type(exc).__name__}: {exc}); {REMEDY} to rebuild it") from exc
        return None

    def published_ids(self) -> list[str]:
        """The chunk ids of the published version (``ragline check`` compares them with the state)."""
        info = self.published_version()
        if info is None:
            return []
        return self._current()[2]

    def _load(self, version: str):
        with self._lock:
            if self._loaded is None or self._loaded[0] != version:
                bm25s = _bm25s()
                folder = self.path / version
                ids = json.loads((folder / "ids.json").read_text())
                meta = json.loads((folder / "meta.json").read_text())
                retriever = bm25s.BM25.load(str(folder), mmap=True, show_progress=False) if ids else None
                self._loaded = (version, retriever, ids, meta, MetadataIndex.load(folder, meta))
            return self._loaded

    def search(self, texts: list[str], k: int, where: dict[str, Any] | None = None,
               ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """Top-k (chunk_id, score, metadata with text) per query text; ``where`` filters on metadata."""
        loaded = self._current()
        if loaded is None or not loaded[2]:
            return [[] for _ in texts]
        _, retriever, ids, meta, metadata = loaded
        mask = None
        if where:
            mask = metadata.mask(where)
            if not mask.any():
                return [[] for _ in texts]
        tokens = self._tokenize(texts)
        results = []
        for query_tokens in tokens:
            if not query_tokens:
                results.append([])
                continue
            scores = retriever.get_scores(query_tokens, weight_mask=None if mask is None else mask.astype(np.float32))
            results.append([(ids[d], float(scores[d]), meta[d]) for d in ranked(scores, k, ids).tolist()])
        return results

    def count(self, where: dict[str, Any] | None) -> int:
        """How many published chunks satisfy ``where`` (all when None), from the metadata index."""
        loaded = self._current()
        if loaded is None:
            return 0
        return len(loaded[2]) if not where else int(loaded[4].mask(where).sum())

    def terms(self, texts: list[str]) -> list[list[str]]:
        """Texts as this index's terms (its stemmer and stop words), as its searches split them."""
        return self._tokenize(texts)

    def document_frequencies(self, terms: Iterable[str]) -> tuple[dict[str, int], int]:
        """How many published passages hold each term (terms the index lacks are left out), and the
        passage count: read from the index's own postings, nothing is recomputed."""
        loaded = self._current()
        if loaded is None or not loaded[2]:
            return {}, 0
        _, retriever, ids, _, _ = loaded
        indptr, vocab = retriever.scores["indptr"], retriever.vocab_dict
        return {t: int(indptr[vocab[t] + 1] - indptr[vocab[t]]) for t in terms if t in vocab}, len(ids)

    def search_weighted(self, queries: list[dict[str, float]], k: int, where: dict[str, Any] | None = None,
                        ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """``search`` for weighted term queries (already this index's terms, see ``terms``): a passage
        scores the weighted sum of its BM25 scores for the terms (RM3-expanded queries)."""
        loaded = self._current()
        if loaded is None or not loaded[2]:
            return [[] for _ in queries]
        _, retriever, ids, meta, metadata = loaded
        mask = None
        if where:
            mask = metadata.mask(where)
            if not mask.any():
                return [[] for _ in queries]
        results = []
        for weights in queries:
            known = [(retriever.vocab_dict[t], w) for t, w in sorted(weights.items())
                     if w > 0 and t in retriever.vocab_dict]
            if not known:
                results.append([])
                continue
            scores = np.zeros(len(ids), dtype=np.float64)
            for term_id, weight in known:
                scores += weight * retriever.get_scores_from_ids([term_id])
            if mask is not None:
                scores *= mask
            results.append([(ids[d], float(scores[d]), meta[d]) for d in ranked(scores, k, ids).tolist()])
        return results


_SCALARS = (str, int, float, bool)  # the values a validated filter compares (filters._check_value)
_RANGES = ("$gt", "$gte", "$lt", "$lte")
_ABSENT = object()  # a chunk without the key: like None, it matches no value


class _Column:
    """One metadata key's chunks grouped by value: ``postings[offsets[g]:offsets[g + 1]]`` are the chunk
    positions (ascending) holding group ``g``'s value; groups ``[0, strings)`` are the key's strings in
    order, the rest its numbers (booleans among them, as Python compares them) in order. A value is
    read from the metadata of its group's first chunk (the objects themselves, listed when the key is
    first filtered on), so the index copies no value and persists as two int32 arrays. Values equal
    under ``==`` (1, 1.0 and True) are one group; NaN, None, lists and maps are in none: like a
    missing key they equal nothing and order with nothing."""

    __slots__ = ("key", "meta", "strings", "offsets", "postings", "_values")

    def __init__(self, key: str, meta: list[dict[str, Any]], strings: int, offsets: np.ndarray,
                 postings: np.ndarray):
        self.key, self.meta, self.strings, self.offsets, self.postings = key, meta, strings, offsets, postings
        self._values: list[Any] | None = None

    @classmethod
    def build(cls, key: str, meta: list[dict[str, Any]]) -> _Column:
        codes: defaultdict[Any, int] = defaultdict()
        codes.default_factory = codes.__len__  # a new value gets the next code
        values = [m.get(key, _ABSENT) for m in meta]
        try:
            coded = [codes[v] for v in values]
        except TypeError:  # a list or map value (unhashable): in no group
            coded = [codes[v if type(v) in _SCALARS else _ABSENT] for v in values]
        strings = sorted(v for v in codes if type(v) is str)
        numbers = sorted(v for v in codes if type(v) in (int, float, bool) and v == v)  # not NaN
        rank = np.full(len(codes), -1, dtype=np.int64)
        for group, value in enumerate(strings + numbers):
            rank[codes[value]] = group
        ranks = rank[np.asarray(coded, dtype=np.int64)]
        held = np.flatnonzero(ranks >= 0)
        order = np.argsort(ranks[held], kind="stable")  # stable: positions stay ascending within a group
        counts = np.bincount(ranks[held], minlength=len(strings) + len(numbers))
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        return cls(key, meta, len(strings), offsets, held[order].astype(np.int32))

    def nbytes(self) -> int:
        """The arrays, and 8 bytes a group for the list of its value once the key was filtered on."""
        return self.postings.nbytes + self.offsets.nbytes + 8 * (len(self.offsets) - 1)

    def equal(self, value: Any) -> np.ndarray:
        bounds = self._bounds(value)
        if bounds is None:
            return self.postings[:0]
        return self._slice(self._bisect(value, *bounds, bisect.bisect_left),
                           self._bisect(value, *bounds, bisect.bisect_right))

    def compare(self, op: str, value: Any) -> np.ndarray:
        """Chunks whose value is ``op`` ``value``: only strings compare with a string, only numbers with
        a number (other pairs raise TypeError in Python, which ``matches`` counts as no match)."""
        bounds = self._bounds(value)
        if bounds is None:
            return self.postings[:0]
        lo, hi = bounds
        if op == "$gt":
            return self._slice(self._bisect(value, lo, hi, bisect.bisect_right), hi)
        if op == "$gte":
            return self._slice(self._bisect(value, lo, hi, bisect.bisect_left), hi)
        if op == "$lt":
            return self._slice(lo, self._bisect(value, lo, hi, bisect.bisect_left))
        return self._slice(lo, self._bisect(value, lo, hi, bisect.bisect_right))  # $lte

    def _bounds(self, value: Any) -> tuple[int, int] | None:
        """The groups ``value`` compares with; None for a NaN (it equals and orders with nothing)."""
        if type(value) is str:
            return 0, self.strings
        if value != value:
            return None
        return self.strings, len(self.offsets) - 1

    def _bisect(self, value: Any, lo: int, hi: int, side: Callable) -> int:
        return side(self.values(), value, lo, hi)

    def values(self) -> list[Any]:
        """Each group's value, in group order (listed once; two threads listing it at once list the same)."""
        if self._values is None:
            self._values = [self.meta[p][self.key] for p in self.postings[self.offsets[:-1]].tolist()]
        return self._values

    def _slice(self, start: int, end: int) -> np.ndarray:
        return self.postings[self.offsets[start]:self.offsets[end]]


class MetadataIndex:
    """Chunk positions by metadata value, built once per loaded BM25 version, so a filter is set
    algebra over sorted position arrays instead of ``matches`` run on every chunk's metadata per
    query (linear in the corpus: 111 ms at 163k chunks). Answers exactly as ``matches`` does.

    Read-only once built, and owned by its version's loaded record: a reader keeps the version it
    started with while a writer publishes the next. Written into the version folder when it is built
    (loading it is ~10x cheaper than rebuilding it from the metadata); the chunk text (a key BM25 adds)
    is indexed only when a filter first names it."""

    FILE = "meta_index.npz"
    FORMAT = 1
    LAZY_KEYS = frozenset({"text"})

    def __init__(self, meta: list[dict[str, Any]], columns: dict[str, _Column]):
        self.size = len(meta)
        self._meta = meta
        self._columns = columns
        self._lock = threading.Lock()

    @classmethod
    def build(cls, meta: list[dict[str, Any]]) -> MetadataIndex:
        keys: set[str] = set()
        for m in meta:
            keys.update(m)
        return cls(meta, {key: _Column.build(key, meta) for key in sorted(keys - cls.LAZY_KEYS)})

    def save(self, folder: Path) -> None:
        columns = [c for c in self._columns.values() if c.key not in self.LAZY_KEYS]
        header = {"format": self.FORMAT, "size": self.size,
                  "keys": [[c.key, c.strings, len(c.offsets), len(c.postings)] for c in columns]}
        with open(folder / self.FILE, "wb") as out:
            np.savez(out, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
                     offsets=np.concatenate([c.offsets for c in columns] or [np.empty(0, np.int32)]),
                     postings=np.concatenate([c.postings for c in columns] or [np.empty(0, np.int32)]))

    @classmethod
    def load(cls, folder: Path, meta: list[dict[str, Any]]) -> MetadataIndex:
        """The index saved with the version; built from ``meta`` when the version has none (one
        published before it existed) or it is unreadable (it is derived data, so never fatal)."""
        path = folder / cls.FILE
        try:
            with np.load(path) as saved:
                header = json.loads(saved["header"].tobytes())
                offsets, postings = saved["offsets"], saved["postings"]
            return cls(meta, cls._columns_from(header, offsets, postings, meta))
        except FileNotFoundError:
            return cls.build(meta)
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("bm25 metadata index %s is unreadable (%s: %s): rebuilding it from the metadata",
                        path, type(exc).__name__, exc)
            return cls.build(meta)

    @staticmethod
    def _columns_from(header: dict[str, Any], offsets: np.ndarray, postings: np.ndarray,
                      meta: list[dict[str, Any]]) -> dict[str, _Column]:
        if header["format"] != MetadataIndex.FORMAT or header["size"] != len(meta):
            raise ValueError(f"format {header['format']} over {header['size']} chunks, not "
                             f"{MetadataIndex.FORMAT} over {len(meta)}")
        if offsets.dtype != np.int32 or postings.dtype != np.int32 or (len(postings) and not (
                0 <= postings.min() and postings.max() < len(meta))):
            raise ValueError("positions outside the version's chunks")
        columns, at_offset, at_posting = {}, 0, 0
        for key, strings, n_offsets, n_postings in header["keys"]:
            own = offsets[at_offset:at_offset + n_offsets]
            if len(own) != n_offsets or own[-1] != n_postings or not 0 <= strings < n_offsets:
                raise ValueError(f"key {key!r} does not add up")
            columns[key] = _Column(key, meta, strings, own, postings[at_posting:at_posting + n_postings])
            at_offset, at_posting = at_offset + n_offsets, at_posting + n_postings
        if at_offset != len(offsets) or at_posting != len(postings):
            raise ValueError("arrays longer than their keys")
        return columns

    def nbytes(self) -> int:
        """Bytes the index holds beyond the metadata itself (its values are read from the metadata)."""
        return sum(column.nbytes() for column in self._columns.values())

    def mask(self, where: dict[str, Any]) -> np.ndarray:
        """Which chunks satisfy ``where``, as a boolean array over chunk positions."""
        result = np.ones(self.size, dtype=bool)
        for key, cond in where.items():
            if key == "$and":
                for clause in cond:
                    result &= self.mask(clause)
            elif key == "$or":
                either = np.zeros(self.size, dtype=bool)
                for clause in cond:
                    either |= self.mask(clause)
                result &= either
            elif key.startswith("$"):
                raise FilterError(f"unknown filter operator {key!r}")
            elif isinstance(cond, dict):
                for op, value in cond.items():
                    result &= self._field(key, op, value)
            else:
                result &= self._field(key, "$eq", cond)
        return result

    def _field(self, key: str, op: str, value: Any) -> np.ndarray:
        if op in ("$in", "$nin"):
            supported = isinstance(value, list) and all(type(v) in _SCALARS for v in value)
        elif op in ("$eq", "$ne", *_RANGES):
            supported = type(value) in _SCALARS
        else:
            raise FilterError(f"unknown filter operator {op!r} on field {key!r}")
        if not supported:  # a value ``filters.validate`` refuses (every query is validated): as matches does
            return np.fromiter((matches(m, {key: {op: value}}) for m in self._meta), dtype=bool, count=self.size)
        column = self._column(key)
        if op in _RANGES:
            return self._positions([] if column is None else [column.compare(op, value)])
        values = value if op in ("$in", "$nin") else [value]
        found = self._positions([] if column is None else [column.equal(v) for v in values])
        return ~found if op in ("$ne", "$nin") else found

    def _positions(self, groups: list[np.ndarray]) -> np.ndarray:
        mask = np.zeros(self.size, dtype=bool)
        if groups:
            mask[np.concatenate(groups)] = True
        return mask

    def _column(self, key: str) -> _Column | None:
        column = self._columns.get(key)
        if column is None and key in self.LAZY_KEYS:
            with self._lock:
                column = self._columns.get(key)
                if column is None:
                    column = _Column.build(key, self._meta)
                    self._columns = {**self._columns, key: column}  # a new dict: readers never see it change size
        return column


def ranked(scores: np.ndarray, k: int, ids: list[str] | None = None) -> np.ndarray:
    """Indexes of the ``k`` best positive scores, best first; equal scores by chunk id (``ids``,
    else by index), so a tie at the cut never depends on the order the chunks were written in.
    Only the positive scores are partitioned: a filter zeroes most of them, and partitioning a long
    run of equal zeros was the larger part of a filtered search (2 ms of 3 at 41k chunks)."""
    positive = np.flatnonzero(scores > 0)
    k = min(k, len(positive))
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    values = scores[positive]
    cut = np.partition(values, len(values) - k)[len(values) - k]  # the k-th best score
    tied = positive[values >= cut]
    key = tied if ids is None else np.array([ids[i] for i in tied])
    return tied[np.lexsort((key, -scores[tied]))][:k]


def tokenize(texts: list[str], stemmer: str = "english", stopwords: str = "en") -> list[list[str]]:
    """Texts as BM25 terms, exactly as the index and its searches split them."""
    stem = None
    if stemmer != "none":
        import Stemmer

        stem = Stemmer.Stemmer(stemmer)
    return _bm25s().tokenize(texts, stopwords=None if stopwords == "none" else stopwords, stemmer=stem,
                             show_progress=False, return_ids=False)


def in_memory(tokens: list[list[str]], spec: BM25Spec):
    """A bm25s retriever over already tokenized texts, never written anywhere (the tuner scores
    BM25 settings on it without touching the published index)."""
    retriever = _bm25s().BM25(k1=spec.k1, b=spec.b, method=spec.method)
    retriever.index(tokens, show_progress=False)
    return retriever


def _mtime(path: Path) -> float:
    """Modification time; a folder that vanished counts as new, so it is left alone."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def _write_json(path: Path, data: Any) -> None:
    """Write to a temporary file, then rename over ``path``; a failed write leaves neither half."""
    write_atomic(path, json.dumps(data))
