"""Token-aware chunking with the embedder's own tokenizer, so chunks fit the model exactly.

Chunks follow the document's structure: one never crosses a page boundary (unless the page is
shorter than ``min_tokens``) nor a Markdown heading (unless the sections on both sides fit one
chunk together), and never splits a Markdown table row. A table starts a chunk of its own unless
it fits with what is around it; one longer than a chunk is split between rows, each piece after
the first opening with the table's header row again, and every chunk holding table rows is marked
``table: true`` with the table's ``caption`` (the short line just before it, else its heading).
Each chunk records its page range
(``page_start``/``page_end``) and its section path (``section``: "Heading > Subheading"); with
``prepend_section`` the path also opens the chunk's text (what the embedder and BM25 see), which
bench/section_context.py measures.
"""
from __future__ import annotations

import bisect
import hashlib
import re
import time
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from ragline.flows import failpoints, settings
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document
from ragline.flows.formats.base import BudgetExceeded
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder

SPECIAL_TOKENS = 2  # [CLS] and [SEP] (or <s>, </s>) take room in every sequence
SENTENCE_END = (".", "!", "?", ":", ";", "\n")
# formats whose '#' lines are text, not headings (a PDF's or a plain file's "# 1" is no section)
PLAIN_FORMATS = frozenset({"text", "pdf", "jsonl", "rtf"})
MD_HEADING = re.compile(r"(#{1,6})[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")
TABLE_ROW = re.compile(r"^[ \t]*\|.*$", re.M)
TABLE_RULE = re.compile(r"^[ \t]*\|(?:[ \t]*:?-+:?[ \t]*\|)+[ \t]*$")  # the line under a header row
CAPTION_CHARS = 200  # a longer line before a table is text, not its caption
# WordPiece (MiniLM's tokenizer) reads a word over 100 characters as one unknown token: a 10 MB line
# without spaces would be one token, and one chunk of 10 MB. Such a token is cut into pieces of
# PIECE_CHARS characters, each counted as a token, so every chunk stays within size * PIECE_CHARS.
LONG_TOKEN_CHARS = 100
PIECE_CHARS = 16
PROGRESS_CHARS = 1_000_000  # a longer document logs its chunking progress, every tenth of its tokens


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["tokens", "window"] = Field(
        "tokens", description="tokens: pack whole sentences up to `size`; window: fixed windows every `step`")
    size: int | None = Field(None, ge=16, le=8192,
                             description="tokens per chunk; default: the model's max sequence length")
    overlap: int = Field(32, ge=0, description="tokens repeated from the previous chunk (tokens mode)")
    window: int | None = Field(None, ge=16, le=8192, description="window mode: tokens per window (RETA-LLM: 512)")
    step: int | None = Field(None, ge=1, description="window mode: stride in tokens (RETA-LLM: 256; default window/2)")
    prepend_title: bool = Field(True, description="start each chunk with the document title")
    min_tokens: int = Field(8, ge=1, description="drop trailing chunks shorter than this (unless the only one); "
                                                 "a shorter page joins its neighbour instead of being a chunk")
    structure: bool = Field(True, description="tokens mode: chunks break at page boundaries and at headings whose "
                                              "section does not fit the chunk before it, never inside a table row")
    prepend_section: bool = Field(False, description="start each chunk (after the title) with its section path "
                                                     "('Heading > Subheading', without its own heading when the "
                                                     "chunk opens with it): what the embedder and BM25 see. Off by "
                                                     "default: measured, see bench/section_context.py")

    @model_validator(mode="after")
    def _overlap_below_size(self) -> "Params":
        if self.mode == "tokens" and self.size is not None and self.overlap >= self.size:
            raise ValueError(f"overlap ({self.overlap}) must be smaller than size ({self.size})")
        if self.window is not None and self.step is not None and self.step > self.window:
            raise ValueError(f"step ({self.step}) must not exceed window ({self.window})")
        return self

    @model_serializer(mode="wrap")
    def _without_default_section(self, handler):
        """Left out while off, so the settings fingerprint of every existing index stays as it was."""
        dumped = handler(self)
        if not self.prepend_section:
            dumped.pop("prepend_section", None)
        return dumped


@stage("chunk", params=Params, produces="chunks", uses={"embedder": ("sentence_transformer",)}, kind="ingestion",
       version=5)
def chunk(documents: list[Document], params: Params, ctx: StepContext, embedder: Embedder) -> list[Chunk]:
    """Split documents into chunks measured in the embedding model's tokens."""
    if not documents:  # convert may drop a whole batch; fast tokenizers fail on an empty one
        ctx.progress("chunks", 0)
        return []
    tokenizer = embedder.tokenizer
    limit = embedder.max_seq_length - SPECIAL_TOKENS
    size = params.window or params.size or limit if params.mode == "window" else params.size or limit
    if size > limit:
        ctx.logger.warning("chunks of %d tokens exceed the model's %d: the model truncates them", size, limit)
    encodings = tokenizer([d.text for d in documents], add_special_tokens=False, return_offsets_mapping=True,
                          truncation=False, verbose=False)
    title_lengths = _title_lengths(tokenizer, documents) if params.prepend_title else [0] * len(documents)
    seconds = settings.documents().document_max_seconds
    chunks: list[Chunk] = []
    for i, doc in enumerate(documents):
        offsets, words = _bounded_tokens(encodings["offset_mapping"][i],
                                         encodings.word_ids(i) if hasattr(encodings, "word_ids") else None)
        budget = _ChunkingDeadline(doc, len(offsets), seconds, ctx)
        try:
            found = _document_chunks(doc, offsets, words, title_lengths[i], size, params, tokenizer, ctx, budget.tick)
        except BudgetExceeded as exc:
            ctx.fail(doc.source_id, str(exc))
            continue
        chunks.extend(found)
        if not found:
            ctx.fail(doc.source_id, "no text to chunk")
    ctx.progress("chunks", len(chunks))
    failpoints.hit("chunk.after_batch")
    return chunks


class _ChunkingDeadline:
    """One document's chunking deadline, checked between chunks, and its progress lines when it is
    long (over PROGRESS_CHARS): the only sign of life a run gives while it chunks a 10 MB file."""

    def __init__(self, doc: Document, tokens: int, seconds: float, ctx: StepContext):
        self.doc, self.tokens, self.seconds, self.ctx = doc, tokens, seconds, ctx
        self.deadline = time.monotonic() + seconds
        self.every = max(1, tokens // 10) if len(doc.text) > PROGRESS_CHARS else 0
        self.next = self.every

    def tick(self, token: int) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"chunking took over the document_max_seconds limit of {self.seconds:g} s")
        if self.every and token >= self.next:
            self.ctx.logger.info("chunking %s (%d characters): %d%% of its %d tokens", self.doc.source_id,
                                 len(self.doc.text), 100 * token // self.tokens, self.tokens)
            self.next = (token // self.every + 1) * self.every


def _bounded_tokens(offsets, words) -> tuple[list, list | None]:
    """The tokens with each one over LONG_TOKEN_CHARS cut into PIECE_CHARS pieces of one word (so a
    chunk ends between two only where no word boundary is near); unchanged when there is none."""
    if all(end - start <= LONG_TOKEN_CHARS for start, end in offsets):
        return offsets, words
    cut: list[tuple[int, int]] = []
    cut_words: list[int | None] = []
    for index, (start, end) in enumerate(offsets):
        pieces = [(start, end)] if end - start <= LONG_TOKEN_CHARS else \
            [(at, min(at + PIECE_CHARS, end)) for at in range(start, end, PIECE_CHARS)]
        cut.extend(pieces)
        cut_words.extend([words[index] if words is not None else None] * len(pieces))
    return cut, cut_words if words is not None else None


def _document_chunks(doc: Document, offsets, words, title_length: int, size: int, params: Params, tokenizer,
                     ctx: StepContext, tick: Callable[[int], None]) -> list[Chunk]:
    """One document's chunks (``tick`` is called with the token reached, between chunks)."""
    sections = _Sections(doc.text if doc.format not in PLAIN_FORMATS else "")
    tables = _tables(doc.text)
    title = doc.title if params.prepend_title else ""
    rooms = _path_lengths(tokenizer, sections, title, starts=[o[0] for o in offsets]) \
        if params.prepend_section else {}
    budget = max(16, size - title_length)
    # the title shrinks every window: a stride beyond it would skip text (or index past the end)
    step = min(params.step or max(1, budget // 2), budget)
    overlap = min(params.overlap, budget // 2)
    if rooms and (params.mode == "window" or not params.structure):  # one budget: room for the longest path
        budget = max(16, budget - min(max(rooms.values()), budget // 4))
        step = min(step, budget)
    if params.mode == "window":
        spans = [(s, e, j > 0) for j, (s, e) in enumerate(_window_spans(len(offsets), budget, step, tick))]
    elif params.structure:
        spans = _structure_spans(doc, offsets, words, budget, overlap, params.min_tokens, rooms, tick, tables)
    else:
        spans = [(s, e, j > 0) for j, (s, e) in
                 enumerate(_sentence_spans(doc.text, offsets, words, budget, overlap, tick=tick))]
    pieces = [(piece, offsets[s][0], offsets[e - 1][1]) for s, e, tail in spans
              if (piece := doc.text[offsets[s][0]:offsets[e - 1][1]].strip())
              and (not tail or e - s >= params.min_tokens)]
    chunks: list[Chunk] = []
    for ordinal, (piece, begin, end) in enumerate(pieces):
        context = sections.context(begin, piece, title) if params.prepend_section else ""
        held = [t for t in tables if t.start < end and begin < t.end]  # tables with rows in the piece
        if held and params.mode == "tokens" and params.structure and held[0].body <= begin:
            piece = f"{held[0].header}\n{piece}"  # a piece of a table after its first: its header again
        text = f"{context}\n{piece}" if context else piece
        text = f"{doc.title}\n{text}" if params.prepend_title and not _starts_with_title(piece, doc.title) \
            else text
        chunks.append(Chunk(chunk_id=chunk_id(ctx.fingerprint, doc.source_id, ordinal, text),
                            source_id=doc.source_id, ordinal=ordinal, text=text, title=doc.title,
                            metadata={**doc.metadata, "chunk": ordinal, **_where(doc, sections, begin, end),
                                      **_table_metadata(held, sections)}))
    return chunks


class _TextTable:
    """A Markdown table in a text: where it starts, where its rows after the header start, where it
    ends (character offsets), its header lines (the header row and the rule under it), its caption."""

    def __init__(self, start: int, body: int, end: int, header: str, caption: str):
        self.start, self.body, self.end, self.header, self.caption = start, body, end, header, caption


def _tables(text: str) -> list[_TextTable]:
    """The Markdown tables of a text: runs of '|' lines whose second line is a rule ('|---|---|').
    A table a PDF continues on the next page is one run (its pages are joined by one newline)."""
    found: list[_TextTable] = []
    if "|" not in text:
        return found
    lines, offset = [], 0
    for line in text.split("\n"):
        lines.append((offset, line))
        offset += len(line) + 1
    n = 0
    while n < len(lines):
        if not (n + 1 < len(lines) and lines[n][1].lstrip().startswith("|") and TABLE_RULE.match(lines[n + 1][1])):
            n += 1
            continue
        last = n + 1
        while last + 1 < len(lines) and lines[last + 1][1].lstrip().startswith("|"):
            last += 1
        start, rule_end = lines[n][0], lines[n + 1][0] + len(lines[n + 1][1])
        end = lines[last][0] + len(lines[last][1])
        found.append(_TextTable(start, min(rule_end + 1, end), end, text[start:rule_end], _caption(lines, n)))
        n = last + 1
    return found


def _caption(lines: list[tuple[int, str]], at: int) -> str:
    """The short line just before line ``at`` (a blank line between them allowed), '' when none."""
    for _, line in reversed(lines[max(0, at - 2):at]):
        if line.strip():
            line = line.strip().lstrip("#").strip()
            return line if len(line) <= CAPTION_CHARS and not line.startswith("|") else ""
    return ""


def _table_metadata(held: list[_TextTable], sections: "_Sections") -> dict[str, str | bool]:
    """``table: true`` for a chunk with table rows, and the caption of its first table (else the
    heading of the section the table is in)."""
    if not held:
        return {}
    caption = held[0].caption or sections.at(held[0].start).rsplit(" > ", 1)[-1]
    return {"table": True, **({"caption": caption} if caption else {})}


def _where(doc: Document, sections: "_Sections", begin: int, end: int) -> dict[str, str | int]:
    """The chunk's page range and section path, for the metadata (only the keys that apply)."""
    found: dict[str, str | int] = {}
    if doc.pages:
        found["page_start"] = doc.page_at(begin) or 1
        found["page_end"] = doc.page_at(max(begin, end - 1)) or found["page_start"]
    if section := sections.at(begin):
        found["section"] = section
    return found


class _Sections:
    """The Markdown headings of a text (outside fenced code), to name the section path at an offset."""

    def __init__(self, text: str):
        self.headings = _headings(text) if text else []
        self.starts = [offset for offset, _, _ in self.headings]
        self.heading_paths = _heading_paths(self.headings)

    def at(self, offset: int) -> str:
        at = bisect.bisect_right(self.starts, offset)
        return self.heading_paths[at - 1] if at else ""

    def context(self, offset: int, piece: str, title: str) -> str:
        """The section path to open a chunk with: without a leading heading that is the document's
        title (already prepended) and without its own heading when the piece opens with it."""
        path = _below_title(self.at(offset), title).split(" > ") if self.at(offset) else []
        if path and path[-1] and _starts_with_title(piece, path[-1]):
            path.pop()
        return " > ".join(p for p in path if p)

    def paths(self, title: str) -> list[tuple[int, str]]:
        """(offset, path below the title) of every section, to reserve room for its path."""
        return [(offset, path) for offset in self.starts if (path := _below_title(self.at(offset), title))]


def _heading_paths(headings: list[tuple[int, int, str]]) -> list[str]:
    """Each heading's section path ("Heading > Subheading"), built in one pass: looked up per chunk,
    a path rebuilt from the first heading each time made a long document's chunking quadratic."""
    stack: list[tuple[int, str]] = []
    paths = []
    for _, level, title in headings:
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, title))
        paths.append(" > ".join(t for _, t in stack))
    return paths


def _below_title(path: str, title: str) -> str:
    if title and (path == title.strip() or path.startswith(title.strip() + " > ")):
        return path[len(title.strip()):].removeprefix(" > ")
    return path


def _path_lengths(tokenizer, sections: "_Sections", title: str, starts: list[int]) -> dict[int, int]:
    """{first token of a section: tokens its path (below the title) takes, with its newline}."""
    paths = {bisect.bisect_left(starts, offset): path for offset, path in sections.paths(title)}
    if not paths:
        return {}
    texts = sorted(set(paths.values()))
    ids = tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    lengths = {text: len(t) + 1 for text, t in zip(texts, ids)}
    return {token: lengths[path] for token, path in paths.items()}


def _headings(text: str) -> list[tuple[int, int, str]]:
    """(offset, level, title) of each '#' heading line outside fenced code blocks."""
    found, fenced, offset = [], False, 0
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := MD_HEADING.match(line)):
            found.append((offset, len(match.group(1)), match.group(2).strip()))
        offset += len(line) + 1
    return found


def _structure_spans(doc: Document, offsets, words, budget: int, overlap: int, min_tokens: int,
                     rooms: dict[int, int] | None = None, tick: Callable[[int], None] | None = None,
                     tables: list[_TextTable] | None = None) -> list[tuple[int, int, bool]]:
    """(start, end, is_tail) token spans that follow the document's pages and sections.

    Pages are hard boundaries, except a page under ``min_tokens`` tokens, which joins the page
    before it (a page number or a lone caption is no chunk of its own). Within a page, consecutive
    sections are packed while they fit ``budget`` together; a larger section is split on its own by
    sentences (with ``overlap``), and its last pieces are tails (dropped when tiny, as before). No
    span ends inside a Markdown table row unless one row alone exceeds the budget. A table's start
    and end are cuts like headings; a section of table rows is split with room left for its header
    lines, which the pieces after the first repeat."""
    n = len(offsets)
    if n == 0:
        return []
    starts = [start for start, _ in offsets]
    def token_at(char: int) -> int:
        return bisect.bisect_left(starts, char)
    pages = _merge_small([0, *sorted({t for c in doc.pages[1:] if 0 < (t := token_at(c)) < n}), n], min_tokens)
    tables = tables or []
    headings = sorted({token_at(offset) for offset, _, _ in
                       (_headings(doc.text) if doc.format not in PLAIN_FORMATS else [])}
                      | {token_at(at) for t in tables for at in (t.start, t.end)} - {n})
    # (first body token, end token, tokens of the header lines) of each table, for the room it takes
    heads = [(token_at(t.body), token_at(t.end), token_at(t.body) - token_at(t.start)) for t in tables]
    blocked = _inside_table_rows(doc.text, starts)
    spans: list[tuple[int, int, bool]] = []
    for page_start, page_end in zip(pages, pages[1:]):
        inside = headings[bisect.bisect_right(headings, page_start):bisect.bisect_left(headings, page_end)]
        cuts = [page_start, *inside, page_end]
        for group_start, group_end in _pack(cuts, budget, rooms or {}):
            room = _room(rooms or {}, group_start, budget)
            # a group that opens inside a table's rows, or is split inside one: its pieces may open
            # with the table's header lines, so they leave room for them
            opening = any(b <= group_start < e for b, e, _ in heads)
            if opening or group_end - group_start > budget - room:
                room += min(max((h for b, e, h in heads if b < group_end and group_start < e), default=0),
                            (budget - room) // 2)
            pieces = _sentence_spans(doc.text, offsets, words, budget - room, overlap, group_start, group_end,
                                     blocked, tick)
            spans.extend((s, e, j > 0) for j, (s, e) in enumerate(pieces))
    return spans


def _merge_small(bounds: list[int], min_tokens: int) -> list[int]:
    """Page boundaries without those of pages shorter than ``min_tokens``: such a page joins the
    page before it (the first page, the one after it)."""
    kept = [bounds[0]]
    for start, end in zip(bounds[1:-1], bounds[2:]):
        if end - start >= min_tokens:
            kept.append(start)
    if len(kept) > 1 and kept[1] - kept[0] < min_tokens:
        kept.pop(1)
    return [*kept, bounds[-1]]


def _pack(cuts: list[int], budget: int, rooms: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Consecutive sections (between ``cuts``) grouped while a group fits ``budget`` tokens (less
    the room its section path takes, with ``prepend_section``)."""
    groups: list[tuple[int, int]] = []
    for start, end in zip(cuts, cuts[1:]):
        if groups and end - groups[-1][0] <= budget - _room(rooms or {}, groups[-1][0], budget):
            groups[-1] = (groups[-1][0], end)
        else:
            groups.append((start, end))
    return groups


def _room(rooms: dict[int, int], token: int, budget: int) -> int:
    """Tokens the section path of the section holding ``token`` takes (at most a quarter of the budget)."""
    if not rooms:
        return 0
    starts = sorted(rooms)
    at = bisect.bisect_right(starts, token) - 1
    return min(rooms[starts[at]], budget // 4) if at >= 0 else 0


def _inside_table_rows(text: str, starts: list[int]) -> frozenset[int]:
    """Tokens that start inside a Markdown table row (after its first character): no chunk starts there."""
    blocked: set[int] = set()
    for row in TABLE_ROW.finditer(text):
        first = bisect.bisect_right(starts, row.start())
        last = bisect.bisect_left(starts, row.end())
        blocked.update(range(first, last))
    return frozenset(blocked)


def _starts_with_title(piece: str, title: str) -> bool:
    """True when there is no title, or the piece already opens with it (e.g. a markdown heading)."""
    first_line = piece.split("\n", 1)[0].lstrip("# ").strip()
    return not title or first_line == title.strip()


def chunk_id(fingerprint: str, source_id: str, ordinal: int, text: str) -> str:
    """Content-derived id: the same text under the same settings always gets the same id."""
    return hashlib.sha256(f"{fingerprint}\0{source_id}\0{ordinal}\0{text}".encode()).hexdigest()[:32]


def _title_lengths(tokenizer, documents: list[Document]) -> list[int]:
    titles = [d.title for d in documents]
    if not any(titles):
        return [0] * len(documents)
    ids = tokenizer(titles, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    return [len(t) + 1 if title else 0 for t, title in zip(ids, titles)]


def _window_spans(n: int, window: int, step: int, tick: Callable[[int], None] | None = None
                  ) -> list[tuple[int, int]]:
    if n == 0:
        return []
    spans, start = [], 0
    while True:
        if tick is not None:
            tick(start)
        spans.append((start, min(start + window, n)))
        if start + window >= n:
            return spans
        start += step


def _sentence_spans(text: str, offsets, words, size: int, overlap: int, low: int = 0, high: int | None = None,
                    blocked: frozenset[int] = frozenset(), tick: Callable[[int], None] | None = None
                    ) -> list[tuple[int, int]]:
    """Token spans of at most ``size`` in [low, high) that end at sentence ends (else word ends)
    where possible, and never before a ``blocked`` token (inside a table row) unless they must;
    ``tick`` is told the token each span starts at (the document's budget and progress)."""
    n = len(offsets) if high is None else high
    spans: list[tuple[int, int]] = []
    start = low
    while start < n:
        if tick is not None:
            tick(start)
        end = min(start + size, n)
        if end < n:
            end = _best_break(text, offsets, words, start, end, blocked)
        spans.append((start, end))
        if end >= n:
            break
        start = _word_start(text, offsets, words, max(end - overlap, start + 1), end, blocked)
    return spans


def _best_break(text: str, offsets, words, start: int, end: int, blocked: frozenset[int] = frozenset()) -> int:
    """The last sentence end in the second half of the span, else the last word boundary (a
    boundary inside a table row is neither: a row is cut only when it alone exceeds the span)."""
    for cut in range(end, start + (end - start) // 2, -1):
        if cut not in blocked and not _joined(text, offsets, cut) \
                and text[offsets[cut - 1][0]:offsets[cut][0]].rstrip(" \t").endswith(SENTENCE_END):
            return cut
    for cut in range(end, start, -1):
        if cut not in blocked and (words is None or words[cut] != words[cut - 1]) and not _joined(text, offsets, cut):
            return cut
    return end


def _joined(text: str, offsets, cut: int) -> bool:
    """True when tokens cut-1 and cut are one written word split at punctuation ("3.5", "COVID-19").

    The tokenizer's words end at every punctuation mark; a chunk may only break where whitespace
    separates the tokens (or between characters of unspaced scripts such as CJK)."""
    left, right = offsets[cut - 1][1], offsets[cut][0]
    if any(ch.isspace() for ch in text[left:right + 1]):
        return False
    return text[left - 1:left].isascii() or text[right:right + 1].isascii()


def _word_start(text: str, offsets, words, index: int, limit: int, blocked: frozenset[int] = frozenset()) -> int:
    """Move forward so a chunk never starts in the middle of a word or a table row (nor past ``limit``)."""
    while 0 < index < limit and (index in blocked or (
            words is not None and index < len(words) and words[index] is not None
            and (words[index] == words[index - 1] or _joined(text, offsets, index)))):
        index += 1
    return index
