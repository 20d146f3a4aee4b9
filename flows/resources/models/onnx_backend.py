"""ONNX Runtime backend for the embedder, in fp32 or dynamically quantised int8.

Why not sentence-transformers' own ``backend="onnx"``: it goes through optimum-onnx, and every
release of that pins transformers<4.58 while we run transformers 5 (installing it downgrades the
whole Hugging Face stack). So the transformer is exported here with ``torch.onnx`` and quantised
with ``onnxruntime.quantization`` (the same settings as optimum's AutoQuantizationConfig), and the
torch transformer inside a normal SentenceTransformer is swapped for an ONNX Runtime session. The
tokenizer, pooling and normalisation stay sentence-transformers' own modules, so the result is used
exactly like the torch model.

Exports go to ``$RAGLINE_CACHE_DIR/onnx/<key>/`` (default ``~/.cache/ragline``), never next to
the model: packaged models live in site-packages, which is not ours to write at run time
(``onnx_files``; the torch-free query encoder, ``onnx_query``, reads them from there).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ragline.flows.resources.models.onnx_files import (  # noqa: F401 - cache_root, cache_dir: this module's API too
    EXPORT_FORMAT,
    cache_dir,
    cache_root,
    fp32_file,
    int8_file,
    quantization_config,
)

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

ONNX_PIP = 'pip install "onnxruntime>=1.31" "onnx>=1.23"'
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def load_onnx_model(path: str, quantized: bool, device: str = "cpu") -> SentenceTransformer:
    """A SentenceTransformer for ``path`` whose transformer runs in ONNX Runtime.

    Exports (and for ``quantized``, int8-quantises) once into the cache, then reuses the files.
    ``device`` picks the ONNX Runtime provider ("cpu", or "cuda" with onnxruntime-gpu).
    """
    _require("onnxruntime")
    from sentence_transformers import SentenceTransformer

    providers = _providers(device)  # fail before a pointless export
    model = SentenceTransformer(path, device="cpu")  # torch weights are only read for the export
    onnx_file = _ensure_fp32(model, path)
    if quantized:
        onnx_file = _ensure_int8(onnx_file, path)
    _swap_in_session(model, onnx_file, providers)
    return model


def _require(package: str) -> None:
    """Fail with the install command rather than a bare ModuleNotFoundError deep in an export."""
    if importlib.util.find_spec(package) is None:
        raise RuntimeError(f"The ONNX embedder backend needs the '{package}' package, which is not installed. "
                           f"Install it with: {ONNX_PIP}")


def export_for_queries(model, path: str) -> Path:
    """The fp32 export of a loaded torch ``SentenceTransformer`` (the ``torch`` backend's), made once,
    for the torch-free query encoder (``onnx_query``). Exported from a copy: the export switches the
    transformer's attention implementation, and the caller keeps encoding documents with ``model``."""
    target = fp32_file(path)
    if not target.is_file():
        _ensure_fp32(copy.deepcopy(model), path)
    return target


def _ensure_fp32(model, path: str) -> Path:
    target = fp32_file(path)
    _build_once(target.parent, lambda tmp: _export(model, tmp / target.name), {"source": path, "variant": "fp32"})
    return target


def _ensure_int8(source: Path, path: str) -> Path:
    config = quantization_config()
    target = int8_file(path)
    _build_once(target.parent, lambda tmp: _quantize(source, tmp / target.name, config),
                {"source": path, "variant": f"qint8_{config}"})
    return target


def _build_once(final: Path, build: Callable[[Path], None], meta: dict) -> None:
    """Build into a private temp folder, then rename it into place.

    The rename is atomic, so a folder that exists is complete. A process that loses a race finds
    the winner's folder already there (rename onto a non-empty folder fails) and drops its own.
    """
    if final.is_dir():
        return
    _require("onnx")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is readable like any other
        build(tmp)
        (tmp / "ragline_onnx.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _ExportWrapper(torch.nn.Module):
    """Positional inputs and a precomputed 4D additive mask, so the export traces no data-dependent branch.

    transformers 5 builds the attention mask with Python-level shortcuts (e.g. skipping it when
    nothing is padded) that the tracer would freeze into the graph; a 4D mask is used as given.
    """

    def __init__(self, model, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        inputs = dict(zip(self.names, tensors))
        mask = inputs["attention_mask"][:, None, None, :].to(torch.float32)
        inputs["attention_mask"] = (1.0 - mask) * torch.finfo(torch.float32).min
        return self.model(**inputs, return_dict=True).last_hidden_state


def _export(model, target: Path) -> None:
    """Export the model's transformer with dynamic batch and sequence axes.

    Uses the TorchScript exporter: the default dynamo one needs the onnxscript package too. The
    torch transformer is discarded after this, so it does not matter that tracing touches it.
    """
    hf_model = model[0].model.eval()
    hf_model.set_attn_implementation("eager")  # plain matmul+softmax exports cleanly with an additive mask
    sample = model.tokenizer(["a short sentence", "a somewhat longer sentence, to get some padding"],
                             padding=True, return_tensors="pt")
    names = [name for name in MODEL_INPUTS if name in sample]
    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "last_hidden_state"]}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_ExportWrapper(hf_model, names), tuple(sample[n] for n in names), str(target),
                          dynamo=False, opset_version=17, input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes)


def _quantize(source: Path, target: Path, config: str) -> None:
    """Dynamic (calibration-free) int8 quantisation with optimum's AutoQuantizationConfig settings."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weight_type = QuantType.QUInt8 if config == "avx2" else QuantType.QInt8
    with _no_root_logging_setup():
        quantize_dynamic(source, target, per_channel=True, reduce_range=False, weight_type=weight_type,
                         extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})


@contextlib.contextmanager
def _no_root_logging_setup():
    """Mute ORT's "consider pre-processing" hint, which it logs on the root logger.

    ``logging.warning`` on an unconfigured root logger calls ``basicConfig``, which would change how
    the whole process logs from then on; a NullHandler prevents that for the duration.
    """
    root = logging.getLogger()
    handler = logging.NullHandler()
    hint = _DropMessage("pre-processing before quantization")
    root.addHandler(handler)
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)
        root.removeHandler(handler)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class OrtTransformer(torch.nn.Module):
    """Stands in for the Hugging Face model inside sentence-transformers' Transformer module."""

    def __init__(self, session, config):
        super().__init__()
        self.session, self.config = session, config
        self.device = torch.device("cpu")  # where outputs land; sentence-transformers reads model.device
        self.input_names = [i.name for i in session.get_inputs()]

    def forward(self, input_ids, attention_mask, token_type_ids=None, **_ignored):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        (hidden,) = self.session.run(["last_hidden_state"], {n: given[n].cpu().numpy() for n in self.input_names})
        return {"last_hidden_state": torch.from_numpy(hidden)}


def _swap_in_session(model, onnx_file: Path, providers: list[str]) -> None:
    transformer = model[0]
    transformer.model = OrtTransformer(_session(onnx_file, providers), transformer.model.config)
    transformer.backend = "onnx"


def _providers(device: str) -> list[str]:
    import onnxruntime as ort

    if not device.startswith("cuda"):
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(f"device={device!r} needs onnxruntime-gpu; this onnxruntime has only "
                           f"{ort.get_available_providers()}")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def _session(onnx_file: Path, providers: list[str]):
    """An ORT session sized like torch (OMP_NUM_THREADS), not spinning when OMP_WAIT_POLICY=PASSIVE.

    ONNX Runtime ignores the OpenMP variables, so on shared CPUs it would otherwise take every core
    and busy-wait between batches.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(onnx_file), options, providers=providers)
