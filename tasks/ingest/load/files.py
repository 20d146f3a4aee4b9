"""A file's bytes into Documents: text, Markdown and HTML here, every other format by its converter."""
from __future__ import annotations

import codecs
import html
import posixpath
import re
import time
from pathlib import Path
from typing import Iterator

from ragline.flows import access, formats, settings
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.sources import (
    SourceError,
)
from ragline.flows.sources.local import read_file
from ragline.tasks.ingest.load.params import (
    FORMATS, HTML_H1, HTML_TAG, HTML_TITLE, IMAGES, MD_HEADING, MEDIA_CONVERTED, MEDIA_FORMATS, Params,
    SNIFF_BYTES,
)
from ragline.tasks.ingest.load.provenance import _document
from ragline.tasks.ingest.load.records import RecordVersions, _jsonl_documents
from ragline.tasks.ingest.load.roots import SourceRoot


def _load_file(path: str, root: SourceRoot, data: bytes, mtime: float, params: Params, ctx: StepContext,
               media_type: str | None = None, groups: tuple[str, ...] | None = None,
               versions: RecordVersions | None = None) -> list[Document]:
    """All Documents of one item's bytes (one, or one per JSONL record); [] when it was reported as
    failed. ``media_type``: the Content-Type a web page came with (its URL often has no suffix);
    ``groups``: who may read it when its source says (an upload), else the root's access rules."""
    documents = _read_documents(path, root, data, mtime, params, ctx, media_type, versions)
    fallback = root.groups(path) if groups is None else groups
    out = []
    limit = settings.documents().document_max_chars
    for document in documents:
        if len(document.text) > limit:  # a text file, a record, an attachment (converters stop sooner)
            ctx.fail(document.source_id, f"text of {len(document.text)} characters, over the document_max_chars "
                                         f"limit of {limit}")
            continue
        try:
            out.append(_granted(document, fallback, params))
        except ValueError as exc:
            ctx.fail(document.source_id, str(exc))
    return out


def _granted(document: Document, fallback: tuple[str, ...], params: Params) -> Document:
    """The document with its groups: its own ``acl_field`` when it has one, else ``fallback``; its
    metadata carries them (flows/access.py) and never a reserved key of its own."""
    own = document.metadata.get(params.acl_field) if params.acl_field else None
    groups = fallback if own is None else access.parse_groups(
        own, f"document {document.source_id!r} field {params.acl_field!r}")
    document.groups = list(groups)
    kept = {k: v for k, v in access.without_acl(document.metadata).items() if k != params.acl_field}
    document.metadata = {**kept, **access.acl_metadata(groups)}
    return document


def _read_documents(path: str, root: SourceRoot, data: bytes, mtime: float, params: Params, ctx: StepContext,
                    media_type: str | None, versions: RecordVersions | None = None) -> list[Document]:
    fmt = FORMATS.get(Path(path).suffix.lower()) or MEDIA_FORMATS.get((media_type or "").split(";")[0].strip(),
                                                                       "text")
    where = root.source_id(path)
    if not data:
        ctx.fail(where, "empty document")
        return []
    media = (media_type or "").split(";")[0].strip()
    convert = formats.converter(Path(path).suffix) or formats.converter(MEDIA_CONVERTED.get(media, ""))
    if convert is not None:
        return _converted_documents(path, root, where, convert, data, mtime, params, ctx)
    text = _text(where, data, params, ctx)
    if text is None:
        return []
    if fmt == "jsonl":
        return _jsonl_documents(path, root, text, mtime, params, ctx, versions)
    title = _markdown_title(text) if fmt == "markdown" else _html_title(text) if fmt == "html" else ""
    return [_document(path, root, fmt, text, title or Path(path).stem, mtime)]


def _read(path: str, where: str, max_bytes: int, ctx: StepContext) -> tuple[bytes, float, str | None] | None:
    """A local file's bytes, mtime and change signal (taken before reading), or None when it was
    reported as failed."""
    try:
        fetched = read_file(path, max_bytes)
    except SourceError as exc:
        ctx.fail(where, str(exc))
        return None
    return fetched.data, fetched.modified or 0.0, fetched.signal


def _text(where: str, data: bytes, params: Params, ctx: StepContext) -> str | None:
    """A file's text; None, reported, when it cannot be decoded or holds nothing."""
    text = _decode(where, data, params.encoding, ctx)
    if text is not None and not text.strip():
        ctx.fail(where, "empty document")
        return None
    return text


def _decode(where: str, data: bytes, encoding: str, ctx: StepContext) -> str | None:
    """Bytes to text; None (reported) for binary or undecodable content."""
    wide = codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))  # NULs are normal there
    if not wide and b"\x00" in data[:SNIFF_BYTES]:
        ctx.fail(where, "binary content, not text")
        return None
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        ctx.fail(where, f"not valid {encoding}: cannot decode byte 0x{data[exc.start]:02x} at offset {exc.start}")
        return None
    return text.removeprefix("\ufeff")


def _markdown_title(text: str) -> str:
    """The first '# ' heading outside fenced code (a '# comment' in a shell block is no title)."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := MD_HEADING.match(line)):
            return match.group(1).strip()
    return ""


def _html_title(raw: str) -> str:
    """<title>, else the first <h1>: cheap regexes, since ``convert`` does the real HTML parsing."""
    for pattern in (HTML_TITLE, HTML_H1):
        if match := pattern.search(raw):
            title = " ".join(html.unescape(HTML_TAG.sub(" ", match.group(1))).split())
            if title:
                return title
    return ""


def _converted_documents(path: str, root: SourceRoot, where: str, convert: formats.Converter, data: bytes,
                         mtime: float, params: Params, ctx: StepContext, name: str | None = None) -> list[Document]:
    """The document a converter makes of a file (or of an attachment, ``where`` then being
    '<file>#<name>'), then one per attachment of a readable type; a file it cannot read is reported
    with the converter's reason, and an attachment's failure fails that attachment only."""
    name = name or posixpath.basename(path)
    kind = Path(name).suffix.lstrip(".").upper() or "file"
    options = _budget(params)
    try:
        formats.check_archive(data, options)  # a zip bomb is refused from its directory, before any parser
        converted = convert(data, name, options)
        options.check(len(converted.text))
    except formats.FormatError as exc:
        ctx.fail(where, str(exc))
        return []
    except Exception as exc:  # a converter library's own errors on a malformed file: this file only
        ctx.fail(where, f"unreadable {kind} file: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return []
    documents = []
    if converted.text.strip():
        documents.append(_document(path, root, Path(name).suffix.lstrip(".").lower(), converted.text,
                                   converted.title or Path(name).stem, mtime, source_id=where,
                                   pages=converted.pages, extra={**converted.metadata, **(
                                       {"attachment": name} if where != root.source_id(path) else {})}))
    elif not converted.attachments:
        ctx.fail(where, f"{kind} file has no text")
    for attachment, data in _named_attachments(converted.attachments):
        documents.extend(_attachment_documents(path, root, f"{where}#{attachment}", attachment, data, mtime,
                                               params, ctx))
    return documents


def _budget(params: Params) -> formats.Options:
    """What a converter may do and what one document may cost (the ``RAGLINE_DOCUMENT_*`` settings):
    its time is counted from now. A cooperative deadline, checked in the converters' loops, rather
    than a child process per document: loading runs in the engine's threads, and a process per file
    would cost more than most files take; the parts a loop cannot interrupt (a C parser reading one
    XML member, pypdf inflating one stream) are bounded before they start by the size limits."""
    limits = settings.documents()
    seconds = limits.document_max_seconds
    return formats.Options(params.ocr, params.ocr_max_pages, params.ocr_languages,
                           max_member_bytes=limits.document_max_member_bytes,
                           max_expanded_bytes=limits.document_max_expanded_bytes,
                           max_ratio=limits.document_max_expansion_ratio, max_chars=limits.document_max_chars,
                           seconds=seconds, deadline=time.monotonic() + seconds)


def _named_attachments(attachments: list[formats.Attachment]) -> Iterator[tuple[str, bytes]]:
    """Attachments by a name unique in their file ('a.pdf', 'a (2).pdf'), without '#' or '/'."""
    seen: dict[str, int] = {}
    for attachment in attachments:
        name = re.sub(r"[#/\\\x00-\x1f]", "_", attachment.name).strip() or "attachment"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            stem, dot, ext = name.rpartition(".")
            name = f"{stem} ({seen[name]}).{ext}" if dot and stem else f"{name} ({seen[name]})"
        yield name, attachment.data


def _attachment_documents(path: str, root: SourceRoot, where: str, name: str, data: bytes, mtime: float,
                          params: Params, ctx: StepContext) -> list[Document]:
    """An attachment of a converted format or a text format becomes its own document; others
    (images, archives) are left out: they are part of the message (a logo, a photo), not documents
    of their own, and OCR of every signature image would cost seconds and fail on photos."""
    suffix = Path(name).suffix.lower()
    if suffix in IMAGES:
        return []
    if (convert := formats.converter(suffix)) is not None:
        return _converted_documents(path, root, where, convert, data, mtime, params, ctx, name=name)
    if suffix not in FORMATS or suffix == ".jsonl":
        return []
    text = _text(where, data, params, ctx)
    if text is None:
        return []
    fmt = FORMATS[suffix]
    title = _markdown_title(text) if fmt == "markdown" else _html_title(text) if fmt == "html" else ""
    return [_document(path, root, fmt, text, title or Path(name).stem, mtime, source_id=where,
                      extra={"attachment": name})]
