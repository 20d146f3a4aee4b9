"""Unit tests for the ``chunk`` stage with the real MiniLM tokenizer (token budgets, overlap, windows, ids)."""
from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.tasks.ingest.chunk import Params, chunk, chunk_id

WORDS = ("protein cell membrane receptor binding pathway expression signal tumour growth factor "
         "analysis cohort patients treatment response mitochondria inflammation antibody vaccine "
         "well-known COVID-19 3.5 0.75 don't antidisestablishmentarianism e.g. interleukin-6 p<0.05").split()


def sentences(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        out.append(words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice([".", ".", "!", "?"]))
    return " ".join(out)


def run(docs, embedder, fingerprint: str = "fp", **params):
    ctx = StepContext(pipeline="t", step_id="chunk", fingerprint=fingerprint)
    if isinstance(docs, str):
        docs = [Document(source_id="doc", text=docs)]
    return chunk.fn(documents=docs, params=Params(**params), ctx=ctx, embedder=embedder), ctx


def ntok(embedder, text: str) -> int:
    return len(embedder.tokenizer(text, add_special_tokens=False)["input_ids"])


def body(c) -> str:
    return c.text.split("\n", 1)[1] if c.title else c.text


def char_spans(text: str, chunks) -> list[tuple[int, int]]:
    """Where each chunk's body lies in the document text (chunks are verbatim substrings, in order)."""
    spans, pos = [], 0
    for c in chunks:
        start = text.find(body(c), pos)
        assert start >= 0, f"chunk {c.ordinal} is not a substring of the document after {pos}"
        spans.append((start, start + len(body(c))))
        pos = start
    return spans


LONG = sentences(80)


@pytest.mark.parametrize("size", [16, 32, 64, 100])
def test_every_chunk_fits_size(minilm, size):
    chunks, _ = run(LONG, minilm, size=size, overlap=min(8, size - 1))
    assert len(chunks) > 3
    counts = [ntok(minilm, c.text) for c in chunks]
    assert max(counts) <= size
    assert max(counts) > size * 0.6  # chunks are packed, not tiny


def test_chunks_with_title_fit_size_including_title(minilm):
    title = "Effects of interleukin-6 on tumour growth"
    doc = Document(source_id="d", text=LONG, title=title)
    chunks, _ = run([doc], minilm, size=48, overlap=8)
    assert len(chunks) > 3
    for c in chunks:
        assert c.text.startswith(title + "\n")
        assert c.title == title
        assert ntok(minilm, c.text) <= 48
        assert ntok(minilm, body(c)) <= 48 - ntok(minilm, title)


def test_default_size_is_model_max_minus_special_tokens(minilm):
    assert minilm.max_seq_length == 256
    chunks, _ = run(sentences(150, seed=3), minilm)
    counts = [ntok(minilm, c.text) for c in chunks]
    assert len(chunks) >= 3
    assert max(counts) <= 254
    assert max(counts) > 200  # far more than any explicit small size


def test_overlap_between_consecutive_chunks(minilm):
    chunks, _ = run(LONG, minilm, size=64, overlap=16)
    spans = char_spans(LONG, chunks)
    for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
        assert s1 < s2 < e1 < e2  # the next chunk starts inside the previous one and goes further
        shared = ntok(minilm, LONG[s2:e1])
        assert 16 - 8 <= shared <= 16  # the overlap, less at most a word moved to a word start


def test_no_overlap_gives_contiguous_chunks(minilm):
    chunks, _ = run(LONG, minilm, size=64, overlap=0, min_tokens=1)
    spans = char_spans(LONG, chunks)
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2
        assert LONG[e1:s2].strip() == ""  # nothing is skipped between chunks
    assert spans[0][0] == 0 and spans[-1][1] == len(LONG)


def test_chunks_end_at_sentence_ends(minilm):
    chunks, _ = run(LONG, minilm, size=64, overlap=8)
    assert len(chunks) > 5
    for c in chunks:
        assert c.text.endswith((".", "!", "?")), c.text[-40:]


@pytest.mark.parametrize("text", [LONG, LONG.replace(".", "").replace("!", "").replace("?", "")])
def test_never_splits_a_word(minilm, text):
    vocabulary = set(text.split())
    for size in (16, 24, 40):
        chunks, _ = run(text, minilm, size=size, overlap=5)
        for c in chunks:
            for word in c.text.split():
                assert word in vocabulary, f"size {size}: chunk {c.ordinal} has a broken word {word!r}"


def test_a_word_longer_than_the_budget_is_cut_but_nothing_is_lost(minilm):
    # one word of far more than 32 tokens (under 100 characters: BERT makes longer words one [UNK])
    rng = random.Random(7)
    giant = "".join(rng.choice("qxzvkjwy") for _ in range(99))
    assert ntok(minilm, giant) > 64
    text = f"start {giant} end"
    chunks, _ = run(text, minilm, size=32, overlap=4, min_tokens=1)
    assert all(ntok(minilm, c.text) <= 32 for c in chunks)
    spans = char_spans(text, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert s2 <= e1 or text[e1:s2].strip() == ""  # nothing between chunks is skipped


def test_window_mode_covers_the_whole_text(minilm):
    chunks, _ = run(LONG, minilm, mode="window", window=32, step=16)
    n = ntok(minilm, LONG)
    assert n > 200
    # windows are cut at token boundaries, even inside a word; a word fragment at either edge can
    # re-tokenize into one more token
    assert all(ntok(minilm, c.text) <= 32 + 2 for c in chunks)
    assert len(chunks) == -(-(n - 32) // 16) + 1  # ceil((n - window) / step) + 1 windows
    spans = char_spans(LONG, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == len(LONG)
    for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
        assert s1 < s2 < e1 < e2  # windows overlap by window - step tokens
    # consecutive windows start step tokens apart
    starts = [ntok(minilm, LONG[:s]) for s, _ in spans]
    assert all(16 <= b - a <= 17 for a, b in zip(starts, starts[1:]))


def test_window_mode_default_step_is_half_the_window(minilm):
    chunks, _ = run(LONG, minilm, mode="window", window=40)
    spans = char_spans(LONG, chunks)
    starts = [ntok(minilm, LONG[:s]) for s, _ in spans]
    assert all(20 <= b - a <= 21 for a, b in zip(starts, starts[1:]))


def test_window_mode_uses_size_when_no_window(minilm):
    chunks, _ = run(LONG, minilm, mode="window", size=24, step=24, min_tokens=1)
    spans = char_spans(LONG, chunks)
    assert 20 <= max(ntok(minilm, c.text) for c in chunks) <= 24 + 2
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2 and LONG[e1:s2].strip() == ""
    assert spans[-1][1] == len(LONG)


@pytest.mark.parametrize("params", [dict(window=40, step=40), dict(size=40, step=60), dict(window=64, step=50)])
def test_window_mode_with_title_leaves_no_gaps(minilm, params):
    # the title takes room in every window; the stride must shrink with it, or text is skipped
    title = "A rather long document title with many many tokens in it indeed"
    doc = Document(source_id="d", text=LONG, title=title)
    chunks, _ = run([doc], minilm, mode="window", min_tokens=1, **params)
    spans = char_spans(LONG, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == len(LONG)
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert s2 <= e1 or LONG[e1:s2].strip() == ""


def test_chunk_fields_and_ordinals(minilm):
    doc = Document(source_id="papers/a.md", text=LONG, title="T", metadata={"lang": "en", "year": 2020})
    chunks, _ = run([doc], minilm, size=64)
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert c.source_id == "papers/a.md"
        assert c.metadata == {"lang": "en", "year": 2020, "chunk": c.ordinal}
        assert c.embedding is None
        assert re.fullmatch(r"[0-9a-f]{32}", c.chunk_id)
    assert len({c.chunk_id for c in chunks}) == len(chunks)


def test_chunk_ids_are_deterministic(minilm):
    first, _ = run(LONG, minilm, size=64)
    again, _ = run(LONG, minilm, size=64)
    assert [c.chunk_id for c in first] == [c.chunk_id for c in again]
    assert first[0].chunk_id == chunk_id("fp", "doc", 0, first[0].text)


def test_chunk_ids_change_with_fingerprint_and_text(minilm):
    base, _ = run(LONG, minilm, size=64)
    other_fp, _ = run(LONG, minilm, fingerprint="fp2", size=64)
    assert [c.text for c in base] == [c.text for c in other_fp]
    assert not {c.chunk_id for c in base} & {c.chunk_id for c in other_fp}

    edited = LONG.replace("Protein", "Lipid", 1) if "Protein" in LONG[:200] else "Lipid " + LONG
    changed, _ = run(edited, minilm, size=64)
    assert changed[0].chunk_id != base[0].chunk_id
    assert changed[-1].chunk_id == base[-1].chunk_id  # untouched tail chunks keep their ids
    assert chunk_id("fp", "a", 0, "x") != chunk_id("fp", "b", 0, "x") != chunk_id("fp", "b", 1, "x")


def test_empty_and_whitespace_documents_are_reported(minilm):
    docs = [Document(source_id="empty", text=""), Document(source_id="ok", text="A real sentence here."),
            Document(source_id="blank", text=" \n\t  ")]
    chunks, ctx = run(docs, minilm)
    assert [c.source_id for c in chunks] == ["ok"]
    assert [(f.source_id, f.stage) for f in ctx.failures] == [("empty", "chunk"), ("blank", "chunk")]
    assert all(f.reason for f in ctx.failures)


def test_short_document_is_one_chunk(minilm):
    chunks, ctx = run("  Just one short sentence.  ", minilm, min_tokens=50)
    assert [c.text for c in chunks] == ["Just one short sentence."]
    assert ctx.failures == []


def test_title_prepending(minilm):
    doc = Document(source_id="d", text="Body text here.", title="My Title")
    with_title, _ = run([doc], minilm)
    without, _ = run([doc], minilm, prepend_title=False)
    no_title, _ = run([Document(source_id="d", text="Body text here.")], minilm)
    assert with_title[0].text == "My Title\nBody text here."
    assert without[0].text == "Body text here."
    assert without[0].title == "My Title"
    assert no_title[0].text == "Body text here."


def test_several_documents_keep_their_order(minilm):
    docs = [Document(source_id=f"d{i}", text=sentences(20, seed=i)) for i in range(3)]
    chunks, _ = run(docs, minilm, size=64)
    sources = [c.source_id for c in chunks]
    assert sources == sorted(sources)
    assert set(sources) == {"d0", "d1", "d2"}


def test_progress_is_reported(minilm):
    seen = []
    ctx = StepContext(pipeline="t", step_id="chunk", fingerprint="fp", on_progress=lambda u, n: seen.append((u, n)))
    out = chunk.fn(documents=[Document(source_id="d", text=LONG)], params=Params(size=64), ctx=ctx, embedder=minilm)
    assert seen == [("chunks", len(out))]


def test_params_validation():
    with pytest.raises(ValidationError, match="overlap"):
        Params(size=32, overlap=32)
    with pytest.raises(ValidationError, match="overlap"):
        Params(size=32, overlap=40)
    Params(size=32, overlap=31)
    with pytest.raises(ValidationError, match="step"):
        Params(mode="window", window=32, step=33)
    Params(mode="window", window=32, step=32)
    with pytest.raises(ValidationError):
        Params(size=8)
    with pytest.raises(ValidationError):
        Params(mode="sentences")
    with pytest.raises(ValidationError):
        Params(chunk_size=100)


class _NoModel:
    """An embedder that must not be touched: an empty batch needs neither tokenizer nor model."""

    def __getattr__(self, name):
        raise AssertionError(f"the embedder's {name} was used for an empty batch")


@pytest.mark.parametrize("mode", ["tokens", "window"])
def test_empty_batch_returns_nothing_without_the_model(minilm, mode):
    # convert can drop every document of a batch (e.g. one HTML page with no text)
    seen = []
    ctx = StepContext(pipeline="t", step_id="chunk", fingerprint="fp", on_progress=lambda u, n: seen.append((u, n)))
    assert chunk.fn(documents=[], params=Params(mode=mode), ctx=ctx, embedder=_NoModel()) == []
    assert chunk.fn(documents=[], params=Params(mode=mode), ctx=ctx, embedder=minilm) == []
    assert ctx.failures == [] and seen == [("chunks", 0), ("chunks", 0)]


# --- issue 39 item 6: a 10 MB line, progress, the per-document budget ----------------------------

def test_a_2_mb_line_without_spaces_is_chunked_into_bounded_chunks_with_progress_lines(minilm, caplog):
    """WordPiece reads a word over 100 characters as one unknown token: a 10 MB line was one chunk."""
    line = "0123456789abcdefghij" * 100_000
    doc = Document(source_id="line.txt", text=line, format="text")
    with caplog.at_level("INFO"):
        chunks, ctx = run([doc], minilm, prepend_title=False)
    assert not ctx.failures and len(chunks) > 400
    assert max(len(c.text) for c in chunks) <= 254 * 16  # a chunk's tokens, each piece at most 16 characters
    assert "".join(c.text for c in chunks) == line  # in order, nothing lost, nothing twice
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chunking line.txt")]
    assert len(progress) >= 9 and "(2000000 characters): 10% of its" in progress[0], progress[:2]


def test_a_word_over_100_characters_in_a_sentence_is_cut_and_the_rest_chunks_as_before(minilm):
    token = "x" * 5000
    text = f"{LONG} {token} {LONG}"
    chunks, _ = run(text, minilm, size=64, overlap=8, prepend_title=False)
    assert max(len(c.text) for c in chunks) <= 64 * 16 + 2000  # words of LONG are short, the long one cut
    assert token[:1000] in "".join(c.text for c in chunks)
    before, _ = run(LONG, minilm, size=64, overlap=8, prepend_title=False)
    assert [c.text for c in chunks[:len(before) - 1]] == [c.text for c in before[:-1]]


def test_a_document_past_its_chunking_time_is_skipped_with_the_reason(minilm, monkeypatch):
    monkeypatch.setenv("RAGLINE_DOCUMENT_MAX_SECONDS", "0.000000001")
    docs = [Document(source_id="a", text=LONG), Document(source_id="b", text=sentences(10, seed=2))]
    chunks, ctx = run(docs, minilm)
    assert chunks == []
    assert {f.source_id: f.reason for f in ctx.failures} == dict.fromkeys(
        "ab", "chunking took over the document_max_seconds limit of 1e-09 s")
    monkeypatch.delenv("RAGLINE_DOCUMENT_MAX_SECONDS")
    assert {c.source_id for c in run(docs, minilm)[0]} == {"a", "b"}
