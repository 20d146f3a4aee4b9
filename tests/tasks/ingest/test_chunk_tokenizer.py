"""The chunker with the Rust tokenizer (flows.resources.chunking_tokenizer, issue 22) cuts exactly the
chunks it cut with transformers' tokenizer (the fallback): same ids, texts and metadata, for SciFact
abstracts and for Markdown, paged and multilingual documents, under every chunking mode; so the
stage's version stays. Context expansion counts the same tokens too."""
from __future__ import annotations

import pytest

import ragline.flows.resources.models.embedder as embedder_module
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.resources.models.chunking_tokenizer import ChunkingTokenizer
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.chunk import Params, chunk
from ragline.tasks.refine.expand_context import token_counts
from tests.helpers.data import scifact_records

MARKDOWN = """# Study design

Patients (n = 1,024) were randomised 1:1. The primary end-point was p<0.05 at 3.5 years; COVID-19 cases
were excluded. Résumé of the naïve cohort — see Table 1.

## Table 1

| arm | n | HR (95% CI) |
|-----|---|-------------|
| aspirin | 512 | 0.75 (0.61–0.92) |
| placebo | 512 | 1.00 |

```python
def hazard(x):
    return x ** 2  # not a heading
# not a heading either
```

## Results 結果

中文文本的分词测试。日本語のテキスト、한국어 텍스트도 있습니다。Emoji 😀👍🏽 and 👨‍👩‍👧‍👦 too.
""" + "The treatment response was well-known among interleukin-6 receptor cohorts. " * 30


def documents() -> list[Document]:
    docs = [Document(source_id=f"scifact/{r['_id']}", title=r["title"], text=r["text"], format="jsonl")
            for r in scifact_records(150)]
    pages = "".join(f"Page {n} text about membrane receptors and signal pathways. " * (n * 7) for n in range(1, 5))
    starts = [0, *[pages.index(f"Page {n} ") for n in range(2, 5)]]
    return docs + [
        Document(source_id="md", title="Study design", text=MARKDOWN, format="markdown"),
        Document(source_id="pdf", title="Paged", text=pages, format="pdf", pages=starts),
        Document(source_id="ctrl", title="Control \x07 chars", text="tab\there\x00nul " * 80 + "\u200b zero width"),
        Document(source_id="short", title="", text="One line."),
    ]


def chunks_of(embedder: Embedder, docs: list[Document], **params) -> list[tuple]:
    out = chunk.fn(documents=docs, params=Params(**params), ctx=StepContext(pipeline="t", step_id="c",
                                                                            fingerprint="fp"), embedder=embedder)
    return [(c.chunk_id, c.source_id, c.ordinal, c.text, c.metadata) for c in out]


@pytest.fixture(scope="module")
def pair():
    """A fresh embedder on the Rust shortcut and one on transformers' tokenizer (the fallback branch
    of Embedder._load_chunking_tokenizer, taken as for a folder the shortcut refuses); neither model loads."""
    rust = Embedder(EmbedderSpec(type="sentence_transformer"))
    assert isinstance(rust.tokenizer, ChunkingTokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(embedder_module, "load_chunking_tokenizer", lambda folder: None)
        fallback = Embedder(EmbedderSpec(type="sentence_transformer"))
        assert type(fallback.tokenizer).__module__.startswith("transformers")
    yield rust, fallback
    assert not rust._model.loaded and not fallback._model.loaded


@pytest.mark.parametrize("params", [
    {},
    {"size": 64, "overlap": 8},
    {"size": 32, "overlap": 8, "prepend_section": True},
    {"size": 48, "structure": False, "prepend_title": False},
    {"mode": "window", "window": 64, "step": 24},
    {"mode": "window", "window": 40, "prepend_section": True},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
def test_the_chunks_are_those_of_transformers_tokenizer(pair, params):
    rust, fallback = pair
    docs = documents()
    got = chunks_of(rust, docs, **params)
    assert len(got) > len(docs)  # long abstracts and documents are cut
    assert got == chunks_of(fallback, docs, **params)


def test_context_expansion_counts_the_same_tokens(pair):
    rust, fallback = pair
    texts = [d.text for d in documents()]
    counts = token_counts(rust, texts)
    assert counts == token_counts(fallback, texts) and max(counts) > 300
