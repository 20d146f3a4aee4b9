"""The explicit registry from YAML task names to stages.

A stage is a plain function with a typed contract: a pydantic ``Params`` model, data inputs
(its other annotated parameters, wired by name to upstream outputs), resource roles it
``uses`` and one named output it ``produces``. Builtin stages are declared by ``tasks``'s
``STAGES`` (an explicit map from stage name to module, no import side effects elsewhere): a
module is imported when a pipeline names its stage, so a run imports the stages it uses only.
User stages are allowed by dotted path only from modules named in an allowlist that lives outside
any pipelines file (``RAGLINE_ALLOW_MODULES``, ``set_allowed_modules``, ``[tool.ragline] allow_modules``).
"""
from __future__ import annotations

import importlib
import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pydantic import BaseModel

from ragline.flows import settings

RESERVED_ARGS = ("params", "ctx")
ALLOW_ENV = settings.env_name("allow_modules")
ALLOW_HINT = f"set {ALLOW_ENV} (comma-separated modules) or [tool.ragline] allow_modules in pyproject.toml"
MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"  # a dotted module name
Variables = tuple[str, ...]


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
    kind: str = "any"  # "ingestion", "query", "job" or "any"
    prompt: str | Callable[[Any], str] | None = None  # default template name, or params -> name
    # The variables ``ctx.prompt`` passes (or params -> them); None: undeclared, so not checked.
    prompt_variables: Variables | Callable[[Any], Variables] | None = None
    # Templates rendered with ``ctx.prompt_for``: name -> variables (or params -> that mapping).
    other_prompts: Mapping[str, Variables] | Callable[[Any], Mapping[str, Variables]] = field(default_factory=dict)
    version: int = 1  # bump when the stage's output changes for the same input: it re-indexes
    description: str = ""
    plan: Callable[..., Any] | None = None
    finalize: Callable[..., Any] | None = None
    session: Callable[..., Any] | None = None
    read: Callable[..., Any] | None = None  # a source stage's: the full documents of unread ones it listed
    pending: Callable[..., Any] | None = None  # a sink's: the next page of its work list (``on_pending``)
    # (params, wiring) -> the upstream step ids this step would ignore as configured (fuse: those it
    # weighs 0); a step whose output every consumer ignores is not run
    ignores: Callable[[Any, Mapping[str, list[str]]], set[str]] | None = None
    # params -> the resource roles that shape the output as configured (None: every bound one); the
    # others stay out of the index fingerprint (enrich: an LLM bound but unused re-indexes nothing)
    shaping_roles: Callable[[Any], set[str]] | None = None
    # params -> the optional roles (see ``optional_roles``) the step reads as configured, each with the
    # ``with`` field that makes it read and why (None: every optional role, bound when the file has a
    # fitting resource). The others are left unbound (a rewrite that never reads BM25 does not make a
    # file with two BM25 indexes name one); a read one the file lacks is an error at that field, before
    # anything runs. A role mapped to None is read where the file has one and done without otherwise
    # (answerable's embedder for ``min_similarity: auto``): bound as if there were no hook
    reads_roles: Callable[[Any], Mapping[str, tuple[str, str] | None]] | None = None
    # params -> every label the step can give (a classifier, ``classify``): a later step's ``when``
    # may name it, and the checker holds that ``when`` to these labels
    labels: Callable[[Any], list[str]] | None = None
    # params -> the named collections it routes requests to, by label: checked against the file's `collections`
    routes: Callable[[Any], dict[str, list[str]]] | None = None
    # A query stage bound to an index that reads every named collection the request selects itself
    # (``tasks.collection_index``) and merges them into one output (``retrieve_summaries``): checked
    # and authorised as a retriever over those collections (``CompiledStep.collections``), but called
    # once, not once per collection
    merges_collections: bool = False

    @property
    def inputs(self) -> dict[str, Any]:
        """Data inputs: annotated parameters that are neither params, ctx nor resources."""
        hints = typing.get_type_hints(self.fn)
        names = inspect.signature(self.fn).parameters
        return {n: hints.get(n, Any) for n in names if n not in RESERVED_ARGS and n not in self.uses}

    @property
    def optional_roles(self) -> set[str]:
        """Resource roles whose parameter has a default: bound when the file has a fitting resource."""
        params = inspect.signature(self.fn).parameters
        return {r for r in self.uses if r in params and params[r].default is not inspect.Parameter.empty}

    @property
    def optional_inputs(self) -> set[str]:
        params = inspect.signature(self.fn).parameters
        return {n for n in self.inputs if params[n].default is not inspect.Parameter.empty}

    @property
    def output_type(self) -> Any:
        return typing.get_type_hints(self.fn).get("return", Any)

    def default_prompt(self, params: BaseModel | None) -> str | None:
        """The template a step renders when it names none; None if it depends on unknown params."""
        if callable(self.prompt):
            return self.prompt(params) if params is not None else None
        return self.prompt

    def variables(self, params: BaseModel) -> Variables | None:
        """What the step's own template receives, so validation can check it before anything runs."""
        declared = self.prompt_variables
        return tuple(declared(params)) if callable(declared) else declared

    def extra_prompts(self, params: BaseModel) -> dict[str, Variables]:
        """Fixed templates the stage also renders (``ctx.prompt_for``), with their variables."""
        declared = self.other_prompts
        return dict(declared(params) if callable(declared) else declared)

    def on_plan(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook an ingestion sink uses to decide which documents changed."""
        self.plan = fn
        return fn

    def on_finalize(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook an ingestion sink runs once after every batch was written."""
        self.finalize = fn
        return fn

    def on_read(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook a source stage reads listed-but-unread documents with, one batch at a time."""
        self.read = fn
        return fn

    def on_pending(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register the hook an ingestion sink hands out its work list with, a batch at a time: the
        documents to index that the source steps queued in its state (``after``: the last source id
        of the previous batch; ``size``: the batch size), as ``WorkPage``."""
        self.pending = fn
        return fn

    def on_session(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register a context manager an ingestion sink holds around the whole run (e.g. a writer lease)."""
        self.session = fn
        return fn


_REGISTRY: dict[str, Stage] = {}


def stage(name: str, *, params: type[BaseModel] = NoParams, produces: str,
          uses: dict[str, tuple[str, ...]] | None = None, kind: str = "any",
          prompt: str | Callable[[Any], str] | None = None,
          prompt_variables: Variables | Callable[[Any], Variables] | None = None,
          other_prompts: Mapping[str, Variables] | Callable[[Any], Mapping[str, Variables]] | None = None,
          version: int = 1,
          ignores: Callable[[Any, Mapping[str, list[str]]], set[str]] | None = None,
          shaping_roles: Callable[[Any], set[str]] | None = None,
          reads_roles: Callable[[Any], Mapping[str, tuple[str, str] | None]] | None = None,
          labels: Callable[[Any], list[str]] | None = None,
          routes: Callable[[Any], dict[str, list[str]]] | None = None,
          merges_collections: bool = False,
          ) -> Callable[[Callable[..., Any]], Stage]:
    """Declare a function as a stage under ``name``. A stage that renders prompts declares the
    variables it passes (``prompt_variables``, ``other_prompts``) so templates are checked up front."""

    def register(fn: Callable[..., Any]) -> Stage:
        doc = inspect.getdoc(fn) or ""
        entry = Stage(name=name, fn=fn, params=params, produces=produces, uses=dict(uses or {}),
                      kind=kind, prompt=prompt, prompt_variables=prompt_variables,
                      other_prompts=other_prompts or {}, version=version, ignores=ignores, shaping_roles=shaping_roles,
                      reads_roles=reads_roles,
                      labels=labels, routes=routes, merges_collections=merges_collections,
                      description=doc.splitlines()[0] if doc else "")
        if name in _REGISTRY and _REGISTRY[name].fn.__module__ != fn.__module__:
            raise ValueError(f"stage {name!r} is already registered by {_REGISTRY[name].fn.__module__}")
        if _DECLARED.get(name, fn.__module__) != fn.__module__:  # declared by a package, not yet imported
            raise ValueError(f"stage {name!r} is already registered by {_DECLARED[name]}")
        _REGISTRY[name] = entry
        return entry

    return register


BUILTIN_GROUP = "ragline.stages"  # entry-point group of packages that register stages (builtins: `tasks`)
DECLARATION = "STAGES"  # a package's {stage name: module} map, imported stage by stage when a pipeline names one
_DECLARED: dict[str, str] = {}  # stage name -> the module that registers it, not necessarily imported yet
_builtins_loaded = False


def load_builtins() -> None:
    """Read the packages that declare stages through the ``ragline.stages`` entry points: the
    engine never imports the stage package by name, so stages may import the engine freely. A
    package with a ``STAGES`` map (``tasks``) is read, its modules imported by ``get_stage`` when
    a pipeline names one of its stages; any other entry point is imported, registering its stages."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    from importlib.metadata import entry_points

    for entry in entry_points(group=BUILTIN_GROUP):
        declared = getattr(entry.load(), DECLARATION, None)
        if isinstance(declared, Mapping):
            declare(declared)
    _builtins_loaded = True


def declare(stages: Mapping[str, str]) -> None:
    """Declare stages by name -> the module that registers it, imported when a pipeline names one."""
    for name, module in stages.items():
        if not isinstance(name, str) or not is_module_name(module):
            raise ValueError(f"stage {name!r}: {module!r} is not a dotted module name")
        taken = _DECLARED.get(name) or (_REGISTRY[name].fn.__module__ if name in _REGISTRY else module)
        if taken != module:
            raise ValueError(f"stage {name!r} is already registered by {taken}")
        _DECLARED[name] = module


def _import_declared(name: str) -> Stage:
    """Import the module declared for ``name``; its failure is an ImportError naming the stage, so
    validation reports it on the step's ``task`` line before anything runs."""
    module = _DECLARED[name]
    try:
        importlib.import_module(module)
    except Exception as exc:
        raise ImportError(f"stage '{name}': importing module '{module}' failed: {type(exc).__name__}: {exc}") from exc
    if name not in _REGISTRY:
        raise ImportError(f"stage '{name}': module '{module}' does not register it (its @stage name differs)")
    return _REGISTRY[name]


def get_stage(name: str, allowed_modules: Iterable[str] = ()) -> Stage | None:
    """The stage for a YAML task name: a registered name (its module imported now if only declared),
    or a dotted path to a Stage in a module the caller allows (see ``allowed_modules``); nothing
    else is ever imported."""
    load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _DECLARED:
        return _import_declared(name)
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        if not module_allowed(module_name, allowed_modules):
            raise PermissionError(f"module '{module_name}' is not allowed: {ALLOW_HINT}")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise
        except Exception as exc:  # the module itself fails: report it, never crash validation
            raise ImportError(f"importing module '{module_name}' failed: {type(exc).__name__}: {exc}") from exc
        obj = getattr(module, attr, None)
        return obj if isinstance(obj, Stage) else None
    return None


def all_stages() -> dict[str, Stage]:
    """Every stage, each declared module imported (a listing or a test; a run imports only its own)."""
    load_builtins()
    for name in list(_DECLARED):
        if name not in _REGISTRY:
            _import_declared(name)
    return dict(_REGISTRY)


# ----------------------------------------------------------------------------- module allowlist
# The allowlist lives outside pipelines files: a file that could widen it could import anything.
_DOTTED = re.compile(MODULE_PATTERN)
_SET_IN_CODE: tuple[str, ...] = ()


def is_module_name(name: object) -> bool:
    return isinstance(name, str) and bool(_DOTTED.match(name))


def module_allowed(module: str, allowlist: Iterable[str]) -> bool:
    """True if ``module`` is an allowlisted module or inside an allowlisted package."""
    return is_module_name(module) and any(module == p or module.startswith(p + ".") for p in allowlist)


def set_allowed_modules(modules: Iterable[str]) -> None:
    """Allow user stages from these modules in this process (replaces the previous call's list)."""
    global _SET_IN_CODE
    _SET_IN_CODE = _checked_names(modules, "set_allowed_modules")


def allowed_modules(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The process-wide allowlist: ``RAGLINE_ALLOW_MODULES``, ``set_allowed_modules`` and ``extra``."""
    from_env = settings.project().allow_modules
    return tuple(dict.fromkeys([*_checked_names(from_env, ALLOW_ENV), *_SET_IN_CODE,
                                *_checked_names(extra, "allow_modules")]))


def _checked_names(modules: Iterable[str], origin: str) -> tuple[str, ...]:
    modules = [modules] if isinstance(modules, str) else list(modules)
    bad = [m for m in modules if not is_module_name(m)]
    if bad:
        raise ValueError(f"{origin}: not a dotted module name: {', '.join(map(repr, bad))}")
    return tuple(modules)


def stage_names() -> list[str]:
    """Every stage's name, registered or declared (nothing is imported)."""
    load_builtins()
    return sorted({*_REGISTRY, *_DECLARED})
