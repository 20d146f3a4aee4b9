"""The compiled model: projects, pipelines and steps as the checker builds them and the engine runs them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
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
                s = CompiledStep(s.spec, s.stage, params, s.resources, s.upstream, s.wiring, prompt, s.collections)
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
                          source=self.source, collections=dict(self.collections))
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
