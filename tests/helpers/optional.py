"""Tests that need an optional package, skipped without it."""
from __future__ import annotations

from importlib.util import find_spec

import pytest


def requires(*modules: str, reason: str = "") -> pytest.MarkDecorator:
    """Skip unless every module is installed, found without importing it. Why not a module-level
    ``pytest.importorskip``: it imports the package while every test worker collects the suite
    (onnx, datasets and accelerate: about 2.5 s a worker, most of which never runs those tests)."""
    missing = [name for name in modules if find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=reason or f"needs {', '.join(missing)}")
