"""The compiled model: projects, pipelines and steps as the checker builds them and the engine runs them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ragline.flows.errors import InputError
from ragline.flows.spec.fingerprint import pipeline_fingerprint
from ragline.flows.spec.prompts import PromptLibrary, library, prompt_problems
from ragline.flows.spec.registry import Stage
from ragline.flows.spec.parse import (
    PipelinesFile,
    PipelineSpec,
    SpecError,
    SpecValidationError,
    StepSpec,
    WhenSpec,
    pydantic_message,
    suggest,
)
from ragline.flows.resources import ResourceSpec, get_resource
from ragline.flows.spec.overlay import apply_overlay
from ragline.flows.resources import resource_type


def fitting(declared: Any, role: str, types: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """The resource a role binds to by itself (the one resource of its types, or of several the one
    named after the role: ``store: &m {...}``, ``sparse: *m``), and every resource of its types."""
    candidates = [name for name, spec in declared.items() if spec.type in types]
    if len(candidates) > 1 and role in candidates:
        return role, candidates
    return (candidates[0] if len(candidates) == 1 else None), candidates


def missing_read(task: str, role: str, types: tuple[str, ...], why: str) -> str:
    """The error for an optional role the configuration reads (``Stage.reads_roles``) and no resource fills."""
    return f"{why}: task '{task}' needs a {'/'.join(types)} resource for '{role}' and the file has none"


def several(task: str, role: str, types: tuple[str, ...], candidates: list[str]) -> str:
    problem = "no resource" if not candidates else f"several resources ({', '.join(candidates)})"
    return f"task '{task}' needs a {'/'.join(types)} resource for '{role}' and the file has {problem}: name one in `uses`"


def with_read_roles(stage: Stage, task: str, params: BaseModel, resources: dict[str, str],
                    declared: Any) -> tuple[dict[str, str], list[tuple[tuple[str, ...], str]]]:
    """``resources`` plus the optional roles ``params`` read (``Stage.reads_roles``) that are not bound
    yet, for a step whose params changed after it was checked (``--set``, the tuned
    overlay, a collection's own parameters): bound as the checker binds them. With the problems, each
    (the field under the step, message): a role read and not filled, or several fitting and none named."""
    if stage.reads_roles is None:
        return resources, []
    bound, problems = dict(resources), []
    for role, how in stage.reads_roles(params).items():
        if role in bound or role not in stage.uses:
            continue
        types = stage.uses[role]
        name, candidates = fitting(declared, role, types)
        if name is not None:
            bound[role] = name
        elif how is not None and not candidates:
            problems.append((("with", how[0]), missing_read(task, role, types, how[1])))
        elif candidates:
            problems.append((("uses",), several(task, role, types, candidates)))
    return bound, problems


class UnknownPipeline(InputError, KeyError):
    """A pipeline name the file does not declare (a KeyError too, for the lookups that expect one)."""

    http_status = 404
    error_code = "pipeline_not_found"

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class WrongPipelineKind(InputError):
    """A pipeline of the wrong kind for the command (an ingestion pipeline where a query one runs
    would load its own paths and delete every other document from the index)."""

    http_status = 400
    error_code = "wrong_pipeline_kind"


def require_kinds(project: "Project", **names: str | None) -> None:
    """Refuse, before anything runs, a pipeline of the wrong kind (an ingestion pipeline given as the
    query pipeline would load its own paths and delete everything else from the index)."""
    for kind, name in names.items():
        if name is not None and project.pipeline(name).kind != kind:
            fitting = ", ".join(n for n, p in project.pipelines.items() if p.kind == kind) or "none"
            raise WrongPipelineKind(f"pipeline '{name}' is {_article(project.pipeline(name).kind)} pipeline; this "
                                    f"needs {_article(kind)} pipeline ({kind} pipelines in {project.path.name}: "
                                    f"{fitting})", field="pipeline")


def _article(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


@dataclass
class CompiledStep:
    spec: StepSpec
    stage: Stage
    params: BaseModel
    resources: dict[str, str]  # role -> resource name
    upstream: list[str]
    wiring: dict[str, list[str]]  # input -> producer step ids; [] means a pipeline input
    prompt: str | None
    # A retriever over named collections (flows.spec.collections): collection -> its role -> resource
    # bindings; the step runs once per collection a query selects (a stage that merges collections
    # itself, ``Stage.merges_collections``, runs once and reads them). Empty: it runs once, over ``resources``.
    collections: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def when(self) -> WhenSpec | None:
        """The step's condition (pipelines.yaml `when`): skipped unless it holds."""
        return self.spec.when

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

    @property
    def sink(self) -> CompiledStep | None:
        """The ingestion's sink, the step whose stage plans the run (``Stage.plan``: the index
        state's writer); None in a query or job pipeline. The one place that finds it."""
        return next((s for s in self.steps if s.stage.plan is not None), None)

    @property
    def load_step(self) -> CompiledStep | None:
        """The step that lists and reads the sources (the ``load`` stage); None where there is none."""
        return next((s for s in self.steps if s.stage.name == "load"), None)

    @property
    def collections(self) -> list[str]:
        """The named collections this pipeline's retrievers search (empty: none are declared)."""
        return list(dict.fromkeys(name for s in self.steps for name in s.collections))

    def moved_to(self, project: "Project") -> "CompiledPipeline":
        """The same compiled steps over another project's resources (a relocated or tuned copy)."""
        return CompiledPipeline(self.name, self.spec, self.steps, project, self.output, dict(self.overrides))

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> "CompiledPipeline":
        """A copy whose steps' params are updated (e.g. the CLI's folder for `load`), re-validated."""
        steps = []
        for s in self.steps:
            if s.id in overrides:
                merged = {**s.params.model_dump(exclude_unset=True), **overrides[s.id]}
                try:
                    params = s.stage.params.model_validate(merged)
                except ValidationError as exc:
                    raise SpecValidationError([SpecError(str(self.project.path), None, pydantic_message(e),
                                                         self.name, s.id, "with." + ".".join(map(str, e["loc"])))
                                               for e in exc.errors()]) from exc
                prompt = s.spec.prompt or s.stage.default_prompt(params)  # e.g. a new rerank method
                problems = prompt_problems(self.project.prompts, s.stage, params, prompt)
                if problems:
                    raise SpecValidationError([SpecError(str(self.project.path), None, problem, self.name, s.id,
                                                         "prompt") for problem in problems])
                resources, unfilled = with_read_roles(s.stage, s.spec.task, params, s.resources,
                                                      self.project.file_resources())
                if unfilled:
                    raise SpecValidationError([SpecError(str(self.project.path), None, problem, self.name, s.id,
                                                         ".".join(field)) for field, problem in unfilled])
                s = CompiledStep(s.spec, s.stage, params, resources, s.upstream, s.wiring, prompt, s.collections)
            steps.append(s)
        unknown = set(overrides) - {s.id for s in self.steps}
        if unknown:
            raise KeyError(f"pipeline {self.name!r} has no step {sorted(unknown)}")
        merged = {sid: {**self.overrides.get(sid, {}), **overrides.get(sid, {})}
                  for sid in {*self.overrides, *overrides}}
        return CompiledPipeline(self.name, self.spec, steps, self.project, self.output, merged)

    def fingerprint(self, steps: list[CompiledStep]) -> str:
        """Hash of what shapes the content indexed by ``steps`` (see ``ragline.flows.spec.fingerprint``)."""
        return pipeline_fingerprint(self, steps)


@dataclass
class Project:
    """A validated pipelines file and everything compiled from it."""

    path: Path
    spec: PipelinesFile
    pipelines: dict[str, CompiledPipeline] = field(default_factory=dict)
    data_dir: Path | None = None  # where relative resource paths point; default: beside the file
    resource_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # by with_resource, for workers
    untuned: "Project | None" = None  # the project before its tuned overlay (flows.overlay); None: not applied
    overlay: Any = None  # the AppliedOverlay, when an overlay file was found
    source: Path | None = None  # where the file's text was read from, when pinned (serve's snapshot)
    collections: dict[str, Any] = field(default_factory=dict)  # name -> spec.collections.Collection
    partial: bool = False  # only some of the file's pipelines compiled (``load_project(only=...)``)

    def file_resources(self) -> dict[str, Any]:
        """The resources the file declares, as the checker binds roles among them (without the copies
        each named collection derives of its template's index: ``sparse@docs``)."""
        derived = {own for c in self.collections.values() for own in c.resources.values()}
        return {name: spec for name, spec in self.spec.resources.items() if name not in derived}

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def prompts(self) -> PromptLibrary:
        return library(str((self.base_dir / self.spec.settings.prompts_dir).resolve()))

    def pipeline(self, name: str) -> CompiledPipeline:
        if name not in self.pipelines:
            raise UnknownPipeline(f"no pipeline {name!r} in {self.path}{suggest(name, list(self.pipelines))}; "
                                  f"available: {', '.join(self.pipelines)}", field="pipeline")
        return self.pipelines[name]

    def with_resource(self, name: str, **fields: Any) -> "Project":
        """A copy of the project with one resource's settings changed (validated like the file)."""
        from pydantic import TypeAdapter

        if name not in self.spec.resources:
            raise KeyError(f"no resource {name!r}{suggest(name, list(self.spec.resources))}")
        if self.untuned is not None:  # change the file's setting, then apply the overlay again

            return apply_overlay(self.untuned.with_resource(name, **fields))
        merged = {**self.spec.resources[name].model_dump(), **fields}
        resources = {**self.spec.resources, name: TypeAdapter(ResourceSpec).validate_python(merged)}
        project = self._copy(resources, self.data_dir)
        project.resource_overrides[name] = {**self.resource_overrides.get(name, {}), **fields}
        return project

    def _copy(self, resources: dict[str, Any], data_dir: Path | None) -> "Project":
        """The same pipelines over other resource settings (the compiled steps are reused)."""
        spec = self.spec.model_copy(update={"resources": resources})
        spec._invalid_resources = set()
        project = Project(self.path, spec, data_dir=data_dir, resource_overrides=dict(self.resource_overrides),
                          source=self.source, collections=dict(self.collections), partial=self.partial)
        for pipe_name, pipe in self.pipelines.items():
            project.pipelines[pipe_name] = pipe.moved_to(project)
        return project

    def relocated(self, data_dir: Path) -> "Project":
        """A copy whose indexes all live under ``data_dir``, whatever the file says: relative paths
        move with it, absolute ones become ``data_dir/<resource name>``, and a Chroma server is
        replaced by an embedded store there. Evaluation and ``--data-dir`` rely on it never writing
        to the configured index. A tuned project applies the overlay of the new data folder."""
        if self.untuned is not None:

            return apply_overlay(self.untuned.relocated(data_dir))

        resources = {name: resource_type(spec).relocated(spec, name) for name, spec in self.spec.resources.items()}
        return self._copy(resources, Path(data_dir).resolve())

    def resource(self, name: str) -> Any:

        return get_resource(self.spec.resources[name], self.data_dir or self.base_dir)
