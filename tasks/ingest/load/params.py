"""What ``load`` reads and how: its parameters and the formats it knows by suffix and media type."""
from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator, model_validator
from ragline.flows.sources import (
    SourceSpec,
)
from ragline.flows.sources.local import NonEmpty


# text formats read here; every other format is converted by its `ragline.formats` entry point
FORMATS = {".html": "html", ".htm": "html", ".md": "markdown", ".markdown": "markdown",
           ".txt": "text", ".jsonl": "jsonl"}


MEDIA_FORMATS = {"text/html": "html", "application/xhtml+xml": "html", "text/markdown": "markdown",
                 "text/plain": "text"}


# a converted format a web page can arrive as without its suffix in the URL (its Content-Type says it)
MEDIA_CONVERTED = {"application/pdf": ".pdf"}


# the built-in converters taken from folders by default; images (.png, .jpg, .tif: OCR) only when included
CONVERTED = (".pdf", ".docx", ".pptx", ".xlsx", ".odt", ".epub", ".eml", ".rtf")


IMAGES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff"})


SNIFF_BYTES = 8192


GLOB_CHARS = frozenset("*?[")


JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


MD_HEADING = re.compile(r"^#[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")


HTML_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.I | re.S)


HTML_H1 = re.compile(r"<h1\b[^>]*>(.*?)</h1>", re.I | re.S)


HTML_TAG = re.compile(r"<[^>]+>")


# metadata keys the loader (or the chunker, or the store) sets: a record's own metadata cannot spoof
# where a document comes from or links to (its "path" or "url" would become the chat page's link)
LOADER_KEYS = frozenset({"source", "root", "url", "path", "format", "modified", "file_name", "doc_id", "chunk",
                         "source_id", "title", "ordinal", "pages", "page_start", "page_end", "section",
                         "attachment"})


class Params(BaseModel):
    """Where the source files are and how to read them."""

    model_config = {"extra": "forbid"}

    paths: list[SourceSpec] = Field(..., min_length=1,
                                               description="folders (walked recursively), files or glob patterns; "
                                                           "each may be {path, name, url_prefix, follow_links, "
                                                           "hard_links}, or "
                                                           "a root of another type: {type: fsspec, url: ...}, "
                                                           "{type: web, start: [...]}")
    follow_links: bool = Field(False, description="index symbolic links whose target is outside every root of this "
                                                  "step (off: they are skipped with a reason)")
    hard_links: bool = Field(False, description="index files with more than one hard link (off: they are skipped "
                                                "with a reason, since the same bytes may be a file outside every "
                                                "root, as a symbolic link's may)")
    include: list[NonEmpty] = Field(
        ["*.html", "*.htm", "*.md", "*.markdown", "*.txt", "*.jsonl", *(f"*{ext}" for ext in CONVERTED)],
        min_length=1,
        description="file-name patterns taken from folders and globs (files named directly are always read)")
    exclude: list[NonEmpty] = Field(
        [], description="patterns of paths to skip, matched against the file name and the end of the path, "
                        "e.g. '**/.git/**', 'drafts/*'")
    max_bytes: int = Field(50_000_000, ge=1, le=2_000_000_000,
                           description="larger files are reported as failures and skipped")
    encoding: NonEmpty = Field("utf-8", description="text encoding of non-PDF files")
    jsonl_id_field: NonEmpty = Field("_id", description="JSONL record field holding the document id")
    jsonl_text_fields: list[NonEmpty] = Field(["text"], min_length=1,
                                              description="JSONL record fields joined into the document text")
    jsonl_title_field: NonEmpty = Field("title", description="JSONL record field holding the title")
    jsonl_version_field: NonEmpty | None = Field(
        None, description="JSONL record field holding the record's own version (e.g. 'updated_at': a string or "
                          "number): in a changed file, a record whose version is the one it was indexed with is "
                          "skipped without hashing or indexing it, even if its text changed; a record without the "
                          "field is hashed as usual")
    ocr: bool = Field(True, description="read PDF pages without a text layer (scans) and images (.png, .jpg, "
                                        ".tif; add them to `include`) by OCR, with Debian's tesseract-ocr; "
                                        "without it they are reported with the reason")
    ocr_max_pages: int = Field(50, ge=0, le=100_000, description="pages OCR reads per file at most (a few "
                                                                  "seconds each); the rest are reported")
    ocr_languages: NonEmpty = Field("eng", pattern=r"^[A-Za-z_]+(\+[A-Za-z_]+)*$",
                                    description="tesseract language codes, e.g. 'eng+deu'")
    full_listing_hours: float = Field(
        24.0, ge=0, le=8760,
        description="a folder root that `ragline serve` watches is listed from its change journal (the paths "
                    "that changed) instead of in full, for at most this long after its last full listing; "
                    "0: always list in full")
    acl_field: NonEmpty | None = Field(None, description="a document's own field naming the groups allowed to "
                                                          "read it (a list or 'a,b'): a JSONL record's field (or "
                                                          "one of its 'metadata'), a converted file's metadata; it "
                                                          "overrides the root's `access` rules. Not part of the "
                                                          "content hash: a change re-grants without re-embedding")

    @model_validator(mode="after")
    def _version_field_apart(self) -> "Params":
        field = self.jsonl_version_field
        if field is not None and field in (self.jsonl_id_field, *self.jsonl_text_fields):
            role = "id field" if field == self.jsonl_id_field else "a text field"
            raise ValueError(f"jsonl_version_field {field!r} is the {role}: a record's version must be a field of "
                             f"its own (e.g. 'updated_at')")
        return self

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        try:  # an unknown or non-text codec fails at compile time, not mid-run
            "".encode(value)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        return value
