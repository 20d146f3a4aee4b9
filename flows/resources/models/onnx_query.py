"""Query vectors without torch (issue 38.1): the embedder's transformer as an ONNX file run by
onnxruntime, its ``tokenizer.json`` by the Rust ``tokenizers`` package, pooling and normalisation in
numpy. Importing sentence-transformers (torch, transformers, scikit-learn) was ~10 of the ~12 s a cold
``ragline search`` took on 2 cores; onnxruntime and tokenizers import in ~0.3 s.

Which ONNX file (``onnx_file``): for the ``onnx`` and ``onnx_int8`` backends the very file that encoded
the documents (``onnx_backend``'s export in the cache), so queries are computed as before; for
``torch``, the fp32 export that ``Embedder`` makes once when it first loads the torch model (at the
first ingestion on the machine, ``onnx_backend.export_for_queries``), else an ``onnx/model.onnx`` the
model folder ships (a hub download of a sentence-transformers model often has one; the packaged
all-MiniLM-L6-v2 does not). The fp32 export agrees with torch to ~1e-6 per component: the same top-10
on SciFact (tests/flows/resources/models/test_onnx_query.py). The index's embedder fingerprint does not
involve this file: nothing is re-embedded because of it.

``load`` takes this path only where it reproduces sentence-transformers' ``encode`` as configured by
the model's own files: modules exactly Transformer, Pooling and optionally Normalize; pooling ``mean``
or ``cls``; no default prompt; a ``sentence_bert_config.json`` with ``max_seq_length`` and no
lower-casing; a tokenizer the chunker's shortcut accepts (``chunking_tokenizer``: what
``PreTrainedTokenizerFast`` would encode). Anything else raises ``Unsupported`` with the reason, and the
embedder encodes queries with its own backend (saying so once, at debug level).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ragline.flows.errors import RaglineError
from ragline.flows.resources.models.chunking_tokenizer import load_chunking_tokenizer
from ragline.flows.resources.models.onnx_files import fp32_file, int8_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer

POOLING_MODES = ("mean", "cls")
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
OUTPUT_NAMES = ("last_hidden_state", "token_embeddings")


class Unsupported(RaglineError):
    """Why this model's queries cannot be encoded here (the embedder's own backend encodes them)."""


class QueryEncoder:
    """Texts to vectors as the sentence-transformers model's ``encode`` computes them. Thread-safe: the
    tokenizer's truncation and padding are set once, in ``load``, and only read by ``encode_batch``; an
    onnxruntime session runs concurrent calls."""

    def __init__(self, session: Any, tokenizer: Tokenizer, pooling: str, normalize: bool, onnx_file: Path):
        self.session, self.tokenizer, self.pooling, self.normalize = session, tokenizer, pooling, normalize
        self.onnx_file = onnx_file
        self.input_names = [i.name for i in session.get_inputs()]
        outputs = [o.name for o in session.get_outputs()]
        self.output = next((name for name in OUTPUT_NAMES if name in outputs), outputs[0])

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        rows = [self._batch(texts[start:start + batch_size]) for start in range(0, len(texts), batch_size)]
        return np.concatenate(rows)

    def _batch(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)  # truncated; padded to the batch's longest
        given = {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                 "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                 "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}
        (hidden,) = self.session.run([self.output], {name: given[name] for name in self.input_names})
        hidden = hidden.astype(np.float32, copy=False)
        if self.pooling == "cls":  # the first real token (sentence-transformers: the mask's argmax)
            vectors = hidden[np.arange(len(hidden)), given["attention_mask"].argmax(axis=1)]
        else:  # sentence-transformers' mean: the masked sum over the token count (clamped at 1e-9)
            mask = given["attention_mask"][:, :, None].astype(np.float32)
            vectors = (hidden * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)
        if self.normalize:  # torch.nn.functional.normalize: x / max(|x|, 1e-12)
            vectors = vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)
        return vectors.astype(np.float32, copy=False)


def onnx_file(model_path: str, backend: str) -> Path | None:
    """The ONNX file that computes this backend's vectors of the model at ``model_path``, if it exists."""
    if backend == "onnx_int8":
        candidates = [int8_file(model_path)]
    elif backend == "onnx":
        candidates = [fp32_file(model_path)]
    else:
        candidates = [fp32_file(model_path), Path(model_path) / "onnx" / "model.onnx"]
    return next((c for c in candidates if c.is_file()), None)


def model_config(model_path: str) -> tuple[Path, str, bool, int]:
    """The model's Transformer folder, pooling mode, whether it normalises and its ``max_seq_length``,
    from its sentence-transformers files; ``Unsupported`` where this module does not reproduce them."""
    root = Path(model_path)
    modules = _json(root / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise Unsupported("no sentence-transformers modules.json")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise Unsupported(f"modules {kinds} (reproduced: Transformer, Pooling, Normalize)")
    folder = root / modules[0].get("path", "")
    pooling = _pooling_mode(_json(root / modules[1].get("path", "") / "config.json"))
    settings = _json(root / "config_sentence_transformers.json") or {}
    if isinstance(settings, dict) and settings.get("default_prompt_name"):
        raise Unsupported(f"a default prompt ({settings['default_prompt_name']!r})")
    config = _json(folder / "sentence_bert_config.json")
    if not isinstance(config, dict) or not set(config) <= {"max_seq_length", "do_lower_case"} \
            or not config.get("max_seq_length"):
        raise Unsupported("sentence_bert_config.json without max_seq_length, or with more than it and do_lower_case")
    if config.get("do_lower_case"):
        raise Unsupported("do_lower_case (a Lowercase normalizer sentence-transformers adds)")
    limit = int(config["max_seq_length"])
    positions = (_json(folder / "config.json") or {}).get("max_position_embeddings")
    if isinstance(positions, int) and positions > 0:  # sentence-transformers caps the tokenizer's length by it
        limit = min(limit, positions)
    return folder, pooling, kinds[-1] == "Normalize", limit


def load(model_path: str, backend: str, normalize: bool, max_seq_length: int | None,
         threads: int | None = None) -> QueryEncoder:
    """The query encoder of the model at ``model_path`` (see the module doc); ``Unsupported`` says why not.
    ``normalize``: the embedder's setting (sentence-transformers' ``normalize_embeddings``)."""
    folder, pooling, normalizes, limit = model_config(model_path)
    path = onnx_file(model_path, backend)
    if path is None:
        raise Unsupported("no ONNX export of it yet (the first ingestion on this machine makes one)")
    if importlib.util.find_spec("onnxruntime") is None:
        raise Unsupported("onnxruntime is not installed (pip install 'ragline[onnx]')")
    if load_chunking_tokenizer(folder) is None:  # its checks: tokenizer.json encodes as transformers would
        raise Unsupported("its tokenizer needs transformers")
    tokenizer = _tokenizer(folder, max_seq_length or limit)
    return QueryEncoder(_session(path, threads), tokenizer, pooling, normalize or normalizes, path)


def _tokenizer(folder: Path, max_length: int) -> Tokenizer:
    """``tokenizer.json`` set up as sentence-transformers calls its tokenizer: ``truncation="longest_first"``
    at the model's length, padding to the batch's longest on the configured side (the file's own
    truncation and padding, MiniLM's 128, are replaced, as ``PreTrainedTokenizerFast`` replaces them)."""
    from tokenizers import Tokenizer

    config = _json(folder / "tokenizer_config.json") or {}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.enable_truncation(max_length=max_length, strategy="longest_first",
                                direction=config.get("truncation_side", "right"))
    pad_token = config.get("pad_token")
    pad_token = pad_token.get("content") if isinstance(pad_token, dict) else pad_token
    pad_id = tokenizer.token_to_id(pad_token) if isinstance(pad_token, str) else None
    if pad_id is None:
        raise Unsupported("no pad token")
    tokenizer.no_padding()
    tokenizer.enable_padding(direction=config.get("padding_side", "right"), pad_id=pad_id, pad_token=pad_token,
                             pad_type_id=int(config.get("pad_token_type_id", 0)))
    return tokenizer


def _session(path: Path, threads: int | None):
    """A CPU session with torch's thread count (``OMP_NUM_THREADS``, else onnxruntime's default: the
    physical cores, as torch's), not spinning under ``OMP_WAIT_POLICY=PASSIVE`` (onnxruntime ignores the
    OpenMP variables; see ``onnx_backend._session``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _pooling_mode(config: object) -> str:
    if not isinstance(config, dict):
        raise Unsupported("no pooling config")
    mode = config.get("pooling_mode")
    if mode is None:  # the legacy booleans, read as sentence-transformers reads them (none set: mean)
        active = [name for key, name in LEGACY_POOLING.items() if config.get(key)]
        mode = active if len(active) > 1 else active[0] if active else "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLING_MODES:
        raise Unsupported(f"pooling {mode!r} (reproduced: {', '.join(POOLING_MODES)})")
    return mode


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
