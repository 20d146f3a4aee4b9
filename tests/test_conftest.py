"""The root conftest leaves tests/integration/ uncollected only where ``-m`` would deselect all of it."""
from __future__ import annotations

import pytest

from tests.conftest import _deselects_integration


@pytest.mark.parametrize("markexpr, skipped", [
    ("not integration", True),
    ("not integration and not llm", True),
    ("not (integration or onnx)", True),
    ("not integration or onnx", False),  # an integration test marked onnx is selected
    ("integration", False),
    ("onnx", False),
    ("", False),
    ("not integration and", False),  # pytest reports the syntax error
])
def test_only_an_expression_that_deselects_every_integration_test_skips_the_folder(markexpr, skipped):
    assert _deselects_integration(markexpr) is skipped
