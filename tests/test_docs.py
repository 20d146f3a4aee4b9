"""The README is a newcomer's page that links to docs/; the pages' links, generated tables, exit
statuses and packaging metadata stay true to the code (issue 24 item 6)."""
from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def _load_bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, heading: str) -> str:
    """The body of a ``## heading`` section, up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def _pages() -> list[Path]:
    return [README, REPO / "RELIABILITY.md", *sorted(DOCS.rglob("*.md"))]


# ----------------------------------------------------------------------------- the README
def test_the_readme_is_a_short_page_that_links_to_the_docs():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    headings = re.findall(r"^## (.+)$", text, re.M)
    required = ["Set up", "A five-minute tour", "Documentation", "Working on ragline"]
    assert [h for h in headings if h in required] == required, headings
    for page in ("configuration", "serving", "tuning", "reliability", "results"):
        assert f"](docs/{page}.md)" in text, page
    tour = _section(text, "A five-minute tour")
    for step in ("ragline quickstart ~/", "ragline ask", "ragline serve", "dashboard"):
        assert step in tour, step
    assert "bench:" not in text, "benchmark tables live in docs/results.md"


def test_set_up_is_two_commands_on_the_venv_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", _section(README.read_text(encoding="utf-8"), "Set up"), re.S)
    commands = [block.strip() for block in blocks]
    assert commands == ["bash deploy/bootstrap.sh && .venv/bin/ragline quickstart",
                        "bash deploy/bootstrap.sh && .venv/bin/python -m pytest -n 3"]
    assert commands[1] in (REPO / ".ci" / "run").read_text()


def test_the_test_commands_say_how_long_they_take():
    text = README.read_text(encoding="utf-8")
    setup, working = _section(text, "Set up"), _section(text, "Working on ragline")
    assert re.search(r"full suite.*\d+ minutes on a 2-core machine", setup, re.S)
    assert re.search(r'pytest -n 3 -m "not integration".*the fast suite: about [\d.]+ minutes on a 2-core machine', working)
    layout = (DOCS / "layout.md").read_text(encoding="utf-8")
    assert '`.venv/bin/python -m pytest -n 3 -m "not integration"`' in layout and re.search(r"full suite.*~\d+ min", layout)


# ----------------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)}
            assert anchor in headings, f"{page.name}: link to {target}: no such heading"


# ----------------------------------------------------------------------------- generated tables
def _markers_written_by_bench() -> set[str]:
    """The first argument of every ``publish(...)`` call in bench/*.py (both branches of an ``x if c else y``)."""
    markers = set()
    for script in (REPO / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "publish":
                first = node.args[0]
                for value in (first.body, first.orelse) if isinstance(first, ast.IfExp) else (first,):
                    assert isinstance(value, ast.Constant), f"{script.name}: publish() needs a literal marker"
                    markers.add(value.value)
    return markers


def test_every_table_a_bench_script_writes_has_exactly_one_page():
    common = _load_bench_common()
    written = _markers_written_by_bench()
    assert {"scifact", "tuning", "gate", "rgb", "latency", "served_store", "trigger"} <= written
    for marker in sorted(written):
        pattern = common.marker_pattern(marker)
        holders = [p.relative_to(REPO) for p in common.pages() if pattern.search(p.read_text(encoding="utf-8"))]
        assert len(holders) == 1, f"bench:{marker} is in {holders or 'no page'}"
        assert holders[0].parts[0] == "docs", f"bench:{marker} belongs in docs/, not {holders[0]}"
    in_pages = {m for p in common.pages() for m in re.findall(r"^<!-- bench:(\w+) -->$", p.read_text(encoding="utf-8"), re.M)}
    assert in_pages <= written, f"tables no script writes: {sorted(in_pages - written)}"


def test_a_bench_table_is_written_into_the_page_that_holds_its_markers(tmp_path, capsys):
    common = _load_bench_common()
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# r\n<!-- bench:other -->\nold\n<!-- /bench:other -->\n")
    page = tmp_path / "docs" / "deep" / "results.md"
    page.write_text("# results\n<!-- bench:gate -->\nold table\n<!-- /bench:gate -->\nafter\n")
    assert common.write_section("gate", "| new |\n", root=tmp_path) == page
    assert page.read_text() == "# results\n<!-- bench:gate -->\n| new |\n<!-- /bench:gate -->\nafter\n"
    assert "old" in (tmp_path / "README.md").read_text()

    (tmp_path / "docs" / "copy.md").write_text(page.read_text())
    assert common.write_section("gate", "| newer |", root=tmp_path) is None
    assert "need exactly one page" in capsys.readouterr().err and "| new |" in page.read_text()


def test_the_settings_table_lives_in_the_configuration_page():
    from ragline.flows.settings import TABLE_START

    assert TABLE_START in (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert TABLE_START not in README.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- exit statuses
def _documented_exit_statuses() -> dict[int, str]:
    section = _section((DOCS / "usage.md").read_text(encoding="utf-8"), "Exit status")
    return {int(code): meaning for code, meaning in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.M)}


def test_the_exit_status_table_is_the_one_the_error_classes_declare():
    from ragline.flows import errors
    from ragline.flows.cli import EXIT_SKIPPED

    documented = _documented_exit_statuses()
    assert set(documented) == {0, 1, errors.EX_USAGE, EXIT_SKIPPED, errors.EX_TEMPFAIL, 130}
    assert "bad configuration or usage" in documented[errors.EX_USAGE]
    assert "try again later" in documented[errors.EX_TEMPFAIL]
    assert "skipped" in documented[EXIT_SKIPPED]
    declared = set()
    for module in (REPO / "flows").rglob("*.py"):
        for name in re.findall(r"^\s+exit_code(?:: ClassVar\[int\])? = (\w+)", module.read_text(), re.M):
            declared.add(int(name) if name.isdigit() else getattr(errors, name))
    assert declared and declared <= set(documented), f"undocumented: {declared - set(documented)}"


# ----------------------------------------------------------------------------- packaging
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_pyproject_names_only_files_the_repository_has():
    for name in set(re.findall(r"\b[\w./-]+\.md\b", (REPO / "pyproject.toml").read_text(encoding="utf-8"))):
        assert (REPO / name).is_file(), f"pyproject.toml names {name}, which the repository does not have"


def test_setuptools_reads_the_project_table_without_a_warning():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"


def test_every_folder_that_ships_files_is_a_listed_package():
    """setuptools warns about (and will drop) a folder with files that is not in ``packages``:
    ``flows/serve/web`` (the chat page) was one."""
    tool = _pyproject()["tool"]["setuptools"]
    packages, package_dir = set(tool["packages"]), tool["package-dir"]
    for package, folder in package_dir.items():
        for sub in (REPO / folder).rglob("*"):
            if sub.is_dir() and sub.name != "__pycache__" and any(f.is_file() for f in sub.iterdir()):
                dotted = ".".join([package, *sub.relative_to(REPO / folder).parts])
                assert dotted in packages, f"{sub.relative_to(REPO)} ships files but {dotted} is not in packages"
    for package, patterns in tool["package-data"].items():
        assert package in packages
        parent = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
        folder = REPO / package_dir[parent] / package[len(parent):].lstrip(".").replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"package-data {package}: {pattern} matches nothing"
