"""Fixtures for stage tests: one real packaged MiniLM embedder for the whole session."""
from __future__ import annotations

import pytest

from ragline.flows.resources.embedder import Embedder, EmbedderSpec


@pytest.fixture(scope="session")
def minilm() -> Embedder:
    """The packaged all-MiniLM-L6-v2 (offline), loaded once and shared."""
    return Embedder(EmbedderSpec(type="sentence_transformer"))
