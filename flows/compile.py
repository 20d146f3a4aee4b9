"""Compile pipelines.yaml into executable pipelines: semantic validation, DAG and wiring.

Wiring rule (Haystack-like, checked before anything runs): a step's data input ``x`` is fed
by the nearest upstream steps that produce ``x``; several producers at the same distance fan
in (their lists are concatenated); with no producer, ``x`` must be an input of the pipeline
(``query`` for query pipelines). A step without ``after`` follows the step above it.

User stages (``task: pkg.module.stage``) come only from modules in the external allowlist:
``RAGLINE_ALLOW_MODULES``, ``registry.set_allowed_modules``, ``load_project(allow_modules=...)`` and
``[tool.ragline] allow_modules`` in the nearest pyproject.toml at or above the pipelines file. A
file's ``settings.allow_modules`` can only narrow that list.
"""
from __future__ import annotations

import hashlib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from ragline.flows import registry
from ragline.flows.prompts import PromptLibrary, library
from ragline.flows.registry import ALLOW_HINT, Stage, module_allowed
from ragline.flows.spec import LocatedYaml, PipelinesFile, PipelineSpec, SpecError, SpecValidationError, StepSpec, \
    locate, parse_file, suggest

PIPELINE_INPUTS: dict[str, dict[str, Any]] = {
    "query": {"query": "Query"},
    "ingestion": {},
}
DEFAULT_FILE = "pipelines.yaml"
PYPROJECT = "pyproject.toml"


@dataclass
class CompiledStep:
    spec: StepSpec
    stage: Stage
    params: BaseModel
    resources: dict[str, str]  # role -> resource name
    upstream: list[str]
    wiring: dict[str, list[str]]  # input -> producer step ids; [] means a pipeline input
    prompt: str | None

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass
class CompiledPipeline:
    name: str
    spec: PipelineSpec
    steps: list[CompiledStep]  # topological order
    project: "Project"
    output: str = ""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # applied by with_overrides, for workers

    def step(self, step_id: str) -> CompiledStep:
        return next(s for s in self.steps if s.id == step_id)

    @property
    def kind(self) -> str:
        return self.spec.kind

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> "CompiledPipeline":
        """A copy whose steps' params are updated (e.g. the CLI's folder for `load`), re-validated."""
        steps = []
        for s in self.steps:
            if s.id in overrides:
                merged = {**s.params.model_dump(exclude_unset=True), **overrides[s.id]}
                try:
                    params = s.stage.params.model_validate(merged)
                except ValidationError as exc:
                    raise SpecValidationError([SpecError(str(self.project.path), None, _pydantic_message(e),
                                                         self.name, s.id, "with." + ".".join(map(str, e["loc"])))
                                               for e in exc.errors()]) from exc
                prompt = s.spec.prompt or s.stage.default_prompt(params)  # e.g. a new rerank method
                problems = prompt_problems(self.project.prompts, s.stage, params, prompt)
                if problems:
                    raise SpecValidationError([SpecError(str(self.project.path), None, problem, self.name, s.id,
                                                         "prompt") for problem in problems])
                s = CompiledStep(s.spec, s.stage, params, s.resources, s.upstream, s.wiring, prompt)
            steps.append(s)
        unknown = set(overrides) - {s.id for s in self.steps}
        if unknown:
            raise KeyError(f"pipeline {self.name!r} has no step {sorted(unknown)}")
        merged = {sid: {**self.overrides.get(sid, {}), **overrides.get(sid, {})}
                  for sid in {*self.overrides, *overrides}}
        return CompiledPipeline(self.name, self.spec, steps, self.project, self.output, merged)

    def fingerprint(self, steps: list[CompiledStep]) -> str:
        """Hash of what shapes the content indexed by ``steps``: per step its stage name and version,
        params, prompt texts and resource fingerprints, chained to the chosen steps its data comes
        from. Step ids are left out and independent branches are sorted, so renaming a step or
        reordering unrelated ones keeps the index; reordering along the data path does not."""
        chosen = {s.id: s for s in steps}
        every = {**{s.id: s for s in self.steps}, **chosen}
        digests: dict[str, str] = {}

        def digest(step: CompiledStep) -> str:
            if step.id not in digests:
                feeds = {port: sorted(digest(chosen[p]) for p in _chosen_producers(every, producers, chosen))
                         for port, producers in sorted(step.wiring.items())}
                digests[step.id] = _sha([self._content(step), feeds])
            return digests[step.id]

        return _sha(sorted(digest(s) for s in steps))[:16]

    def _content(self, step: CompiledStep) -> list[Any]:
        """The id-free part of one step's fingerprint."""
        resources = {role: _resource_fingerprint(self.project.spec.resources[name])
                     for role, name in sorted(step.resources.items())}
        names = [step.prompt] if step.prompt else []
        names += sorted(step.stage.extra_prompts(step.params))
        library = self.project.prompts
        prompts = {file: library.text(file) for name in names for file in library.files(name)}
        return [step.stage.name, step.stage.version, step.params.model_dump(mode="json"), resources, prompts]


def _chosen_producers(every: dict[str, CompiledStep], producers: Iterable[str],
                      chosen: dict[str, CompiledStep]) -> list[str]:
    """The chosen steps whose data reaches these producers (through steps that are not chosen)."""
    found: list[str] = []
    for producer in producers:
        if producer in chosen:
            found.append(producer)
        elif producer in every:
            upstream = [p for ps in every[producer].wiring.values() for p in ps]
            found.extend(_chosen_producers(every, upstream, chosen))
    return list(dict.fromkeys(found))


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _resource_fingerprint(spec: Any) -> Any:
    fields = getattr(spec, "fingerprint_fields", None)
    return fields() if fields else spec.model_dump(mode="json")


@dataclass
class Project:
    """A validated pipelines file and everything compiled from it."""

    path: Path
    spec: PipelinesFile
    pipelines: dict[str, CompiledPipeline] = field(default_factory=dict)
    data_dir: Path | None = None  # where relative resource paths point; default: beside the file
    resource_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # by with_resource, for workers

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def prompts(self) -> PromptLibrary:
        return library(str((self.base_dir / self.spec.settings.prompts_dir).resolve()))

    def pipeline(self, name: str) -> CompiledPipeline:
        if name not in self.pipelines:
            raise KeyError(f"no pipeline {name!r} in {self.path}{suggest(name, list(self.pipelines))}; "
                           f"available: {', '.join(self.pipelines)}")
        return self.pipelines[name]

    def with_resource(self, name: str, **fields: Any) -> "Project":
        """A copy of the project with one resource's settings changed (validated like the file)."""
        from pydantic import TypeAdapter

        from ragline.flows.resources import ResourceSpec

        if name not in self.spec.resources:
            raise KeyError(f"no resource {name!r}{suggest(name, list(self.spec.resources))}")
        merged = {**self.spec.resources[name].model_dump(), **fields}
        resources = {**self.spec.resources, name: TypeAdapter(ResourceSpec).validate_python(merged)}
        project = self._copy(resources, self.data_dir)
        project.resource_overrides[name] = {**self.resource_overrides.get(name, {}), **fields}
        return project

    def _copy(self, resources: dict[str, Any], data_dir: Path | None) -> "Project":
        """The same pipelines over other resource settings (the compiled steps are reused)."""
        spec = self.spec.model_copy(update={"resources": resources})
        spec._invalid_resources = set()
        project = Project(self.path, spec, data_dir=data_dir, resource_overrides=dict(self.resource_overrides))
        for pipe_name, pipe in self.pipelines.items():
            project.pipelines[pipe_name] = CompiledPipeline(pipe.name, pipe.spec, pipe.steps, project, pipe.output)
        return project

    def relocated(self, data_dir: Path) -> "Project":
        """A copy whose indexes all live under ``data_dir``, whatever the file says: relative paths
        move with it, absolute ones become ``data_dir/<resource name>``, and a Chroma server is
        replaced by an embedded store there. Evaluation and ``--data-dir`` rely on it never writing
        to the configured index."""
        from pydantic import TypeAdapter

        from ragline.flows.resources import LOCATED_TYPES, ResourceSpec

        resources = dict(self.spec.resources)
        for name, spec in resources.items():
            if spec.type not in LOCATED_TYPES:
                continue
            fields = spec.model_dump()
            if Path(fields["path"]).is_absolute() or fields.get("host"):
                fields.update(path=name, **({"host": None} if "host" in fields else {}))
            resources[name] = TypeAdapter(ResourceSpec).validate_python(fields)
        return self._copy(resources, Path(data_dir).resolve())

    def resource(self, name: str) -> Any:
        from ragline.flows.resources import get_resource

        return get_resource(self.spec.resources[name], self.data_dir or self.base_dir)


# ----------------------------------------------------------------------------- validation
class _Checker:
    """Collects every semantic error of one file."""

    def __init__(self, spec: PipelinesFile, doc: LocatedYaml, path: Path, allowed: tuple[str, ...]):
        self.spec, self.doc, self.path = spec, doc, path
        self.errors: list[SpecError] = []
        self.prompts = library(str((path.parent / spec.settings.prompts_dir).resolve()))
        self.external = allowed
        self.allowed = self._narrowed(allowed)

    def _narrowed(self, external: tuple[str, ...]) -> tuple[str, ...]:
        """The external allowlist narrowed by ``settings.allow_modules``; naming a module outside
        it is an error and allows nothing, so the file cannot widen what it may import."""
        listed = self.spec.settings.allow_modules
        if listed is None:
            return external
        for i, module in enumerate(listed):
            if not module_allowed(module, external):
                self.error(("settings", "allow_modules", i),
                           f"module '{module}' is not allowed: {ALLOW_HINT}; a pipelines file can only narrow "
                           f"that list")
        return tuple(m for m in listed if module_allowed(m, external))

    def error(self, loc: tuple[Any, ...], message: str) -> None:
        self.errors.append(locate(self.doc, loc, message))

    def pipeline(self, name: str, pipe: PipelineSpec, project: Project) -> CompiledPipeline | None:
        base = ("pipelines", name)
        ids = [s.id for s in pipe.steps]
        for i, s in enumerate(pipe.steps):
            if s.id in ids[:i]:
                self.error(base + ("steps", i, "id"), f"duplicate step id '{s.id}'")
        compiled: dict[str, CompiledStep] = {}
        for i, step in enumerate(pipe.steps):
            loc = base + ("steps", i)
            upstream = self._upstream(loc, step, ids, i)
            stage = self._stage(loc, step, pipe.kind) if "task" not in step._invalid else None
            if stage is None:
                continue
            params = self._params(loc, step, stage) if "with" not in step._invalid else None
            resources = self._resources(loc, step, stage) if "uses" not in step._invalid else None
            prompt = self._prompt(loc, step, stage, params) if "prompt" not in step._invalid else None
            if params is not None and resources is not None:
                compiled[step.id] = CompiledStep(step, stage, params, resources, upstream, {}, prompt)
        if pipe._invalid or len(compiled) != len(pipe.steps) or any(e.pipeline == name for e in self.errors):
            return None
        order = self._topological(base, pipe, compiled)
        if order is None:
            return None
        self._wire(base, pipe, compiled, order)
        output = pipe.output or order[-1]
        if output not in compiled:
            self.error(base + ("output",), f"unknown step '{output}'{suggest(output, ids)}")
        self._ingestion_shape(base, pipe, compiled)
        return CompiledPipeline(name, pipe, [compiled[i] for i in order], project, output)

    def _stage(self, loc, step: StepSpec, kind: str | None) -> Stage | None:
        try:
            stage = registry.get_stage(step.task, self.allowed)
        except PermissionError as exc:
            module = step.task.rpartition(".")[0]
            narrowed = module_allowed(module, self.external)
            self.error(loc + ("task",), f"module '{module}' is not in settings.allow_modules of this file"
                       if narrowed else str(exc))
            return None
        except ImportError as exc:
            self.error(loc + ("task",), str(exc))
            return None
        if stage is None:
            self.error(loc + ("task",), f"unknown task '{step.task}'{suggest(step.task, registry.stage_names())}")
            return None
        if kind is not None and stage.kind not in ("any", kind):
            self.error(loc + ("task",), f"task '{step.task}' is a {stage.kind} stage, not usable in a {kind} pipeline")
        return stage

    def _params(self, loc, step: StepSpec, stage: Stage) -> BaseModel | None:
        try:
            return stage.params.model_validate(step.with_)
        except ValidationError as exc:
            for err in exc.errors():
                self.error(loc + ("with",) + tuple(err["loc"]), _pydantic_message(err))
            return None

    def _resources(self, loc, step: StepSpec, stage: Stage) -> dict[str, str] | None:
        declared = self.spec.resources
        bound: dict[str, str] = {}
        ok = True
        pairs = list(step.uses.items()) if isinstance(step.uses, dict) else [(None, n) for n in step.uses]
        for index, (role, name) in enumerate(pairs):
            where = loc + ("uses", role if role is not None else index)
            if name not in declared:
                if name not in self.spec._invalid_resources:  # its own errors are reported already
                    self.error(where, f"unknown resource '{name}'{suggest(name, list(declared))}")
                ok = False
                continue
            rtype = declared[name].type
            role = role or next((r for r, types in stage.uses.items() if rtype in types and r not in bound), None)
            if role is None or role not in stage.uses:
                needs = ", ".join(f"{r}: {'/'.join(t)}" for r, t in stage.uses.items()) or "none"
                self.error(where, f"resource '{name}' ({rtype}) fits no role of task '{step.task}' (it uses {needs})")
                ok = False
            elif rtype not in stage.uses[role]:
                self.error(where, f"resource '{name}' is a {rtype}; role '{role}' needs {'/'.join(stage.uses[role])}")
                ok = False
            else:
                bound[role] = name
        for role, types in stage.uses.items():
            if role in bound:
                continue
            candidates = [n for n, r in declared.items() if r.type in types]
            if len(candidates) == 1:
                bound[role] = candidates[0]
            elif not candidates and self.spec._invalid_resources:
                ok = False  # probably the invalid resource, whose own error is reported
            else:
                problem = "no resource" if not candidates else f"several resources ({', '.join(candidates)})"
                self.error(loc + ("uses",), f"task '{step.task}' needs a {'/'.join(types)} resource for "
                                            f"'{role}' and the file has {problem}: name one in `uses`")
                ok = False
        return bound if ok else None

    def _prompt(self, loc, step: StepSpec, stage: Stage, params: BaseModel | None) -> str | None:
        if step.prompt and stage.prompt is None:
            self.error(loc + ("prompt",), f"task '{step.task}' takes no prompt")
            return None
        usable = params if params is not None else _salvaged_params(stage, step.with_)
        name = step.prompt or stage.default_prompt(usable)
        for problem in prompt_problems(self.prompts, stage, usable, name):
            self.error(loc + ("prompt",), problem)
        return name

    def _upstream(self, loc, step: StepSpec, ids: list[str], index: int) -> list[str]:
        if step.after is None:
            return [ids[index - 1]] if index > 0 else []
        for j, dep in enumerate(step.after):
            if dep == step.id:
                self.error(loc + ("after", j), f"step '{step.id}' cannot run after itself")
            elif dep not in ids:
                self.error(loc + ("after", j), f"unknown step '{dep}'{suggest(dep, ids)}")
        return list(dict.fromkeys(step.after))

    def _topological(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep]) -> list[str] | None:
        indegree = {sid: len(s.upstream) for sid, s in compiled.items()}
        order = [sid for sid in compiled if indegree[sid] == 0]
        for sid in order:
            for other in compiled.values():
                if sid in other.upstream:
                    indegree[other.id] -= 1
                    if indegree[other.id] == 0:
                        order.append(other.id)
        if len(order) < len(compiled):
            cyclic = [s for s in compiled if s not in order]
            first = next(i for i, s in enumerate(pipe.steps) if s.id == cyclic[0])
            self.error(base + ("steps", first, "after"), f"cycle between steps {', '.join(cyclic)}")
            return None
        return order

    def _wire(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep], order: list[str]) -> None:
        pipeline_inputs = PIPELINE_INPUTS[pipe.kind]
        for sid in order:
            step = compiled[sid]
            index = next(i for i, s in enumerate(pipe.steps) if s.id == sid)
            for port, annotation in step.stage.inputs.items():
                producers = _nearest_producers(compiled, sid, port)
                if len(producers) > 1 and typing.get_origin(annotation) is not list:
                    self.error(base + ("steps", index, "after"),
                               f"input '{port}' has several producers ({', '.join(producers)}); "
                               f"only list inputs can fan in")
                if not producers and port not in pipeline_inputs and port not in step.stage.optional_inputs:
                    self.error(base + ("steps", index, "task"),
                               f"input '{port}' of task '{step.stage.name}' has no upstream step producing it "
                               f"and is not an input of a {pipe.kind} pipeline")
                step.wiring[port] = producers

    def _ingestion_shape(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep]) -> None:
        if pipe.kind != "ingestion":
            return
        sinks = [s for s in compiled.values() if s.stage.plan is not None]
        if len(sinks) > 1:
            self.error(base + ("steps",), f"an ingestion pipeline has one index sink; found {', '.join(s.id for s in sinks)}")
        if not any(not s.stage.inputs and s.stage.produces == "documents" for s in compiled.values()):
            self.error(base + ("steps",), "an ingestion pipeline needs a source step (e.g. task 'load')")


def _nearest_producers(compiled: dict[str, CompiledStep], sid: str, port: str) -> list[str]:
    frontier, seen = list(compiled[sid].upstream), set()
    while frontier:
        found = [u for u in frontier if compiled[u].stage.produces == port]
        if found:
            return found
        seen.update(frontier)
        frontier = list(dict.fromkeys(p for u in frontier for p in compiled[u].upstream if p not in seen))
    return []


def prompt_problems(prompts: PromptLibrary, stage: Stage, params: BaseModel | None, name: str | None) -> list[str]:
    """What is wrong with the templates a step renders: its own (``name``) and the fixed ones the
    stage also renders, each missing, broken, or reading a variable the stage does not pass."""
    templates = [(name, stage.variables(params) if params is not None else None)] if name else []
    if params is not None:
        templates += sorted(stage.extra_prompts(params).items())
    problems = []
    for template, variables in templates:
        problem = prompts.check(template)
        if problem:
            problems.append(problem + suggest(template, prompts.names()))
        elif variables is not None:
            problems += prompts.check_variables(template, variables)
    return problems


def _salvaged_params(stage: Stage, given: dict[str, Any]) -> BaseModel | None:
    """The params without the invalid ones (reported already), to still check the step's prompt."""
    try:
        return stage.params.model_validate(given)
    except ValidationError as exc:
        bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
        kept = {k: v for k, v in given.items() if k not in bad}
    try:
        return stage.params.model_validate(kept)
    except ValidationError:
        return None


def _pydantic_message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return f"unknown parameter '{err['loc'][-1]}'"
    return f"{err['msg']} (got {err.get('input')!r})"


# ----------------------------------------------------------------------------- entry points
def validate_file(path: str | Path = DEFAULT_FILE, allow_modules: Iterable[str] = ()) -> list[SpecError]:
    """Every error in the file, in file order; an empty list means it compiles."""
    try:
        load_project(path, allow_modules=allow_modules)
    except SpecValidationError as exc:
        return exc.errors
    return []


def load_project(path: str | Path = DEFAULT_FILE, allow_modules: Iterable[str] = ()) -> Project:
    """Parse, validate and compile a pipelines file, or raise SpecValidationError with all errors.
    ``allow_modules`` adds to the external allowlist of user-stage modules (e.g. a CLI flag)."""
    path = Path(path).resolve()
    spec, doc, errors = parse_file(path)
    if spec is None or doc is None:
        raise SpecValidationError(errors)
    allowed, allow_errors = external_allowlist(path, allow_modules)
    checker = _Checker(spec, doc, path, allowed)
    checker.errors.extend(errors + allow_errors)
    project = Project(path, spec)
    for name, pipe in spec.pipelines.items():
        compiled = checker.pipeline(name, pipe, project)
        if compiled is not None:
            project.pipelines[name] = compiled
    if checker.errors:
        raise SpecValidationError(sorted(checker.errors, key=lambda e: (e.line or 0, e.message)))
    return project


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
        settings = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {}).get("ragline", {})
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
