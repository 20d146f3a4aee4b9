"""Context expansion ("small-to-big"): each hit grows into the neighbouring chunks of its source,
within a token budget, so the generator reads the sentences around what matched.

Small chunks retrieve precisely; the answer often needs the text on either side (RETA-LLM hands
the generator whole documents). The neighbours come from the index state (same source, ordinal
within ``neighbours``; a large value reaches the whole document), read-only. A window grows one
chunk at a time on alternate sides while it fits ``max_tokens`` (the embedder's tokens, the unit
chunks are cut in) and stops at a chunk an earlier hit already shows: no text is given twice,
and a hit that an earlier window holds is dropped. The chunks' repeated overlap and title lines
are stitched out. Over named collections each hit grows in the index of the collection it came
from (its ``metadata.collection``).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.state import IndexState, StoreMissing
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.collection_index import COLLECTION_KEY, in_collection

MIN_OVERLAP_CHARS = 4  # a shorter shared edge ("a", "the") may be a coincidence, not the chunker's overlap


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    neighbours: int = Field(1, ge=0, le=10_000, description="chunks on each side of a hit (large: the whole "
                                                            "source document, as far as max_tokens allows)")
    max_tokens: int = Field(512, ge=16, le=32_768, description="budget of one expanded passage, hit included")
    top_k: int = Field(10, ge=1, le=1000, description="hits expanded; later ones pass unchanged (de-duplicated)")


@stage("expand_context", params=Params, produces="passages", kind="query",
       uses={"state": ("index_state",), "embedder": ("sentence_transformer",)})
def expand_context(query: Query, passages: list[Passage], params: Params, ctx: StepContext, state: IndexState,
                   embedder: Embedder) -> list[Passage]:
    """Grow the top hits into their neighbouring chunks within a token budget, without repeats; only
    into chunks the query may read (``Query.access``)."""
    head = passages[: params.top_k]
    around: dict[str, list[tuple[str, int, str]]] = {}
    for collection, chunk_ids in by_collection(head).items():
        try:
            around.update(in_collection(ctx, "state", state, collection).neighbourhoods(chunk_ids, params.neighbours, query.access))
        except StoreMissing as exc:
            ctx.logger.warning("context not expanded: %s", exc)
    texts = {cid: text for rows in around.values() for cid, _, text in rows}
    tokens = dict(zip(texts, token_counts(embedder, list(texts.values()))))
    shown: set[str] = set()
    out: list[Passage] = []
    for rank, passage in enumerate(passages):
        if passage.chunk_id in shown:
            continue  # an earlier hit's window holds it
        rows = around.get(passage.chunk_id) if rank < params.top_k else None
        if not rows:
            shown.add(passage.chunk_id)
            out.append(passage)
            continue
        window = grow(rows, passage.chunk_id, tokens, shown, params.max_tokens)
        shown.update(rows[i][0] for i in window)
        out.append(expanded(passage, [rows[i] for i in window]))
    return out


def by_collection(head: list[Passage]) -> dict[str | None, list[str]]:
    """The hits' chunk ids by the collection each came from (None: the file declares none)."""
    grouped: dict[str | None, list[str]] = {}
    for passage in head:
        grouped.setdefault(passage.metadata.get(COLLECTION_KEY), []).append(passage.chunk_id)
    return grouped


def token_counts(embedder: Embedder, texts: list[str]) -> list[int]:
    if not texts:
        return []
    encoded = embedder.tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)
    return [len(ids) for ids in encoded["input_ids"]]


def grow(rows: list[tuple[str, int, str]], hit: str, tokens: dict[str, int], shown: set[str],
         budget: int) -> range:
    """Positions in ``rows`` of the window around the hit: neighbours added on alternate sides,
    next first, while each fits the budget, is contiguous and was not shown by an earlier hit."""
    at = next(i for i, row in enumerate(rows) if row[0] == hit)
    first, last, used = at, at, tokens.get(hit, 0)
    open_sides = {+1: True, -1: True}
    while any(open_sides.values()):
        for side in (+1, -1):
            if not open_sides[side]:
                continue
            i = last + 1 if side > 0 else first - 1
            ok = 0 <= i < len(rows) and rows[i][1] == rows[last if side > 0 else first][1] + side \
                and rows[i][0] not in shown and used + tokens.get(rows[i][0], 0) <= budget
            if not ok:
                open_sides[side] = False
                continue
            used += tokens.get(rows[i][0], 0)
            first, last = (first, i) if side > 0 else (i, last)
    return range(first, last + 1)


def expanded(passage: Passage, rows: list[tuple[str, int, str]]) -> Passage:
    if len(rows) == 1:
        return passage
    text = rows[0][2]
    for _, _, piece in rows[1:]:
        text = stitch(text, untitled(piece, passage.title))
    return passage.model_copy(update={
        "text": text, "original_text": passage.original_text or passage.text,
        "metadata": {**passage.metadata, "context_chunks": f"{rows[0][1]}-{rows[-1][1]}"}})


def untitled(piece: str, title: str) -> str:
    """A chunk without the title line the chunker opens every chunk with."""
    return piece[len(title) + 1:] if title and piece.startswith(title + "\n") else piece


def stitch(left: str, right: str) -> str:
    """``left`` then ``right`` without the text they share (the chunker's overlap): the longest end
    of ``left`` that ``right`` opens with, whole words only and at least MIN_OVERLAP_CHARS long."""
    for start in range(max(0, len(left) - len(right)), len(left) - MIN_OVERLAP_CHARS + 1):
        if (start == 0 or left[start - 1].isspace()) and right.startswith(left[start:]):
            shared = len(left) - start
            if shared == len(right) or not (right[shared - 1].isalnum() and right[shared].isalnum()):
                return left + right[shared:]
    return f"{left}\n{right}"
