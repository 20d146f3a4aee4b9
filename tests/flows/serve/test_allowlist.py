"""The user-stage module allowlist lives outside pipelines.yaml: a file can narrow it, never widen
it, and nothing outside it is ever imported (probed with `this`, which prints when imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragline.flows.spec import registry
from ragline.flows.spec.compile import load_project, validate_file
from tests.helpers.data import BASE_RESOURCES

REPO = Path(__file__).resolve().parents[3]
FUSE = BASE_RESOURCES + """
pipelines:
  search:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense}
      - {id: fuse,  task: ragline.tasks.retrieve.fuse.fuse}
"""
PROBE = BASE_RESOURCES + """
settings: {allow_modules: [this]}
pipelines:
  search:
    kind: query
    steps:
      - {id: s, task: this.s}
"""
PROBE_SCRIPT = """
import json, sys
from ragline.flows.spec.compile import validate_file
errors = validate_file(sys.argv[1], allow_modules=sys.argv[2:])
print(json.dumps({"this_imported": "this" in sys.modules,
                  "errors": [[e.line, e.field, e.message] for e in errors]}))
"""


@pytest.fixture(autouse=True)
def no_external_allowlist(monkeypatch):
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    registry.set_allowed_modules([])
    yield
    registry.set_allowed_modules([])


def probe(path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Validate in a fresh interpreter, so sys.modules tells whether `this` was imported."""
    environ = {k: v for k, v in os.environ.items() if k != registry.ALLOW_ENV} | (env or {})
    result = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(path), *flags], capture_output=True,
                            text=True, cwd=REPO, env=environ, timeout=300)
    assert result.returncode == 0, result.stderr
    *noise, last = result.stdout.strip().splitlines()
    return json.loads(last), "\n".join(noise)


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


def test_the_file_cannot_allow_a_module_itself(make_project):
    report, printed = probe(make_project(PROBE))
    assert printed == "" and "Zen of Python" not in printed and not report["this_imported"]
    errors = {field: (line, message) for line, field, message in report["errors"]}
    line, message = errors["settings.allow_modules.0"]
    assert line == line_of(PROBE, "allow_modules")
    assert "module 'this' is not allowed: set RAGLINE_ALLOW_MODULES" in message
    assert errors["task"][0] == line_of(PROBE, "task: this.s")


def test_narrowing_an_external_allowlist_imports_nothing_outside_it(make_project):
    report, printed = probe(make_project(PROBE.replace("[this]", "[ragline.tasks]")), env={registry.ALLOW_ENV: "ragline.tasks"})
    assert printed == "" and not report["this_imported"]
    assert any(field == "task" and "'this' is not allowed" in message for _, field, message in report["errors"])


def test_environment_variable_allows_a_module(make_project, monkeypatch):
    path = make_project(FUSE)
    assert "is not allowed: set RAGLINE_ALLOW_MODULES" in validate_file(path)[0].message
    monkeypatch.setenv(registry.ALLOW_ENV, "json, ragline.tasks")
    assert validate_file(path) == []


def test_parameter_and_set_allowed_modules_allow_a_module(make_project):
    path = make_project(FUSE)
    assert load_project(path, allow_modules=["ragline.tasks.retrieve.fuse"]).pipeline("search").step("fuse").stage.name == "fuse"
    registry.set_allowed_modules(["ragline.tasks"])
    assert validate_file(path) == []


def test_file_can_only_narrow(make_project, monkeypatch):
    monkeypatch.setenv(registry.ALLOW_ENV, "ragline.tasks")
    narrowed = "settings: {allow_modules: [ragline.tasks.rerank.cross_encoder]}\n" + FUSE
    error, = validate_file(make_project(narrowed))
    assert (error.step, error.field) == ("fuse", "task")
    assert "module 'ragline.tasks.retrieve.fuse' is not in settings.allow_modules of this file" in error.message
    assert validate_file(make_project("settings: {allow_modules: [ragline.tasks.retrieve.fuse]}\n" + FUSE)) == []


def test_pyproject_of_the_project_allows_a_module(make_project):
    path = make_project(FUSE)
    (path.parent / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["ragline.tasks"]\n')
    assert validate_file(path) == []
    (path.parent / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = "ragline.tasks"\n')
    error, not_allowed = validate_file(path)
    assert error.file.endswith("pyproject.toml") and error.line == 2 and "list of dotted module names" in error.message
    assert not_allowed.step == "fuse" and "is not allowed" in not_allowed.message


def test_invalid_module_names_are_rejected(make_project, monkeypatch):
    with pytest.raises(ValueError, match="not a dotted module name"):
        registry.set_allowed_modules(["../evil"])
    monkeypatch.setenv(registry.ALLOW_ENV, "tasks,not a module")
    assert any(registry.ALLOW_ENV in e.message for e in validate_file(make_project(FUSE)))
    assert not registry.module_allowed("tasks..x", ["tasks"]) and registry.module_allowed("tasks.x", ["tasks"])
    assert not registry.module_allowed("tasksx", ["tasks"])
