"""The chunker's tokenizer without transformers (flows.resources.chunking_tokenizer, issue 22): the
packaged MiniLM's tokenizer.json through the Rust package gives exactly PreTrainedTokenizerFast's ids,
offsets and word ids, on SciFact abstracts and edge cases; folders whose tokenizer_config.json asks
for more fall back to transformers; a chunking call in a fresh process does not import transformers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ragline.flows.resources.models.chunking_tokenizer import ChunkingTokenizer, load_chunking_tokenizer
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec, resolve_model_path
from tests.helpers.data import scifact_records

MINILM = Path(resolve_model_path("all-MiniLM-L6-v2"))
KWARGS = {"add_special_tokens": False, "return_offsets_mapping": True, "truncation": False, "verbose": False}

EDGE_CASES = [
    "", " ", "   \n\t  \n", "\n",
    "Aspirin reduces the risk of myocardial infarction. " * 40,  # ~400 tokens: MiniLM's file truncates at 128
    "naïve café — ünïcode; Ångström, résumé, façade, Straße, ﬁnancial ligature, İstanbul",
    "中文文本的分词测试。日本語のテキスト、한국어 텍스트도 있습니다。",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✔︎ marks",
    "control\x00chars\x07here\x1b[31m red \x7f del \u200b zero-width \ufeff bom \u00ad soft-hyphen",
    "# Heading\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\ndef f(x):\n    return x**2  # comment\n```\n",
    "URLs https://example.org/a?b=c&d=e#f, e-mails a.b@c.de, numbers 3.5e-10 1,000,000 p<0.05 COVID-19",
    "[CLS] special [SEP] tokens [PAD] in [MASK] text [UNK]",
    "a" * 3000, "supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopic",
    "\u0301combining first\u0301 e\u0301 and RTL: مرحبا بالعالم שלום",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer of the same folder: what the chunker used before, and the fallback."""
    return Embedder._load_transformers_tokenizer(MINILM)


@pytest.fixture(scope="module")
def shortcut() -> ChunkingTokenizer:
    tokenizer = load_chunking_tokenizer(MINILM)
    assert isinstance(tokenizer, ChunkingTokenizer)
    return tokenizer


def assert_same(got, want, n: int) -> None:
    assert got["input_ids"] == want["input_ids"]
    assert [list(o) for o in got["offset_mapping"]] == [list(o) for o in want["offset_mapping"]]
    for i in range(n):
        assert got.word_ids(i) == want.word_ids(i), i


def scifact_texts(n: int) -> list[str]:
    return [t for r in scifact_records(n) for t in (r["title"], r["text"])]


def test_scifact_abstracts_give_transformers_ids_offsets_and_word_ids(shortcut, reference):
    texts = scifact_texts(400)
    got, want = shortcut(texts, **KWARGS), reference(texts, **KWARGS)
    assert_same(got, want, len(texts))
    assert max(len(ids) for ids in got["input_ids"]) > 300  # whole abstracts: nothing truncated at 128


@pytest.mark.parametrize("text", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_edge_cases_give_transformers_ids_offsets_and_word_ids(shortcut, reference, text):
    assert_same(shortcut([text], **KWARGS), reference([text], **KWARGS), 1)
    # a single string, as the tests count tokens: a flat list; and with special tokens, the same [CLS]/[SEP]
    assert shortcut(text, add_special_tokens=False)["input_ids"] == reference(text, add_special_tokens=False)["input_ids"]
    assert shortcut(text)["input_ids"] == reference(text)["input_ids"]


def test_nothing_is_truncated_or_padded(shortcut):
    long, short = EDGE_CASES[4], "two words"
    got = shortcut([long, short], **KWARGS)
    assert len(got["input_ids"][0]) > 128 and len(got["input_ids"][1]) == 2  # the file: truncate at 128, pad to 128
    assert got["offset_mapping"][0][-1][1] == len(long.rstrip())
    with pytest.raises(ValueError, match="does not truncate"):
        shortcut([long], add_special_tokens=False, truncation=True)
    assert "offset_mapping" not in shortcut([short], add_special_tokens=False)
    with pytest.raises(KeyError):
        shortcut([short], add_special_tokens=False)["offset_mapping"]
    assert shortcut([], **KWARGS)["input_ids"] == []


def test_one_tokenizer_is_shared_by_threads(shortcut):
    """Calls in several threads at once, each its own batch order and with or without special tokens,
    get what a call alone gets: the call leaves no state on the shared tokenizer."""
    texts = scifact_texts(30)

    def rows(k: int) -> list:
        batch = texts[k:] + texts[:k]
        got = shortcut(batch, add_special_tokens=k % 2 == 1, return_offsets_mapping=True)
        return [(got["input_ids"][i], got["offset_mapping"][i], got.word_ids(i)) for i in range(len(batch))]

    alone = [rows(k) for k in range(8)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(rows, range(8)))
    assert together == alone
    assert alone[1][-1][0][0] == 101 and alone[0][-1][0][0] != 101  # [CLS] only where asked for


def model_copy(tmp_path: Path, config_update: dict | None = None) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(MINILM, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx"))
    if config_update is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **config_update}))
    return folder


def declared_added_tokens(**changes) -> dict:
    """MiniLM's added tokens as a saved tokenizer_config.json lists them (transformers re-adds these)."""
    tokens = json.loads((MINILM / "tokenizer.json").read_text())["added_tokens"]
    return {"added_tokens_decoder": {str(t.pop("id")): {**t, **changes.get(t["content"], {})} for t in tokens}}


def test_a_config_listing_the_files_own_added_tokens_takes_the_shortcut(tmp_path):
    folder = model_copy(tmp_path, declared_added_tokens())
    tokenizer = load_chunking_tokenizer(folder)
    assert isinstance(tokenizer, ChunkingTokenizer)
    texts = [EDGE_CASES[11], *scifact_texts(20)]
    assert_same(tokenizer(texts, **KWARGS), Embedder._load_transformers_tokenizer(folder)(texts, **KWARGS), len(texts))


@pytest.mark.parametrize("update, text", [
    # transformers re-adds [UNK] with lstrip: the space before it joins its offsets
    (declared_added_tokens(**{"[UNK]": {"lstrip": True}}), "a [UNK] b"),
    # a special token the file lacks: transformers adds it (a new id, never split)
    ({"additional_special_tokens": ["<ent>"]}, "an <ent> here"),
    ({"extra_special_tokens": ["<ent>"]}, "an <ent> here"),
    ({"split_special_tokens": True}, "a [SEP] b"),
])
def test_a_config_the_shortcut_does_not_reproduce_falls_back_to_transformers(tmp_path, update, text):
    plain = load_chunking_tokenizer(MINILM)(text, **KWARGS)
    folder = model_copy(tmp_path, update)
    assert load_chunking_tokenizer(folder) is None
    fallback = Embedder._load_transformers_tokenizer(folder)(text, **KWARGS)
    assert (fallback["input_ids"], fallback["offset_mapping"]) != (plain["input_ids"], plain["offset_mapping"])


@pytest.mark.parametrize("change", ["no tokenizer.json", "added_tokens.json", "unknown key", "add_bos_token",
                                    "broken config", "config not an object", "special token map"])
def test_other_unreproduced_folders_fall_back(tmp_path, change):
    folder = model_copy(tmp_path)
    if change == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    elif change == "added_tokens.json":
        (folder / "added_tokens.json").write_text('{"<ent>": 30522}')
    elif change in ("unknown key", "add_bos_token"):
        model_copy(tmp_path / "x", {"some_new_setting" if change == "unknown key" else change: True})
        shutil.copy(tmp_path / "x" / "model" / "tokenizer_config.json", folder)
    elif change == "broken config":
        (folder / "tokenizer_config.json").write_text("{not json")
    elif change == "config not an object":
        (folder / "tokenizer_config.json").write_text("[]")
    else:  # read without added_tokens_decoder in the config: a special token the file lacks
        (folder / "special_tokens_map.json").write_text('{"unk_token": "[UNK]", "bos_token": "<s>"}')
    assert load_chunking_tokenizer(folder) is None


def test_an_embedder_whose_folder_needs_transformers_uses_its_tokenizer(tmp_path):
    folder = model_copy(tmp_path.parent / f"{tmp_path.name}-st", {"additional_special_tokens": ["<ent>"]})
    shutil.copy(MINILM / "model.safetensors", folder)  # not loaded: the tokenizer comes from the folder
    embedder = Embedder(EmbedderSpec(type="sentence_transformer", model=str(folder)))
    tokenizer = embedder.tokenizer
    assert not isinstance(tokenizer, ChunkingTokenizer) and not embedder._model.loaded
    assert len(tokenizer(["an <ent> here"], add_special_tokens=False)["input_ids"][0]) == 3


def test_a_fresh_embedder_chunks_without_importing_transformers():
    """A one-change ingestion run: a fresh process chunks one document with an embedder whose model is
    not loaded; neither transformers nor torch (nor sentence-transformers) is imported."""
    script = """
import sys
from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.chunk import Params, chunk

embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
document = Document(source_id="d", title="T", text="# A\\n\\n" + "Aspirin reduces the risk of infarction. " * 60,
                    format="markdown")
chunks = chunk.fn(documents=[document], params=Params(), ctx=StepContext(pipeline="t", step_id="c"),
                  embedder=embedder)
assert len(chunks) >= 2 and not embedder._model.loaded, (len(chunks), embedder._model.loaded)
print(type(embedder.tokenizer).__name__, sorted({m.split(".")[0] for m in sys.modules}
      & {"transformers", "torch", "sentence_transformers"}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[4])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ChunkingTokenizer", "[]"]


def test_a_tokenizer_json_the_rust_loader_refuses_falls_back(tmp_path):
    """transformers then loads it or says why, as before the shortcut."""
    folder = model_copy(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonexistent"}}')
    assert load_chunking_tokenizer(folder) is None
