"""Compile pipelines.yaml into executable pipelines: parse, check, build the compiled model.

The pieces live beside this module: ``spec`` (YAML with lines, pydantic models), ``checks``
(semantic validation, DAG and wiring), ``model`` (compiled projects, pipelines, steps) and
``fingerprint`` (what shapes indexed content).

User stages (``task: pkg.module.stage``) come only from modules in the external allowlist:
``RAGLINE_ALLOW_MODULES``, ``registry.set_allowed_modules``, ``load_project(allow_modules=...)`` and
``[tool.ragline] allow_modules`` in the nearest pyproject.toml at or above the pipelines file. A
file's ``settings.allow_modules`` can only narrow that list.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Iterable

from ragline.flows.contracts import PipelineKind
from ragline.flows.spec import registry
from ragline.flows.spec.checks import PIPELINE_INPUTS, Checker
from ragline.flows.spec.model import CompiledPipeline, CompiledStep, Project
from ragline.flows.spec.prompts import prompt_problems
from ragline.flows.settings import pyproject_table
from ragline.flows.spec.parse import SpecError, SpecValidationError, parse_file
from ragline.flows.spec import collections, overlay

__all__ = ["load_project", "validate_file", "Project", "CompiledPipeline", "CompiledStep", "DEFAULT_FILE",
           "PIPELINE_INPUTS", "prompt_problems", "external_allowlist", "project_allowlist"]

DEFAULT_FILE = "pipelines.yaml"
PYPROJECT = "pyproject.toml"


def validate_file(path: str | Path = DEFAULT_FILE, allow_modules: Iterable[str] = (),
                  tuned: bool | None = None) -> list[SpecError]:
    """Every error in the file (and in its tuned overlay), in file order; empty: it compiles."""
    try:
        load_project(path, allow_modules=allow_modules, tuned=tuned)
    except SpecValidationError as exc:
        return exc.errors
    return []


def load_project(path: str | Path = DEFAULT_FILE, allow_modules: Iterable[str] = (),
                 tuned: bool | None = None, source: str | Path | None = None,
                 only: Iterable[str] | None = None) -> Project:
    """Parse, validate and compile a pipelines file, or raise SpecValidationError with all errors.
    ``allow_modules`` adds to the external allowlist of user-stage modules (e.g. a CLI flag).
    ``tuned``: apply the overlay `ragline tune` wrote beside the data (``flows.overlay``); default:
    yes unless RAGLINE_TUNED=0. ``source``: the file's text pinned elsewhere (``ragline serve``'s
    snapshot); paths still resolve beside ``path``. ``only``: compile just these pipelines (see
    ``_selected``); the project is then ``partial``."""
    path = Path(path).resolve()
    spec, doc, errors = parse_file(path, source)
    if spec is None or doc is None:
        raise SpecValidationError(errors)
    allowed, allow_errors = external_allowlist(path, allow_modules)
    checker = Checker(spec, doc, path, allowed)
    checker.errors.extend(errors + allow_errors)
    selected = _selected(spec, only)
    project = Project(path, spec, source=Path(source).resolve() if source else None,
                      partial=len(selected) < len(spec.pipelines))
    for name, pipe in spec.pipelines.items():
        if name not in selected:
            continue
        compiled = checker.pipeline(name, pipe, project)
        if compiled is not None:
            project.pipelines[name] = compiled
    collections.expand(checker, project)
    if checker.errors:
        raise SpecValidationError(sorted(checker.errors, key=lambda e: (e.line or 0, e.message)))

    if overlay.enabled_by_default() if tuned is None else tuned:
        return overlay.apply_overlay(project)
    return project


def _selected(spec, only: Iterable[str] | None) -> set[str]:
    """The pipelines to compile: ``only`` and, when the file has collections, its ingestion
    pipelines (the templates they are compiled from). Why: a query from the terminal compiles what it
    runs, not every pipeline of the file (checking the others imported their stages and parsed their
    prompts: ~0.2 s of a cold ``ragline search``, issue 38); mistakes elsewhere in the file are
    ``ragline validate``'s to report. A name the file does not define selects every pipeline, so the
    error that follows lists them all (a collection's ``index@name`` is compiled, not defined)."""
    if only is None or any(name not in spec.pipelines for name in only):
        return set(spec.pipelines)
    if not spec.collections:
        return set(only)
    return set(only) | {n for n, p in spec.pipelines.items() if p.kind == PipelineKind.INGESTION}


def external_allowlist(path: Path, extra: Iterable[str] = ()) -> tuple[tuple[str, ...], list[SpecError]]:
    """Modules user stages may come from, from outside the pipelines file: the environment, code,
    ``extra`` and the installing project's pyproject.toml; problems with them as errors."""
    modules, errors = project_allowlist(path)
    try:
        return tuple(dict.fromkeys([*registry.allowed_modules(extra), *modules])), errors
    except ValueError as exc:
        return modules, errors + [SpecError(str(path), None, str(exc))]


def project_allowlist(path: Path) -> tuple[tuple[str, ...], list[SpecError]]:
    """``[tool.ragline] allow_modules`` of the nearest pyproject.toml at or above the pipelines file:
    the project's build settings, trusted like its code (installing it runs its build), unlike YAML."""
    pyproject = next((d / PYPROJECT for d in path.parents if (d / PYPROJECT).is_file()), None)
    if pyproject is None:
        return (), []
    try:
        settings = pyproject_table(pyproject)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return (), [SpecError(str(pyproject), None, f"cannot read [tool.ragline]: {exc}")]
    modules = settings.get("allow_modules", []) if isinstance(settings, dict) else None
    if not isinstance(modules, list) or not all(registry.is_module_name(m) for m in modules):
        return (), [SpecError(str(pyproject), _toml_line(pyproject, "allow_modules"),
                              "[tool.ragline] allow_modules must be a list of dotted module names")]
    return tuple(modules), []


def _toml_line(path: Path, key: str) -> int | None:
    lines = path.read_text(encoding="utf-8").splitlines()
    return next((i for i, line in enumerate(lines, start=1) if line.strip().startswith(key)), None)
