"""Token-aware chunking with the embedder's own tokenizer, so chunks fit the model exactly."""
from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows import failpoints
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document
from ragline.flows.spec.registry import stage
from ragline.flows.resources.embedder import Embedder

SPECIAL_TOKENS = 2  # [CLS] and [SEP] (or <s>, </s>) take room in every sequence
SENTENCE_END = (".", "!", "?", ":", ";", "\n")


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
    min_tokens: int = Field(8, ge=1, description="drop trailing chunks shorter than this (unless the only one)")

    @model_validator(mode="after")
    def _overlap_below_size(self) -> "Params":
        if self.mode == "tokens" and self.size is not None and self.overlap >= self.size:
            raise ValueError(f"overlap ({self.overlap}) must be smaller than size ({self.size})")
        if self.window is not None and self.step is not None and self.step > self.window:
            raise ValueError(f"step ({self.step}) must not exceed window ({self.window})")
        return self


@stage("chunk", params=Params, produces="chunks", uses={"embedder": ("sentence_transformer",)}, kind="ingestion",
       version=3)
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
    chunks: list[Chunk] = []
    for i, doc in enumerate(documents):
        offsets = encodings["offset_mapping"][i]
        words = encodings.word_ids(i) if hasattr(encodings, "word_ids") else None
        budget = max(16, size - title_lengths[i])
        # the title shrinks every window: a stride beyond it would skip text (or index past the end)
        step = min(params.step or max(1, budget // 2), budget)
        spans = (_window_spans(len(offsets), budget, step) if params.mode == "window"
                 else _sentence_spans(doc.text, offsets, words, budget, min(params.overlap, budget // 2)))
        pieces = [doc.text[offsets[s][0]:offsets[e - 1][1]].strip() for s, e in spans]
        pieces = [p for j, p in enumerate(pieces) if p and (j == 0 or spans[j][1] - spans[j][0] >= params.min_tokens)]
        for ordinal, piece in enumerate(pieces):
            text = f"{doc.title}\n{piece}" if params.prepend_title and not _starts_with_title(piece, doc.title) \
                else piece
            chunks.append(Chunk(chunk_id=chunk_id(ctx.fingerprint, doc.source_id, ordinal, text),
                                source_id=doc.source_id, ordinal=ordinal, text=text, title=doc.title,
                                metadata={**doc.metadata, "chunk": ordinal}))
        if not pieces:
            ctx.fail(doc.source_id, "no text to chunk")
    ctx.progress("chunks", len(chunks))
    failpoints.hit("chunk.after_batch")
    return chunks


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


def _window_spans(n: int, window: int, step: int) -> list[tuple[int, int]]:
    if n == 0:
        return []
    spans, start = [], 0
    while True:
        spans.append((start, min(start + window, n)))
        if start + window >= n:
            return spans
        start += step


def _sentence_spans(text: str, offsets, words, size: int, overlap: int) -> list[tuple[int, int]]:
    """Token spans of at most ``size`` that end at sentence ends (else word ends) where possible."""
    n = len(offsets)
    spans: list[tuple[int, int]] = []
    start = 0
    while start < n:
        end = min(start + size, n)
        if end < n:
            end = _best_break(text, offsets, words, start, end)
        spans.append((start, end))
        if end >= n:
            break
        start = _word_start(text, offsets, words, max(end - overlap, start + 1), end)
    return spans


def _best_break(text: str, offsets, words, start: int, end: int) -> int:
    """The last sentence end in the second half of the span, else the last word boundary."""
    for cut in range(end, start + (end - start) // 2, -1):
        if not _joined(text, offsets, cut) \
                and text[offsets[cut - 1][0]:offsets[cut][0]].rstrip(" \t").endswith(SENTENCE_END):
            return cut
    for cut in range(end, start, -1):
        if (words is None or words[cut] != words[cut - 1]) and not _joined(text, offsets, cut):
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


def _word_start(text: str, offsets, words, index: int, limit: int) -> int:
    """Move forward so a chunk never starts in the middle of a word (nor past ``limit``)."""
    while words is not None and 0 < index < min(len(words), limit) and words[index] is not None \
            and (words[index] == words[index - 1] or _joined(text, offsets, index)):
        index += 1
    return index
