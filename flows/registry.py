"""The explicit registry from YAML task names to stages.

A stage is a plain function with a typed contract: a pydantic ``Params`` model, data inputs
(its other annotated parameters, wired by name to upstream outputs), resource roles it
``uses`` and one named output it ``produces``. Builtin stages are registered by importing
``tasks`` (an explicit list, no import side effects elsewhere); user stages are allowed by
dotted path only from modules named in an allowlist.
"""
from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

RESERVED_ARGS = ("params", "ctx")


class NoParams(BaseModel):
    """For stages that take no parameters."""

    model_config = {"extra": "forbid"}


@dataclass
class Stage:
    """A registered stage and its contract."""

    name: str
    fn: Callable[..., Any]
    params: type[BaseModel]
    produces: str
    uses: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kind: str = "any"  # "ingestion", "query" or "any"
    prompt: str | Callable[[Any], str] | None = None  # default template name, or params -> name
    version: int = 1  # bump when the stage's output changes for the same input: it re-indexes
    description: str = ""
    plan: Callable[..., Any] | None = None
    finalize: Callable[..., Any] | None = None

    @property
    def inputs(self) -> dict[str, Any]:
        """Data inputs: annotated parameters that are neither params, ctx nor resources."""
        hints = typing.get_type_hints(self.fn)
        names = inspect.signature(self.fn).parameters
        return {n: hints.get(n, Any) for n in names if n not in RESERVED_ARGS and n not in self.uses}

    @property
    def optional_inputs(self) -> set[str]:
        params = inspect.signature(self.fn).parameters
        return {n for n in self.inputs if params[n].default is not inspect.Parameter.empty}

    @property
    def output_type(self) -> Any:
        return typing.get_type_hints(self.fn).get("return", Any)

    def default_prompt(self, params: BaseModel) -> str | None:
        return self.prompt(params) if callable(self.prompt) else self.prompt

    def on_plan(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook an ingestion sink uses to decide which documents changed."""
        self.plan = fn
        return fn

    def on_finalize(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook an ingestion sink runs once after every batch was written."""
        self.finalize = fn
        return fn


_REGISTRY: dict[str, Stage] = {}


def stage(name: str, *, params: type[BaseModel] = NoParams, produces: str,
          uses: dict[str, tuple[str, ...]] | None = None, kind: str = "any",
          prompt: str | Callable[[Any], str] | None = None, version: int = 1) -> Callable[[Callable[..., Any]], Stage]:
    """Declare a function as a stage under ``name``."""

    def register(fn: Callable[..., Any]) -> Stage:
        doc = inspect.getdoc(fn) or ""
        entry = Stage(name=name, fn=fn, params=params, produces=produces, uses=dict(uses or {}),
                      kind=kind, prompt=prompt, version=version, description=doc.splitlines()[0] if doc else "")
        if name in _REGISTRY and _REGISTRY[name].fn.__module__ != fn.__module__:
            raise ValueError(f"stage {name!r} is already registered by {_REGISTRY[name].fn.__module__}")
        _REGISTRY[name] = entry
        return entry

    return register


def load_builtins() -> None:
    importlib.import_module("tasks")


def get_stage(name: str, allowed_modules: list[str] = ()) -> Stage | None:
    """The stage for a YAML task name: a registered name, or a dotted path to a Stage in an
    allowlisted module (``settings.allow_modules``), so a YAML file cannot import arbitrary code."""
    load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        if not any(module_name == p or module_name.startswith(p + ".") for p in allowed_modules):
            raise PermissionError(f"module '{module_name}' is not in the stage allowlist "
                                  f"(add it to settings.allow_modules)")
        obj = getattr(importlib.import_module(module_name), attr, None)
        return obj if isinstance(obj, Stage) else None
    return None


def stage_names() -> list[str]:
    load_builtins()
    return sorted(_REGISTRY)
