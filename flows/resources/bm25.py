"""Sparse BM25 index (bm25s), rebuilt from the index state and swapped in atomically.

bm25s indexes are immutable sparse matrices: rebuilding 50k passages takes ~2.5 s, so the
index is derived from the state record after each ingestion run that changed something,
written to a fresh folder and published by atomically replacing a pointer file.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field



def _bm25s():
    """bm25s, with its per-build DEBUG logging (re-enabled by its import) turned down."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s

from flows import failpoints
from flows.resources.filters import matches


class BM25Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["bm25"]
    path: str = Field(".ragline/bm25", description="folder holding the published index versions")
    k1: float = Field(1.2, gt=0)
    b: float = Field(0.75, ge=0, le=1)
    method: Literal["robertson", "lucene", "bm25l", "bm25+", "atire"] = "lucene"
    stemmer: Literal["english", "none"] = Field("english", description="Snowball stemmer (PyStemmer)")
    stopwords: Literal["en", "none"] = "en"

    def fingerprint_fields(self) -> dict[str, Any]:
        return self.model_dump(exclude={"type", "path"})


class BM25Index:
    """Loads the published version memory-mapped; reloads when a new version is published."""

    POINTER = "CURRENT"

    def __init__(self, spec: BM25Spec, base_dir: Path | None = None):
        self.spec = spec
        self.base_dir = base_dir or Path.cwd()
        self._loaded: tuple[str, Any, list[str], list[dict[str, Any]]] | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    @property
    def location(self) -> str:
        return f"bm25 {self.path}"

    def _stemmer(self):
        if self.spec.stemmer == "none":
            return None
        import Stemmer

        return Stemmer.Stemmer(self.spec.stemmer)

    def _tokenize(self, texts: list[str]):
        return _bm25s().tokenize(texts, stopwords=None if self.spec.stopwords == "none" else self.spec.stopwords,
                              stemmer=self._stemmer(), show_progress=False, return_ids=False)

    def published_version(self) -> dict[str, Any] | None:
        pointer = self.path / self.POINTER
        if not pointer.exists():
            return None
        return json.loads(pointer.read_text())

    def build(self, rows: Iterable[tuple[str, str, dict[str, Any]]], generation: int, settings: str) -> int:
        """Index (chunk_id, text, metadata) rows and publish them; returns the passage count."""
        bm25s = _bm25s()
        rows = list(rows)
        version = f"v-{generation}-{uuid.uuid4().hex[:8]}"
        folder = self.path / version
        folder.mkdir(parents=True, exist_ok=True)
        ids = [r[0] for r in rows]
        if rows:
            retriever = bm25s.BM25(k1=self.spec.k1, b=self.spec.b, method=self.spec.method)
            retriever.index(self._tokenize([r[1] for r in rows]), show_progress=False)
            retriever.save(str(folder), show_progress=False)
        _write_json(folder / "ids.json", ids)
        _write_json(folder / "meta.json", [{**r[2], "text": r[1]} for r in rows])
        failpoints.hit("bm25.before_pointer")
        _write_json(self.path / self.POINTER, {"version": version, "generation": generation,
                                               "settings": settings, "count": len(ids)})
        self._remove_stale(keep=version)
        return len(ids)

    def _remove_stale(self, keep: str) -> None:
        for child in self.path.iterdir():
            if child.is_dir() and child.name.startswith("v-") and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)

    def _current(self):
        info = self.published_version()
        if info is None:
            return None
        with self._lock:
            if self._loaded is None or self._loaded[0] != info["version"]:
                bm25s = _bm25s()

                folder = self.path / info["version"]
                ids = json.loads((folder / "ids.json").read_text())
                meta = json.loads((folder / "meta.json").read_text())
                retriever = bm25s.BM25.load(str(folder), mmap=True, show_progress=False) if ids else None
                self._loaded = (info["version"], retriever, ids, meta)
        return self._loaded

    def search(self, texts: list[str], k: int, where: dict[str, Any] | None = None,
               ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """Top-k (chunk_id, score, metadata with text) per query text; ``where`` filters on metadata."""
        loaded = self._current()
        if loaded is None or not loaded[2]:
            return [[] for _ in texts]
        _, retriever, ids, meta = loaded
        mask = None
        if where:
            mask = np.fromiter((matches(m, where) for m in meta), dtype=bool, count=len(meta))
            if not mask.any():
                return [[] for _ in texts]
        k = min(k, len(ids) if mask is None else int(mask.sum()))
        tokens = self._tokenize(texts)
        results = []
        for query_tokens in tokens:
            if not query_tokens:
                results.append([])
                continue
            docs, scores = retriever.retrieve([query_tokens], k=k, show_progress=False,
                                              weight_mask=None if mask is None else mask.astype(np.float32))
            results.append([(ids[int(d)], float(s), meta[int(d)]) for d, s in zip(docs[0], scores[0]) if s > 0])
        return results


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
