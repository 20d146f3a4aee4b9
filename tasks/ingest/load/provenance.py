"""Where a document comes from, as its metadata says it and as it is shown (never the server's paths)."""
from __future__ import annotations

import posixpath

from ragline.flows.contracts import Document, Metadata, content_hash
from ragline.tasks.ingest.load.roots import SourceRoot


def _document(path: str, root: SourceRoot, fmt: str, text: str, title: str, mtime: float, *,
              source_id: str | None = None, pages: list[int] | None = None, extra: Metadata | None = None) -> Document:
    return Document(source_id=source_id or root.source_id(path), path=_shown(path, root), format=fmt, title=title,
                    modified=mtime, content_hash=content_hash(text), text=text, pages=pages or [],
                    metadata={**(extra or {}), **_provenance(path, root), "format": fmt, "modified": mtime})


def _shown(path: str, root: SourceRoot) -> str:
    """Where a source is shown to be: its public URL, else its id (never the server's path)."""
    return root.url(path) or root.source_id(path)


def _provenance(path: str, root: SourceRoot) -> Metadata:
    """The metadata only the loader sets: a document's own metadata can never replace it."""
    url = root.url(path)
    return {"source": _shown(path, root), "root": root.name, "file_name": posixpath.basename(path),
            **({"url": url} if url else {})}
