"""Names a newcomer can search for: one class per name, pipeline kinds as an enum."""
from __future__ import annotations

import ast
import json
import re
from collections import Counter

from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import PipelineKind
from tests.helpers.data import REPO


def test_no_two_product_classes_share_a_name():
    names = Counter(node.name for path in [*(REPO / "flows").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]
                    for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                    and node.name not in ("Params", "Config"))  # a stage's Params lives in its own module
    assert [name for name, count in names.items() if count > 1] == []


def test_pipeline_kinds_are_an_enum_that_reads_and_prints_as_the_yaml_word():
    project = load_project(REPO / "pipelines.yaml", tuned=False)
    kinds = {name: pipeline.kind for name, pipeline in project.pipelines.items()}
    assert {type(kind) for kind in kinds.values()} == {PipelineKind}
    assert kinds["index"] is PipelineKind.INGESTION and kinds["search"] is PipelineKind.QUERY
    assert json.dumps(kinds["search"]) == '"query"' and f"a {kinds['index']} pipeline" == "a ingestion pipeline"


def test_no_kind_is_compared_as_a_string():
    pattern = re.compile(r"""kind\s*(==|!=|in)\s*\(?\s*["'](ingestion|query|job)["']""")
    paths = [*(REPO / "flows").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]
    found = [f"{path.relative_to(REPO)}:{n}" for path in paths
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
