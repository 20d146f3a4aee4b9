"""The architecture, checked by tools rather than review (issue 23): the layering contracts of
pyproject.toml hold (import-linter), no import cycles (lazy imports included), and a ragline
module is imported at module level unless a listed reason says why not."""
from __future__ import annotations

import ast
import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LINT = REPO / "deploy" / "lint-imports"

# (module file, imported module) -> why it is imported inside a function
LAZY = {
    ("flows/run/engine.py", "ragline.flows.run.entrypoints"): "Prefect loads only for orchestrated runs",
    ("flows/run/executors.py", "ragline.flows.run.step_task"): "Prefect loads only for orchestrated runs",
    ("flows/resources/models/embedder.py", "ragline.flows.resources.models.onnx_backend"): "the optional onnx extra",
    ("tasks/jobs/summarize_communities.py", "sklearn.cluster"): "scikit-learn loads SciPy and pandas (~1.5 s): only "
                                                           "the summarize job's clustering needs it",
    ("tasks/ingest/enrich.py", "sklearn.feature_extraction.text"): "scikit-learn loads SciPy and pandas (~1.5 s): only "
                                                             "an enrich step's stopwords need it",
}
# third-party packages whose in-function imports are checked like ragline's (a start-up cost worth a reason)
WATCHED = ("ragline", "sklearn")
# each command imports what it runs, so `--help` and `validate` do not load the engine, Prefect or torch
LAZY_FILES = {str(path.relative_to(REPO)) for path in (REPO / "flows" / "cli").glob("*.py")}


def _linked_package(root: Path, source: Path = REPO) -> Path:
    """<root>/ragline with the installed shape, its folders linked to ``source``'s."""
    package = root / "ragline"
    package.mkdir(parents=True)
    shutil.copy(REPO / "ragline" / "__init__.py", package)
    for folder in ("flows", "tasks", "prompts"):
        (package / folder).symlink_to(source / folder)
    return root


def test_the_layering_contracts_are_kept():
    result = subprocess.run([str(LINT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_lower_layer_importing_the_api_breaks_the_contract(tmp_path):
    """The check is not vacuous: a resource module that imports the HTTP API is refused."""
    copy = tmp_path / "repo"
    for folder in ("flows", "tasks", "prompts"):
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    filters = copy / "flows" / "resources" / "stores" / "filters.py"
    filters.write_text(filters.read_text() + "\nfrom ragline.flows.serve import app  # noqa\n")
    tree = _linked_package(tmp_path / "tree", copy)
    result = subprocess.run([str(REPO / ".venv" / "bin" / "lint-imports"), "--config", str(REPO / "pyproject.toml"),
                             "--no-cache"], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "engine layers BROKEN" in result.stdout
    assert "ragline.flows.resources.stores.filters -> ragline.flows.serve.app" in result.stdout


def test_there_are_no_import_cycles(tmp_path):
    script = (
        "import grimp, sys\n"
        "g = grimp.build_graph('ragline', include_external_packages=False, cache_dir=None,"
        " exclude_type_checking_imports=True)\n"
        "mods = sorted(g.modules)\n"
        "cycles = [m for m in mods if any(g.chain_exists(d, m) for d in g.find_modules_directly_imported_by(m))]\n"
        "print('\\n'.join(cycles))\n")
    tree = _linked_package(tmp_path)
    result = subprocess.run([sys.executable, "-c", script], cwd=tree, env={"PYTHONPATH": str(tree)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"modules on an import cycle:\n{result.stdout}"


def _function_level_imports() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted([*REPO.glob("flows/**/*.py"), *REPO.glob("tasks/**/*.py")]):
        relative = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith(WATCHED):
                    found.append((relative, inner.module, inner.lineno))
                elif isinstance(inner, ast.Import) and any(a.name.startswith(WATCHED) for a in inner.names):
                    found.append((relative, inner.names[0].name, inner.lineno))
    return found


def test_ragline_modules_are_imported_at_module_level_unless_a_reason_is_listed():
    unexplained = [f"{file}:{line} imports {module}" for file, module, line in _function_level_imports()
                   if file not in LAZY_FILES and (file, module) not in LAZY]
    assert unexplained == [], "import these at module level, or list the reason in LAZY:\n" + "\n".join(unexplained)


def test_registering_the_builtin_stages_loads_no_scikit_learn_scipy_or_pandas():
    """Every command that runs a pipeline imports the modules of its stages: the stages import their
    heavy libraries when they run, not when they register (scikit-learn alone loads SciPy and pandas).
    Every declared stage is imported here, as a file naming all of them would."""
    script = ("import sys\nfrom ragline.flows.spec import registry\nassert len(registry.all_stages()) >= 35\n"
              "print(' '.join(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"imported when the stages register: {result.stdout}"


@pytest.mark.parametrize("package", ["cli", "spec", "run", "serve", "ops", "evaluation", "resources"])
def test_each_package_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((REPO / "flows" / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 8, f"flows/{package}/__init__.py needs a docstring saying what it owns"


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level names the product imports (module or function level) that are not the standard library's
    or ragline's own, with the files that import each."""
    found: dict[str, set[str]] = {}
    for path in [*REPO.glob("flows/**/*.py"), *REPO.glob("tasks/**/*.py"), *REPO.glob("ragline/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("ragline", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _requirement_names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_every_imported_third_party_package_is_declared():
    """A package ragline imports is named in pyproject's dependencies or the extra of the feature that
    uses it, not reached through another package's requirements (issue 37.4)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = _requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= _requirement_names(extra)
    distributions = importlib.metadata.packages_distributions()
    undeclared = {name: sorted(files) for name, files in _third_party_imports().items()
                  if not {canonicalize_name(d) for d in distributions.get(name, [name])} & declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (``tests...test_*``) a file imports, at any depth of its code (not in strings:
    a subprocess script that imports its own module is not an import of this file)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found += [name for name in names if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """What several test modules share lives in tests/helpers/ (or a conftest): a test module that
    imports another runs that module's import-time code and ties two files' contents together."""
    tests = REPO / "tests"
    offenders = {str(path.relative_to(REPO)): found for path in sorted(tests.rglob("*.py"))
                 if (found := imported_test_modules(path))}
    assert offenders == {}


def test_an_import_of_a_test_module_is_found(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("def f():\n    from tests.flows.run.test_engine import x\n\nimport tests.tasks.test_llm_stages\n"
                       "SCRIPT = 'from tests.flows.test_x import y'\n")
    assert sorted(imported_test_modules(planted)) == ["tests.flows.run.test_engine", "tests.tasks.test_llm_stages"]
