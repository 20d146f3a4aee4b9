"""BEIR-style JSONL files: a Document per record, records whose version is the indexed one skipped."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ragline.flows import access
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document, Metadata, content_hash
from ragline.tasks.ingest.load.params import JSON_TYPES, LOADER_KEYS, Params
from ragline.tasks.ingest.load.provenance import _provenance, _shown
from ragline.tasks.ingest.load.roots import SourceRoot


@dataclass
class RecordVersions:
    """A changed JSONL file's records as indexed (source id -> content hash, groups; under this
    pipeline and fingerprint): a record whose version hash and groups are the recorded ones is
    skipped (``skipped``: marked listed, no Document); the rest are read as usual."""

    stored: dict[str, tuple[str, tuple[str, ...] | None]]
    fallback: tuple[str, ...]
    skipped: list[str] = field(default_factory=list)

    def unchanged(self, source_id: str, digest: str, record: dict[str, Any], params: Params) -> bool:
        known = self.stored.get(source_id)
        if known is None or known[0] != digest or known[1] is None:
            return False
        own, _ = _record_groups(record, params)
        try:
            groups = self.fallback if own is None else access.parse_groups(own, "")
        except ValueError:
            return False  # read as usual, which reports it
        if tuple(sorted(set(groups))) != known[1]:
            return False  # its access changed: read, so the sink re-grants it
        self.skipped.append(source_id)
        return True


def _jsonl_documents(path: str, root: SourceRoot, text: str, mtime: float, params: Params,
                     ctx: StepContext, versions: RecordVersions | None = None) -> list[Document]:
    """One Document per BEIR-style record; a bad line is reported as 'path:line' and the rest load.
    With ``versions``, a record whose version is the one it was indexed with makes none."""
    documents: list[Document] = []
    first_seen: dict[str, int] = {}
    # split on "\n" only: str.splitlines would also split on U+2028 inside JSON strings
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{root.source_id(path)}:{line_no}"
        try:
            record_id, record = _parse_record(line, params)
            if record_id in first_seen:
                raise ValueError(f"duplicate record id {record_id!r}, first seen on line {first_seen[record_id]}")
            version = _record_version(record, params)
            source_id = f"{root.source_id(path)}#{record_id}"
            if not (versions is not None and version is not None
                    and versions.unchanged(source_id, version, record, params)):
                documents.append(_record_document(path, root, record_id, record, mtime, params, version))
        except ValueError as exc:
            ctx.fail(where, str(exc))
            continue
        first_seen[record_id] = line_no
    return documents


def _parse_record(line: str, params: Params) -> tuple[str, dict[str, Any]]:
    """The id and object of one line; ValueError says what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise ValueError(f"record is a JSON {JSON_TYPES.get(type(record), 'value')}, not an object")
    record_id = record.get(params.jsonl_id_field)
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)) or not str(record_id).strip():
        raise ValueError(f"missing id: field {params.jsonl_id_field!r} must be a non-empty string or integer")
    return str(record_id), record


def _record_version(record: dict[str, Any], params: Params) -> str | None:
    """A record's content hash from its own version field (None: no field configured, or the record
    has none: its content is hashed); a version that is not a string or number is an error naming it."""
    name = params.jsonl_version_field
    if name is None or record.get(name) is None:
        return None
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"field {name!r} (jsonl_version_field) must be a non-empty string or number, "
                         f"not {JSON_TYPES.get(type(value), 'value')} {json.dumps(value)[:40]}")
    return content_hash(json.dumps({"version_field": name, "version": value}, ensure_ascii=False))


def _record_document(path: str, root: SourceRoot, record_id: str, record: dict[str, Any], mtime: float,
                     params: Params, version: str | None = None) -> Document:
    parts = [record.get(field) for field in params.jsonl_text_fields]
    text = "\n\n".join(part for part in parts if isinstance(part, str) and part.strip())
    if not text:
        raise ValueError(f"empty document: no text in {', '.join(params.jsonl_text_fields)}")
    title = record.get(params.jsonl_title_field)
    # no "modified": the file's mtime moves when any record changes, so it says nothing of this one,
    # and rewriting it on unchanged records would make incremental runs differ from clean ones
    base: Metadata = {**_provenance(path, root), "format": "jsonl", "doc_id": record_id}
    # canonical JSON: any change to the record (text, title, metadata) re-indexes it, key order does not;
    # its access field is not content: a change of rights re-grants its chunks without re-embedding them
    groups, hashed = _record_groups(record, params)
    own = {} if groups is None else {params.acl_field: ",".join(
        access.parse_groups(groups, f"record {record_id!r} field {params.acl_field!r}"))}
    return Document(source_id=f"{root.source_id(path)}#{record_id}", path=_shown(path, root), format="jsonl",
                    title=title.strip() if isinstance(title, str) else "", modified=mtime,
                    content_hash=version or content_hash(json.dumps(hashed, sort_keys=True, ensure_ascii=False)),
                    text=text,
                    metadata={**_scalar_metadata(record.get("metadata")), **own, **base})


def _record_groups(record: dict[str, Any], params: Params) -> tuple[Any, dict[str, Any]]:
    """A record's access value (its ``acl_field``, top-level or in its 'metadata'; None: it has none)
    and the record without it, which is what its content hash is made of."""
    name = params.acl_field
    if name is None:
        return None, record
    meta = record.get("metadata")
    if name in record:
        return record[name], {k: v for k, v in record.items() if k != name}
    if isinstance(meta, dict) and name in meta:
        return meta[name], {**record, "metadata": {k: v for k, v in meta.items() if k != name}}
    return None, record


def _scalar_metadata(extra: Any) -> Metadata:
    """Flat scalar values of a record's 'metadata' object (vector stores accept nothing nested)."""
    if not isinstance(extra, dict):
        return {}
    return {str(k): v for k, v in extra.items()
            if isinstance(v, (str, int, float, bool)) and str(k) not in LOADER_KEYS and not access.reserved(str(k))}
