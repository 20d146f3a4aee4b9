"""One settings model: the only reader of RAGLINE_* variables, read when asked, documented in docs/configuration.md."""
from __future__ import annotations

import ast
import re

import pytest

from ragline.flows import settings
from tests.helpers.data import REPO

FILE_NAMED = {"RAGLINE_LLM_BASE_URL", "RAGLINE_LLM_MODEL"}  # ${...} in pipelines files, not ragline's settings


def _environment_reads(tree: ast.AST) -> list[ast.AST]:
    """os.environ[...], os.environ.get(...), os.getenv(...) reads (not writes)."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            reads.append(node)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" and \
                isinstance(node.ctx, ast.Load):
            reads.append(node)
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            reads.append(node)
    return reads


def test_no_module_but_settings_reads_a_ragline_variable():
    offenders = []
    for path in sorted([*(REPO / "flows").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]):
        if path.name == "settings.py":
            continue
        source = path.read_text()
        for node in _environment_reads(ast.parse(source)):
            text = ast.unparse(node)
            if "RAGLINE_" in text or re.search(r"\b[A-Z_]*ENV\b", text):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {text}")
    assert offenders == []


def test_every_ragline_variable_named_in_the_code_is_a_setting():
    fields = {settings.env_name(name) for name in settings.fields()}
    named = set()
    for path in [*(REPO / "flows").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]:
        named |= set(re.findall(r"\bRAGLINE_[A-Z_]+[A-Z]\b", path.read_text()))
    assert named - fields - FILE_NAMED == set()


def test_the_configuration_page_lists_every_setting():
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert settings.with_table(page) == page, "stale: python -m ragline.flows.settings --doc docs/configuration.md"
    for name, (_, info) in settings.fields().items():
        assert f"`{settings.env_name(name)}`" in page and info.description in page


@pytest.mark.parametrize("text, expected", [
    ("0", False), ("false", False), ("No", False), (" OFF ", False),
    ("1", True), ("yes", True), ("anything", True), ("", True),  # empty counts as unset: the default
])
def test_one_flag_parser_for_every_on_off_setting(monkeypatch, text, expected):
    from ragline.flows.ops import llm_server
    from ragline.flows.spec import overlay

    monkeypatch.setenv("RAGLINE_TUNED", text)
    monkeypatch.setenv("RAGLINE_START_LLM", text)
    assert overlay.enabled_by_default() is expected
    assert llm_server.start_enabled() is expected
    assert settings.current().project.tuned is expected and settings.project().tuned is expected


def test_settings_are_read_when_asked_not_at_import(monkeypatch, tmp_path):
    from ragline.flows.ops import prefect_server
    from ragline.flows.spec import registry
    from ragline.flows.resources.models import onnx_backend

    monkeypatch.setenv("RAGLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAGLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RAGLINE_ALLOW_MODULES", " mypkg.stages, other ")
    assert prefect_server.ragline_home() == tmp_path / "home"
    assert onnx_backend.cache_root() == tmp_path / "cache" / "onnx"
    assert registry.allowed_modules() == ("mypkg.stages", "other")
    monkeypatch.delenv("RAGLINE_HOME")
    assert prefect_server.ragline_home().name == ".ragline"


def test_a_bad_value_is_one_error_naming_its_variable(monkeypatch):
    monkeypatch.setenv("RAGLINE_MAX_CONNECTIONS", "many")
    with pytest.raises(settings.SettingsError, match=r"^RAGLINE_MAX_CONNECTIONS: Input should be a valid integer"):
        settings.connections()
    assert settings.project().tuned is True  # another area is not held up by it


def test_served_deployments_round_trip(monkeypatch):
    from ragline.flows.run.entrypoints import served_deployments

    monkeypatch.delenv("RAGLINE_SERVED_DEPLOYMENTS", raising=False)
    with served_deployments({"ragline/index": {"pipeline": "index"}}):
        assert settings.serve().served_deployments == {"ragline/index": {"pipeline": "index"}}
        with served_deployments({"ragline/other": {}}):
            assert list(settings.serve().served_deployments) == ["ragline/other"]
        assert list(settings.serve().served_deployments) == ["ragline/index"]
    assert settings.serve().served_deployments == {}


def test_tool_ragline_of_pyproject_is_read_through_the_settings_source(tmp_path):
    from ragline.flows.spec.compile import project_allowlist

    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["mypkg.stages"]\n')
    assert project_allowlist(tmp_path / "pipelines.yaml") == (("mypkg.stages",), [])
    (tmp_path / "pyproject.toml").write_text('[tool]\nragline = 3\n')
    modules, errors = project_allowlist(tmp_path / "pipelines.yaml")
    assert modules == () and "allow_modules must be a list" in errors[0].message


def test_each_setting_lives_in_one_area_and_is_read_by_attribute(monkeypatch):
    """Settings by attribute, in areas (issue 37.4); the variables keep their flat names."""
    names = [name for area in settings.AREAS.values() for name in area.model_fields]
    assert len(names) == len(set(names)) == len(settings.fields())
    now = settings.current()
    for group, area in settings.AREAS.items():
        assert isinstance(getattr(now, group), area) and isinstance(getattr(settings, group)(), area)
    monkeypatch.setenv("RAGLINE_QUERY_LOG_MAX_MB", "7")
    assert settings.query_log().query_log_max_mb == 7.0 and settings.current().query_log.query_log_max_mb == 7.0
    monkeypatch.setenv("RAGLINE_QUERY_LOG_MAX_MB", "8")  # read again when its variable changes
    assert settings.query_log().query_log_max_mb == 8.0


def test_the_api_connection_limits_are_the_settings_own_fields(monkeypatch):
    from ragline.flows.serve.connections import ConnectionLimits

    monkeypatch.setenv("RAGLINE_KEEP_ALIVE_SECONDS", "2.5")
    limits = ConnectionLimits.from_env()
    assert limits.keep_alive_seconds == 2.5 and limits.max_connections == 1000 and limits.max_header_bytes == 65536
    assert set(settings.ConnectionFields.model_fields) < set(ConnectionLimits.model_fields)
