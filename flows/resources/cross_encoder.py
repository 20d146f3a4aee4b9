"""A sentence-transformers CrossEncoder (any HF id or local path), loaded once per process."""
from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class CrossEncoderSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["cross_encoder"]
    model: str = Field("cross-encoder/ms-marco-MiniLM-L6-v2", description="HF id or local path")
    device: str = "cpu"
    batch_size: int = Field(32, ge=1, le=1024)
    max_length: int | None = Field(512, ge=16, description="tokens per (query, passage) pair")


class CrossEncoderModel:
    """Lazily loads the model on first use; thread-safe; cheap to construct."""

    def __init__(self, spec: CrossEncoderSpec, base_dir: Any = None):
        self.spec = spec
        self._model = None
        self._lock = threading.Lock()
        self._predict_lock = threading.Lock()

    @property
    def model(self):
        if self._model is None:
            with self._lock:
                if self._model is None:
                    from ragline.flows.resources.embedder import quiet_model_loading

                    quiet_model_loading()
                    from sentence_transformers import CrossEncoder

                    self._model = CrossEncoder(self.spec.model, device=self.spec.device,
                                               max_length=self.spec.max_length)
        return self._model

    def score(self, query: str, texts: list[str]) -> list[float]:
        """One relevance score per text, in order."""
        if not texts:
            return []
        model = self.model
        # One predict at a time: a fast tokenizer keeps truncation and padding as mutable state, so
        # concurrent calls (parallel query pipelines) would corrupt each other; predict uses all cores anyway.
        with self._predict_lock:
            scores = model.predict([(query, t) for t in texts], batch_size=self.spec.batch_size,
                                   show_progress_bar=False)
        return [float(s) for s in scores]
