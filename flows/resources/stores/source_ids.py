"""Moving sources to root-relative ids without re-embedding.

Sources are identified by '<root name>/<path below the root>'. An index written before that (ids
were absolute paths: a project moved or copied duplicated every document) or one whose root was
renamed in pipelines.yaml holds the same documents under other ids. The sink's plan renames them
in place, once and reported: the stored vectors are kept (read back and written under the same
chunk ids with the new source id), the state is rewritten in one transaction, and BM25 is
republished because the state's generation moved.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ragline.flows.contracts import Chunk, Coverage, Document, Failure


@dataclass
class Moves:
    """Old id -> the document now loaded under a new id; legacy ids whose file is gone."""

    renamed: dict[str, Document] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)


def find_moves(documents: list[Document], indexed: dict[str, tuple[str, str]], covered: list[Coverage],
               failures: list[Failure]) -> Moves:
    """Pair indexed sources no current root covers with the documents that replace them: an
    absolute id ending in '/<new id>' (an index from before root-relative ids), or one ending in
    the new document's path below its root with the same content (a renamed root). Only one-to-one
    pairs move; an absolute id under a current root whose document is gone is reported gone."""
    orphans = [o for o in indexed if not any(c.covers(o) for c in covered)]
    by_tail: dict[str, list[str]] = defaultdict(list)
    for orphan in orphans:
        path = orphan
        while "/" in path:
            path = path.split("/", 1)[1]
            by_tail[path].append(orphan)
        by_tail[orphan].append(orphan)
    pairs: dict[str, list[Document]] = defaultdict(list)
    for doc in documents:
        if doc.source_id in indexed:
            continue
        legacy = [o for o in by_tail.get(doc.source_id, []) if o.startswith("/")]
        renamed = [o for o in by_tail.get(_below_root(doc), []) if indexed[o][0] == doc.content_hash]
        candidates = legacy or renamed
        if len(candidates) == 1:
            pairs[candidates[0]].append(doc)
    moves = Moves(renamed={old: docs[0] for old, docs in pairs.items() if len(docs) == 1})
    if not any(f.root for f in failures):
        for orphan in orphans:
            if orphan.startswith("/") and orphan not in moves.renamed:
                tails = [t for t in _tails(orphan) if any(c.covers(t) for c in covered)]
                if tails and not any(f.protects(t) for t in tails for f in failures):
                    moves.gone.append(orphan)
    return moves


def move_tails(indexed: dict[str, tuple[str, str]], covered: list[Coverage]) -> set[str]:
    """The ids a document must have (its own, or its path below its root) for ``find_moves`` to pair
    it with one of these indexed sources: a work list read a page at a time keeps only those."""
    tails: set[str] = set()
    for orphan in indexed:
        if not any(c.covers(orphan) for c in covered):
            path = orphan
            tails.add(path)
            while "/" in path:  # as find_moves's by_tail
                path = path.split("/", 1)[1]
                tails.add(path)
    return tails


def may_move(doc: Document, tails: set[str]) -> bool:
    return doc.source_id in tails or _below_root(doc) in tails


def _below_root(doc: Document) -> str:
    name = str(doc.metadata.get("root", "."))
    return doc.source_id if name == "." else doc.source_id.removeprefix(name + "/")


def _tails(source_id: str) -> list[str]:
    parts = source_id.lstrip("/").split("/")
    return ["/".join(parts[i:]) for i in range(1, len(parts))]


def move_chunks(rows: list[tuple[str, str, int, str, str, dict]], vectors: dict, renamed: dict[str, Document]
                ) -> list[Chunk] | None:
    """The stored chunks under their new source id and the loader's new provenance metadata, with
    their stored vectors; None when a vector is missing (the source is then re-indexed instead)."""
    chunks = []
    for chunk_id, source_id, ordinal, text, title, metadata in rows:
        if chunk_id not in vectors:
            return None
        doc = renamed[source_id]
        provenance = {k: v for k, v in doc.metadata.items() if k in ("source", "root", "url", "file_name")}
        kept = {k: v for k, v in metadata.items() if k != "url"}
        chunks.append(Chunk(chunk_id=chunk_id, source_id=doc.source_id, ordinal=ordinal, text=text, title=title,
                            metadata={**kept, **provenance}, embedding=[float(x) for x in vectors[chunk_id]]))
    return chunks
