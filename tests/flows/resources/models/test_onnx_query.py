"""The torch-free query encoder (flows.resources.onnx_query, issue 38.1): it reads the model's
sentence-transformers configuration (pooling, normalisation, length), falls back to the torch path
where it cannot reproduce it, gives torch's vectors and rankings, and keeps `ragline search` free of
torch and sentence-transformers."""
from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ragline.flows.resources.models import onnx_query
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec, resolve_model_path
from tests.helpers.data import (SCIFACT, index_and_search_yaml, require_scifact, scifact_records, shipped_pipeline,
                               write_jsonl)

MODEL = Path(resolve_model_path("all-MiniLM-L6-v2"))
TEXTS = [
    "how does hybrid retrieval work",
    "  leading and trailing spaces, ünïcödé, 中文 and émojis 🙂  ",
    "word " * 400,  # over max_seq_length: truncated at 256 word pieces
    "a",
    "What happens to a document that cannot be read?",
]


def config_copy(tmp_path: Path) -> Path:
    """The packaged model's configuration files (not its weights) in a folder a test may change."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx"))
    return folder


def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    path.write_text(json.dumps(change(value) or value))


# ---------------------------------------------------------------------------------------------- unit: no model runs
def test_the_packaged_models_configuration_is_read_from_its_files():
    folder, pooling, normalizes, limit = onnx_query.model_config(str(MODEL))
    assert (folder, pooling, normalizes, limit) == (MODEL, "mean", True, 256)


@pytest.mark.parametrize("change, reason", [
    (lambda m: edit_json(m / "modules.json", lambda v: v.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                                                                    "type": "sentence_transformers.models.Dense"})),
     "modules"),
    (lambda m: edit_json(m / "1_Pooling" / "config.json",
                         lambda v: v.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)), "pooling 'max'"),
    (lambda m: edit_json(m / "1_Pooling" / "config.json", lambda v: v.update(pooling_mode_cls_token=True)),
     "pooling ["),
    (lambda m: edit_json(m / "sentence_bert_config.json", lambda v: v.update(do_lower_case=True)), "do_lower_case"),
    (lambda m: edit_json(m / "sentence_bert_config.json", lambda v: v.update(max_seq_length=None)), "max_seq_length"),
    (lambda m: edit_json(m / "config_sentence_transformers.json",
                         lambda v: v.update(prompts={"query": "query: "}, default_prompt_name="query")), "default prompt"),
    (lambda m: (m / "modules.json").unlink(), "modules.json"),
])
def test_what_it_does_not_reproduce_is_refused_with_the_reason(tmp_path, change, reason):
    folder = config_copy(tmp_path)
    change(folder)
    with pytest.raises(onnx_query.Unsupported, match=reason.replace("[", r"\[")):
        onnx_query.model_config(str(folder))


def test_pooling_modes_as_sentence_transformers_reads_them():
    assert onnx_query._pooling_mode({"pooling_mode": "cls"}) == "cls"
    assert onnx_query._pooling_mode({"pooling_mode": ["mean"]}) == "mean"
    assert onnx_query._pooling_mode({"word_embedding_dimension": 384}) == "mean"  # none set: mean
    assert onnx_query._pooling_mode({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}) == "cls"


def test_the_tokenizer_truncates_at_the_models_length_and_pads_to_the_longest():
    tokenizer = onnx_query._tokenizer(MODEL, 256)
    long, short = tokenizer.encode_batch(["word " * 400, "a"])
    assert len(long.ids) == len(short.ids) == 256  # the file's own truncation and padding (128) are replaced
    assert long.ids[-1] == tokenizer.token_to_id("[SEP]") and sum(short.attention_mask) == 3
    assert len(onnx_query._tokenizer(MODEL, 64).encode("word " * 400).ids) == 64  # the embedder's max_seq_length
    assert len(tokenizer.encode_batch(["a", "a b"])[0].ids) == 4  # padded to the batch's longest, not 128


class FakeSession:
    """Returns fixed hidden states (batch 2, 4 positions, 3 dims) as the ONNX transformer would."""

    def __init__(self, hidden: np.ndarray):
        self.hidden, self.fed = hidden, {}

    def get_inputs(self):
        return [type("Input", (), {"name": n})() for n in ("input_ids", "attention_mask", "token_type_ids")]

    def get_outputs(self):
        return [type("Output", (), {"name": "last_hidden_state"})()]

    def run(self, names, feed):
        self.fed = feed
        return [self.hidden[:, :feed["input_ids"].shape[1]]]


@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("mean", False), ("cls", True)])
def test_pooling_ignores_padding_and_normalises(pooling, normalize):
    tokenizer = onnx_query._tokenizer(MODEL, 256)
    texts = ["a b", "a"]  # [CLS] a b [SEP] / [CLS] a [SEP] [PAD]
    hidden = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3) + 1
    session = FakeSession(hidden)
    vectors = onnx_query.QueryEncoder(session, tokenizer, pooling, normalize, Path("x.onnx")).encode(texts)
    assert session.fed["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    if pooling == "cls":
        expected = hidden[:, 0]
    else:
        expected = np.stack([hidden[0].mean(axis=0), hidden[1, :3].mean(axis=0)])  # the pad position left out
    if normalize:
        expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(vectors, expected, rtol=1e-6)
    assert vectors.dtype == np.float32


def test_without_an_export_queries_use_the_torch_path_saying_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAGLINE_CACHE_DIR", str(tmp_path))  # no export in it
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    with caplog.at_level(logging.DEBUG, logger="ragline.flows.resources.models.embedder"):
        assert embedder._query_encoder.get() is None
        assert embedder._query_encoder.get() is None
    said = [r for r in caplog.records if "queries encoded by its torch backend" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG and "no ONNX export" in said[0].getMessage()
    assert not embedder._model.loaded  # deciding loads nothing


def test_switched_off_or_on_a_gpu_queries_use_the_embedders_backend(monkeypatch, caplog):
    monkeypatch.setenv("RAGLINE_ONNX_QUERIES", "0")
    with caplog.at_level(logging.DEBUG, logger="ragline.flows.resources.models.embedder"):
        assert Embedder(EmbedderSpec(type="sentence_transformer"))._query_encoder.get() is None
    assert "RAGLINE_ONNX_QUERIES is off" in caplog.text
    monkeypatch.delenv("RAGLINE_ONNX_QUERIES")
    assert Embedder(EmbedderSpec(type="sentence_transformer", device="cuda"))._query_encoder.get() is None


def test_the_query_encoder_does_not_change_the_index_fingerprint():
    spec = EmbedderSpec(type="sentence_transformer")
    assert spec.vectors_key() == "52542ea1f6f01360"  # as at db70cdb, before issue 38: nothing re-embeds
    assert Embedder.fingerprint_fields(spec) == {"model": "all-MiniLM-L6-v2", "backend": "torch", "normalize": True,
                                                 "max_seq_length": None, "document_prefix": ""}


# ------------------------------------------------------------------------- integration: the real model, torch and ONNX
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A private export cache, filled as an ingestion fills it: by the torch embedder's first load."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("ragline_cache")
        patch.setenv("RAGLINE_CACHE_DIR", str(cache))
        patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
        embedder.encode_documents(["the first ingestion"])  # loads the torch model, which exports once
        assert onnx_query.onnx_file(str(MODEL), "torch") is not None
        assert not list(MODEL.rglob("*.onnx"))  # never written into site-packages
        yield cache, embedder


@pytest.mark.integration
@pytest.mark.onnx
def test_lean_vectors_are_torchs(exported):
    _, torch_embedder = exported
    lean = Embedder(EmbedderSpec(type="sentence_transformer", query_prefix="query: "))
    vectors = lean.encode_queries(TEXTS)
    assert not lean._model.loaded and lean._query_encoder.get() is not None
    expected = torch_embedder._encode(["query: " + t for t in TEXTS])  # the same prefix as the embedder adds
    assert np.abs(vectors - expected).max() < 1e-5
    ids = torch_embedder.model.preprocess(TEXTS)["input_ids"].numpy()
    assert [e.ids for e in lean._query_encoder.get().tokenizer.encode_batch(TEXTS)] == ids.tolist()
    assert lean.dimension == 384


@pytest.mark.integration
@pytest.mark.onnx
def test_a_process_holding_the_model_encodes_queries_with_it_not_a_second_copy(exported):
    """An ingestion (its answerable floor) or a job has the torch model loaded: its queries go through
    it, and the ONNX encoder is never loaded beside it (130-230 MB of an ingestion's peak)."""
    _, torch_embedder = exported
    vectors = torch_embedder.encode_queries(TEXTS)
    assert torch_embedder._model.loaded and not torch_embedder._query_encoder.loaded
    assert np.abs(vectors - torch_embedder._encode(TEXTS)).max() == 0
    lean = Embedder(EmbedderSpec(type="sentence_transformer"))
    lean.encode_queries(TEXTS)  # a query process: the lean encoder, no model
    assert lean._query_encoder.loaded and not lean._model.loaded
    lean.encode_documents(["an ingestion step in the same process"])
    assert np.abs(lean.encode_queries(TEXTS) - vectors).max() < 1e-5  # the encoder it has stays in use


@pytest.mark.integration
@pytest.mark.onnx
def test_scifact_rankings_are_torchs(exported):
    """Every judged SciFact test query (300) ranked over the abstracts judged for them (~340, embedded by
    torch): the top-10 of the torch query vector and of the ONNX one agree in >= 99 % of queries."""
    require_scifact()
    _, torch_embedder = exported
    with open(SCIFACT / "qrels" / "test.tsv", newline="") as handle:
        judged = {row[1] for row in list(csv.reader(handle, delimiter="\t"))[1:]}
    docs = [r for r in scifact_records(5183) if r["_id"] in judged]
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
        queries = [q["text"] for q in map(json.loads, handle)][:300]
    doc_vectors = torch_embedder.encode_documents([f"{d['title']} {d['text']}" for d in docs])
    lean = Embedder(EmbedderSpec(type="sentence_transformer"))
    by_torch, by_onnx = torch_embedder._encode(queries), lean.encode_queries(queries)
    assert not lean._model.loaded
    top_torch = np.argsort(-(by_torch @ doc_vectors.T), axis=1, kind="stable")[:, :10]
    top_onnx = np.argsort(-(by_onnx @ doc_vectors.T), axis=1, kind="stable")[:, :10]
    same = np.mean([list(a) == list(b) for a, b in zip(top_torch, top_onnx)])
    assert same >= 0.99, f"same top-10 (in order) for {same:.1%} of {len(queries)} queries"
    assert np.abs(by_torch - by_onnx).max() < 1e-5


@pytest.mark.integration
@pytest.mark.onnx
def test_search_and_ask_in_a_fresh_process_import_neither_torch_nor_chromas_package(exported, tmp_path, monkeypatch,
                                                                                   capsys):
    """`ragline search` and `ragline ask -p ask_extractive` (--no-prefect) as a user runs them, in a new
    interpreter, after an ingestion: no torch, sentence-transformers, Prefect, nor the chromadb package
    (its engine is read through ``chroma_reader``); their passages and answer are the torch path's
    (RAGLINE_ONNX_QUERIES=0, in this process)."""
    from ragline.flows.cli import main

    cache, _ = exported
    project = tmp_path / "pipelines.yaml"
    project.write_text(textwrap.dedent(index_and_search_yaml()) + shipped_pipeline("ask_extractive"))
    records = scifact_records(12)
    write_jsonl(tmp_path / "docs" / "corpus.jsonl", records)
    assert main(["index", "-f", str(project), "--no-prefect"]) == 0
    search = ["search", records[4]["title"], "-f", str(project), "--no-prefect", "--json", "-k", "5"]
    ask = ["ask", records[4]["title"] + "?", "-p", "ask_extractive", "-f", str(project), "--no-prefect", "--json"]
    probe = textwrap.dedent(f"""
        import json, sys
        from ragline.flows.cli import main
        codes = [main({search!r}), main({ask!r})]
        heavy = sorted(m for m in ("torch", "sentence_transformers", "transformers", "prefect", "chromadb")
                       if m in sys.modules)
        print(json.dumps({{"codes": codes, "heavy": heavy}}), file=sys.stderr)
    """)
    env = {**os.environ, "RAGLINE_CACHE_DIR": str(cache), "RAGLINE_START_LLM": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("PREFECT_API_URL", None)
    capsys.readouterr()
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert report == {"codes": [0, 0], "heavy": []}, result.stderr[-2000:]
    decoder = json.JSONDecoder()
    lean, end = decoder.raw_decode(result.stdout)
    lean_answer = json.loads(result.stdout[end:])
    assert len(lean) == 5 and lean[0]["source_id"].endswith("#" + records[4]["_id"])

    monkeypatch.setenv("RAGLINE_ONNX_QUERIES", "0")  # the torch path, in this process
    assert main(search) == 0
    by_torch = json.loads(capsys.readouterr().out)
    assert [p["chunk_id"] for p in lean] == [p["chunk_id"] for p in by_torch]
    assert [p["score"] for p in lean] == pytest.approx([p["score"] for p in by_torch], abs=1e-5)
    assert main(ask) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (lean_answer["text"], lean_answer["refused"], lean_answer["sources"]) == \
        (answer["text"], answer["refused"], answer["sources"])
