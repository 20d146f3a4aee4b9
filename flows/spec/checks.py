"""Semantic validation of a parsed pipelines file: every error at once, each located by file,
line, pipeline, step and field.

Wiring rule (Haystack-like, checked before anything runs): a step's data input ``x`` is fed
by the nearest upstream steps that produce ``x``; several producers at the same distance fan
in (their lists are concatenated); with no producer, ``x`` must be an input of the pipeline
(``query`` for query pipelines). A step without ``after`` follows the step above it.
"""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from ragline.flows.spec import registry
from ragline.flows.contracts import PipelineKind
from ragline.flows.sources import source_types
from ragline.flows.spec.model import CompiledPipeline, CompiledStep, Project, fitting, missing_read, several
from ragline.flows.spec.prompts import library, template_problems
from ragline.flows.spec.registry import ALLOW_HINT, Stage, module_allowed
from ragline.flows.spec.parse import (
    LocatedYaml,
    PipelinesFile,
    PipelineSpec,
    SpecError,
    StepSpec,
    locate,
    pydantic_message,
    suggest,
)

PIPELINE_INPUTS: dict[str, dict[str, Any]] = {
    "query": {"query": "Query"},
    "ingestion": {},
    "job": {},
}


class Checker:
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
            self._routes(loc, stage, params)
            resources = self._resources(loc, step, stage, params) if "uses" not in step._invalid else None
            prompt = self._prompt(loc, step, stage, params) if "prompt" not in step._invalid else None
            if params is not None and resources is not None:
                compiled[step.id] = CompiledStep(step, stage, params, resources, upstream, {}, prompt)
        self._conditions(base, pipe, compiled)
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
                nearest = suggest(str(err["loc"][-1]), list(stage.params.model_fields)) \
                    if err["type"] == "extra_forbidden" and len(err["loc"]) == 1 else ""
                self.error(loc + ("with",) + _untagged(err["loc"]), pydantic_message(err) + nearest)
            return None

    def _routes(self, loc, stage: Stage, params: BaseModel | None) -> None:
        """The collections a classifier routes to are declared in the file."""
        if stage.routes is None or params is None:
            return
        declared = list(self.spec.collections)
        for label, names in stage.routes(params).items():
            for j, name in enumerate(names):
                if name not in declared:
                    known = f"the file declares {', '.join(declared)}" if declared else "the file declares none"
                    self.error(loc + ("with", "labels", label, "collections", j),
                               f"unknown collection '{name}'{suggest(name, declared)}; {known}")

    def _resources(self, loc, step: StepSpec, stage: Stage, params: BaseModel | None) -> dict[str, str] | None:
        declared = self.spec.resources
        # the optional roles this configuration reads ({role: (the `with` field, why), or None where it
        # reads one only if the file has it}); None: all of them
        reads = dict(stage.reads_roles(params)) if stage.reads_roles is not None and params is not None else None
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
            optional = role in stage.optional_roles
            if optional and stage.reads_roles is not None and role not in (reads or {}):
                continue  # not read as configured (or the params are invalid: their errors are reported)
            # read as configured, and needed: (the `with` field, why); None: read where the file has one
            needed = (reads or {}).get(role) if optional else None
            name, candidates = fitting(declared, role, types)
            if name is not None:
                bound[role] = name
            elif not candidates and optional and needed is None:
                continue  # the stage works without it (e.g. an LLM only some of its modes need)
            elif not candidates and self.spec._invalid_resources:
                ok = False  # probably the invalid resource, whose own error is reported
            elif not candidates and needed is not None:
                field, why = needed
                self.error(loc + ("with", field), missing_read(step.task, role, types, why))
                ok = False
            else:
                self.error(loc + ("uses",), several(step.task, role, types, candidates))
                ok = False
        return bound if ok else None

    def _prompt(self, loc, step: StepSpec, stage: Stage, params: BaseModel | None) -> str | None:
        if step.prompt and stage.prompt is None:
            self.error(loc + ("prompt",), f"task '{step.task}' takes no prompt")
            return None
        usable = params if params is not None else _salvaged_params(stage, step.with_)
        name = step.prompt or stage.default_prompt(usable)
        named_by = _fields_naming_templates(usable)
        for template, problem in template_problems(self.prompts, stage, usable, name):
            field = named_by.get(template) if template != name else None
            self.error(loc + (("with", field) if field else ("prompt",)), problem)
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

    def _conditions(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep]) -> None:
        """Each ``when`` names a classify step that runs before this one, and labels it can give."""
        ids = [s.id for s in pipe.steps]
        for i, spec in enumerate(pipe.steps):
            when = spec.when
            if when is None or "when" in spec._invalid:
                continue
            loc = base + ("steps", i, "when")
            if when.step == spec.id:
                self.error(loc + ("step",), f"step '{spec.id}' cannot be conditioned on itself")
                continue
            if when.step not in ids:
                self.error(loc + ("step",), f"unknown step '{when.step}'{suggest(when.step, ids)}")
                continue
            decider = compiled.get(when.step)
            if decider is None:
                continue  # its own errors are reported
            if spec.id in _ancestors(compiled, when.step):
                self.error(loc + ("step",), f"step '{when.step}' runs after step '{spec.id}' (it depends on it): "
                                            f"a condition can only read a step that runs before")
                continue
            if decider.stage.labels is None:
                self.error(loc + ("step",), f"step '{when.step}' (task '{decider.stage.name}') gives no label: a "
                                            f"condition reads a classify step")
                continue
            labels = list(decider.stage.labels(decider.params))
            field = "label" if when.label is not None else "not_label"
            for j, value in enumerate(when.label if when.label is not None else when.not_label or []):
                if value not in labels:
                    self.error(loc + (field, j), f"'{value}' is not a label of step '{when.step}'"
                                                 f"{suggest(value, labels)}; its labels: {', '.join(labels)}")

    def _topological(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep]) -> list[str] | None:
        indegree = {sid: len(_depends_on(s, compiled)) for sid, s in compiled.items()}
        order = [sid for sid in compiled if indegree[sid] == 0]
        for sid in order:
            for other in compiled.values():
                if sid in _depends_on(other, compiled):
                    indegree[other.id] -= 1
                    if indegree[other.id] == 0:
                        order.append(other.id)
        if len(order) < len(compiled):
            cyclic = [s for s in compiled if s not in order]
            while True:  # steps that only wait behind the cycle are not part of it: peel them off
                blocked = [s for s in cyclic if not any(s in compiled[o].upstream for o in cyclic)]
                if not blocked:
                    break
                cyclic = [s for s in cyclic if s not in blocked]
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
                if len(producers) > 1 and typing.get_origin(annotation) is not list \
                        and not _exclusive(compiled, producers):
                    self.error(base + ("steps", index, "after"),
                               f"input '{port}' has several producers ({', '.join(producers)}); "
                               f"only list inputs can fan in, or alternatives whose `when` exclude each other")
                if not producers and port not in pipeline_inputs and port not in step.stage.optional_inputs:
                    self.error(base + ("steps", index, "task"),
                               f"input '{port}' of task '{step.stage.name}' has no upstream step producing it "
                               f"and is not an input of a {pipe.kind} pipeline")
                step.wiring[port] = producers

    def _ingestion_shape(self, base, pipe: PipelineSpec, compiled: dict[str, CompiledStep]) -> None:
        if pipe.kind != PipelineKind.INGESTION:
            return
        sinks = [s for s in compiled.values() if s.stage.plan is not None]
        if len(sinks) > 1:
            self.error(base + ("steps",), f"an ingestion pipeline has one index sink; found {', '.join(s.id for s in sinks)}")
        if not any(not s.stage.inputs and s.stage.produces == "documents" for s in compiled.values()):
            self.error(base + ("steps",), "an ingestion pipeline needs a source step (e.g. task 'load')")


def _depends_on(step: CompiledStep, compiled: dict[str, CompiledStep]) -> list[str]:
    """What a step waits for: its upstream steps and the step its condition reads."""
    when = step.when
    extra = [when.step] if when is not None and when.step in compiled and when.step not in step.upstream else []
    return step.upstream + extra


def _ancestors(compiled: dict[str, CompiledStep], sid: str) -> set[str]:
    """Every step ``sid`` waits for, directly or not."""
    seen: set[str] = set()
    frontier = [sid]
    while frontier:
        current = compiled.get(frontier.pop())
        for dep in _depends_on(current, compiled) if current is not None else []:
            if dep not in seen:
                seen.add(dep)
                frontier.append(dep)
    return seen


def _exclusive(compiled: dict[str, CompiledStep], producers: list[str]) -> bool:
    """Whether at most one of the producers can run: each has a `when` on the same classify step,
    and the labels under which they run do not overlap (so one non-list input takes the one that ran)."""
    whens = [compiled[p].when for p in producers]
    if any(w is None for w in whens) or len({w.step for w in whens}) != 1:
        return False
    decider = compiled.get(whens[0].step)
    if decider is None or decider.stage.labels is None:
        return False
    labels = list(decider.stage.labels(decider.params))
    allowed = [w.allowed(labels) for w in whens]
    return all(not (a & b) for i, a in enumerate(allowed) for b in allowed[i + 1:])


def _nearest_producers(compiled: dict[str, CompiledStep], sid: str, port: str) -> list[str]:
    frontier, seen = list(compiled[sid].upstream), set()
    while frontier:
        found = [u for u in frontier if compiled[u].stage.produces == port]
        if found:
            return found
        seen.update(frontier)
        frontier = list(dict.fromkeys(p for u in frontier for p in compiled[u].upstream if p not in seen))
    return []


def _fields_naming_templates(params: BaseModel | None) -> dict[str, str]:
    """template name -> the parameter that names it (e.g. generate's ``system_prompt``)."""
    values = params.model_dump() if params is not None else {}
    return {value: field for field, value in values.items() if isinstance(value, str)}


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


def _untagged(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A parameter's location without the source type pydantic inserts after a list index
    ('paths.1.fsspec.options' is 'paths.1.options' in the file)."""
    tags = source_types()
    return tuple(p for i, p in enumerate(loc) if not (p in tags and i and isinstance(loc[i - 1], int)))
