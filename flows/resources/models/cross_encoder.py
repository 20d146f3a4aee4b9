"""A sentence-transformers CrossEncoder (any HF id or local path), loaded once per process."""
from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.resources.models.embedder import quiet_model_loading
from ragline.flows.resources.base import Health, Lazy, Resource


class CrossEncoderSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["cross_encoder"]
    model: str = Field("cross-encoder/ms-marco-MiniLM-L6-v2", description="HF id or local path")
    device: str = "cpu"
    batch_size: int = Field(32, ge=1, le=1024)
    max_length: int | None = Field(512, ge=16, description="tokens per (query, passage) pair")


class CrossEncoderModel(Resource):
    """Lazily loads the model on first use (or at ``warm_up``); thread-safe; cheap to construct."""

    preload = ("sentence_transformers",)

    Spec = CrossEncoderSpec

    def __init__(self, spec: CrossEncoderSpec, base_dir: Any = None):
        super().__init__(spec, base_dir)
        self._model = Lazy(self._load)
        self._predict_lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"cross-encoder {self.spec.model}"

    @property
    def model(self):
        return self._model.get()

    def _load(self):
        quiet_model_loading()
        from sentence_transformers import CrossEncoder

        return CrossEncoder(self.spec.model, device=self.spec.device, max_length=self.spec.max_length)

    def warm_up(self) -> None:
        """Load the model and score one pair: the first real query pays neither."""
        self.score("warm-up", ["warm-up"])

    def health(self, index_state: Any = None) -> Health:
        if self._model.loaded:
            return Health.up(model=self.spec.model, loaded=True)
        return Health.degraded("not loaded yet: the first use loads it", model=self.spec.model, loaded=False)

    def close(self) -> None:
        self._model.reset()

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
