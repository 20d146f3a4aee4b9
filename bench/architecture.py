"""The tree's shape at two revisions, side by side (issue 37's "measure and report"): modules and lines
per package, the largest modules, function-level imports, raises of builtin exceptions in product
code, and the pairs of repeated code (the `duplicates` command) in product code and in tests.

Usage: .venv/bin/python bench/architecture.py [--before 8e18059] [--after HEAD]
Reads each revision from git (``git archive`` into a temporary folder): the working tree is not
touched and uncommitted changes do not count. Suite times are not here: they are measured runs
(docs/results.md), not properties of the text.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import io
import re
import subprocess
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("flows", "tasks", "ragline")  # the installed packages (pyproject's package-dir)
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}


def extract(revision: str, into: Path) -> Path:
    """The revision's tracked files under ``into``."""
    archive = subprocess.run(["git", "archive", revision], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def package_of(path: Path, root: Path) -> str:
    """``flows/serve/auth/keys.py`` -> ``flows/serve``: a package two levels down, or the top folder."""
    parts = path.relative_to(root).parts[:-1]
    return "/".join(parts[:2]) or "."


def builtin_raises(tree: ast.AST) -> tuple[Counter, int]:
    """``raise ValueError(...)`` and the like, by exception name (a bare ``raise`` is not counted), and
    how many of them are in pydantic validators (where ValueError is pydantic's own protocol: it
    becomes a ValidationError naming the field)."""
    found: Counter = Counter()
    in_validators = 0
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]:
        validator = any("validator" in ast.unparse(d) for d in getattr(function, "decorator_list", []))
        for node in _own_nodes(function):
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(target, ast.Name) and target.id in BUILTIN_ERRORS:
                    found[target.id] += 1
                    in_validators += validator
    return found, in_validators


def _own_nodes(scope: ast.AST):
    """The nodes of a function (or module) outside the functions nested in it."""
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
            yield from _own_nodes(child)


def nested_function_imports(tree: ast.AST) -> int:
    """Imports in functions, each counted once however deeply its function is nested."""
    counted: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            counted.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return len(counted)


def duplicate_pairs(folder: Path) -> int:
    """How many pairs of repeated runs of six or more lines ``duplicates`` finds below ``folder``."""
    out = subprocess.run(["duplicates", "--repo", str(folder), "--most", "1", "--seconds", "120"],
                         capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else ""
    if first.startswith("no duplicates"):
        return 0
    match = re.search(r"(\d[\d,]*) pairs?", first)
    return int(match.group(1).replace(",", "")) if match else -1


def measure(root: Path) -> dict:
    modules = [p for package in PRODUCT for p in sorted((root / package).rglob("*.py"))]
    per_package: dict[str, list[int]] = {}
    sizes, lazy, raises, in_validators = [], 0, Counter(), 0
    for path in modules:
        text = path.read_text()
        lines = text.count("\n")
        per_package.setdefault(package_of(path, root), [0, 0])
        per_package[package_of(path, root)][0] += 1
        per_package[package_of(path, root)][1] += lines
        sizes.append((lines, str(path.relative_to(root))))
        tree = ast.parse(text)
        lazy += nested_function_imports(tree)
        found, validators = builtin_raises(tree)
        raises, in_validators = raises + found, in_validators + validators
    return {"modules": len(modules), "lines": sum(s for s, _ in sizes), "packages": per_package,
            "largest": sorted(sizes, reverse=True)[:6], "over_1000": sum(size > 1000 for size, _ in sizes),
            "lazy_imports": lazy, "raises": raises, "raises_in_validators": in_validators,
            "test_modules": len(list((root / "tests").rglob("test_*.py"))),
            "duplicates_product": sum(duplicate_pairs(root / p) for p in PRODUCT if (root / p).is_dir()),
            "duplicates_tests": duplicate_pairs(root / "tests")}


def report(before: dict, after: dict, names: tuple[str, str]) -> str:
    rows = [f"| | {names[0]} | {names[1]} |", "|---|---:|---:|",
            f"| product modules / lines | {before['modules']} / {before['lines']:,} | {after['modules']} / {after['lines']:,} |",
            f"| packages (two levels) | {len(before['packages'])} | {len(after['packages'])} |",
            f"| modules over 1,000 lines | {before['over_1000']} | {after['over_1000']} |",
            f"| function-level imports | {before['lazy_imports']} | {after['lazy_imports']} |",
            f"| raises of builtin exceptions (in pydantic validators) | {sum(before['raises'].values())} "
            f"({before['raises_in_validators']}) | {sum(after['raises'].values())} ({after['raises_in_validators']}) |",
            f"| duplicate pairs, product / tests | {before['duplicates_product']} / {before['duplicates_tests']} | "
            f"{after['duplicates_product']} / {after['duplicates_tests']} |",
            f"| test modules | {before['test_modules']} | {after['test_modules']} |"]
    out = ["\n".join(rows), ""]
    for name, figures in zip(names, (before, after)):
        out.append(f"{name}: largest modules " + ", ".join(f"{path} {size:,}" for size, path in figures["largest"]))
        out.append(f"{name}: builtin raises " + ", ".join(f"{k} {v}" for k, v in figures["raises"].most_common()))
        out.append(f"{name}: per package " + ", ".join(f"{k} {m}/{n:,}" for k, (m, n) in sorted(figures["packages"].items())))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="8e18059")
    parser.add_argument("--after", default="HEAD")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        figures = [measure(extract(rev, Path(folder) / rev.replace("/", "_"))) for rev in (args.before, args.after)]
    print(report(*figures, names=(args.before, args.after)))


if __name__ == "__main__":
    main()
