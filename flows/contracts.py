"""Typed data that flows between stages.

Stages exchange these small pydantic models; the compiler wires a step's inputs to the
outputs of its upstream steps by port name (see ``flows.registry``).
"""
from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Metadata = dict[str, str | int | float | bool]


def content_hash(text: str) -> str:
    """Stable hash of a text, used for change detection and chunk ids."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class Document(BaseModel):
    """One source document (a file, or one record of a JSONL corpus)."""

    model_config = ConfigDict(frozen=False)

    source_id: str = Field(description="stable id: the path, or path#record-id for JSONL records")
    text: str
    title: str = ""
    format: str = Field("text", description="text, markdown, html, pdf or jsonl")
    path: str = ""
    modified: float = 0.0
    content_hash: str = ""
    metadata: Metadata = Field(default_factory=dict)


class Chunk(BaseModel):
    """A piece of a document, the unit that is embedded and indexed."""

    chunk_id: str
    source_id: str
    ordinal: int
    text: str
    title: str = ""
    metadata: Metadata = Field(default_factory=dict)
    embedding: list[float] | None = None


class Failure(BaseModel):
    """A document that could not be processed, reported and skipped."""

    source_id: str
    stage: str
    reason: str


class Query(BaseModel):
    """A search request as it moves through a query pipeline."""

    text: str
    history: list[dict[str, str]] = Field(default_factory=list, description="chat turns: {role, content}")
    filters: dict[str, Any] | None = Field(None, description="Chroma-style metadata `where` filter")
    variants: list[str] = Field(default_factory=list, description="rewritten search queries; empty means [text]")

    def search_texts(self) -> list[str]:
        return self.variants or [self.text]


class Passage(BaseModel):
    """A retrieved chunk with its score and provenance."""

    chunk_id: str
    source_id: str
    text: str
    title: str = ""
    score: float = 0.0
    retriever: str = Field("", description="step id that produced the score")
    metadata: Metadata = Field(default_factory=dict)


class Ranking(BaseModel):
    """Passages ranked for one search text by one retriever."""

    retriever: str
    query: str
    passages: list[Passage]


class IndexReport(BaseModel):
    """What an ingestion run changed; printed as the run summary."""

    added: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0
    failed: int = 0
    chunks_written: int = 0
    chunks_deleted: int = 0
    failures: list[Failure] = Field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: "IndexReport") -> "IndexReport":
        fields = ("added", "updated", "deleted", "unchanged", "failed", "chunks_written", "chunks_deleted")
        merged = {f: getattr(self, f) + getattr(other, f) for f in fields}
        return IndexReport(**merged, failures=self.failures + other.failures, seconds=self.seconds + other.seconds)

    def summary(self) -> str:
        return (f"added {self.added}, updated {self.updated}, deleted {self.deleted}, "
                f"unchanged {self.unchanged}, failed {self.failed} "
                f"({self.chunks_written} chunks written, {self.chunks_deleted} removed)")
