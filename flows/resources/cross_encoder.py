"""A sentence-transformers CrossEncoder (any HF id or local path), loaded once per process."""
from __future__ import annotations

import threading
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CrossEncoderSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["cross_encoder"]
    model: str = Field("cross-encoder/ms-marco-MiniLM-L6-v2", description="HF id or local path")
    device: str = "cpu"
    batch_size: int = Field(32, ge=1, le=1024)
    max_length: int | None = Field(512, ge=16, description="tokens per (query, passage) pair")


class CrossEncoderModel:
    def __init__(self, spec: CrossEncoderSpec, base_dir=None):
        self.spec = spec
        self._model = None
        self._lock = threading.Lock()

    @property
    def model(self):
        with self._lock:
            if self._model is None:
                from sentence_transformers import CrossEncoder

                self._model = CrossEncoder(self.spec.model, device=self.spec.device, max_length=self.spec.max_length)
        return self._model

    def score(self, query: str, texts: list[str]) -> list[float]:
        if not texts:
            return []
        scores = self.model.predict([(query, t) for t in texts], batch_size=self.spec.batch_size,
                                    show_progress_bar=False)
        return [float(s) for s in scores]
