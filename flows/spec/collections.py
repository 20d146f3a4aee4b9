"""Named collections (knowledge bases): one file, several indexes, each with its own sources and schedule.

``collections:`` in pipelines.yaml names them. Each is compiled from an ingestion *template* (the
file's only ingestion pipeline, or the one it names):

- its index resources are the template sink's Chroma, BM25 and state resources copied as
  ``<resource>@<collection>``: the Chroma collection ``<collection>`` (same folder or server), BM25
  and state in ``<their folder>/collections/<collection>/``, changed by the collection's ``resources``;
- its ingestion pipeline ``<template>@<collection>`` is the template's compiled steps over them,
  with the collection's ``paths`` (on the template's source step), step parameters and schedule. A
  template is compiled only for its collections: it is not runnable (nor served) on its own;
- every retriever (a step producing rankings) of a query pipeline bound to a template's index
  resources searches each of the template's collections (``CompiledStep.collections``); a query
  selects which (``Query.collections``) and its passages say which one they came from. A stage
  that merges collections itself (``Stage.merges_collections``: the community summaries) is bound
  the same way but called once, reading each selected collection's index (``tasks.collection_index``).

A job bound to a template's index (``tune``, ``adapt``) is compiled per collection too, as
``<job>@<collection>`` over that collection's index, and run for one collection at a time
(``for_collection``: the one named, or the only one): its pseudo-queries, the rankings it scores
them on and the BM25 parameters it tunes belong to one corpus (pairs from several would be ranked
against one store). The fusion and depths it tunes are the query pipeline's, shared by every
collection: the last collection tuned sets them. ``ragline eval`` indexes its corpus into one
collection (the same helper, for the ingestion template) for the same reason.

Why copies of compiled steps rather than more YAML: the template is checked once, with its own
lines, and a collection's mistakes are located at its own fields. A collection's fingerprint depends
only on its template and its own settings, so adding one re-indexes nothing else.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ragline.flows.contracts import PipelineKind
from ragline.flows.errors import InputError
from ragline.flows.resources import ResourceSpec
from ragline.flows.spec.model import CompiledPipeline, CompiledStep, Project, with_read_roles
from ragline.flows.spec.parse import CollectionSpec, pydantic_message, suggest

INDEX_TYPES = ("chroma", "milvus", "bm25", "index_state")


@dataclass(frozen=True)
class Collection:
    """One compiled collection: its ingestion pipeline and the resources it has instead of the template's."""

    name: str
    template: str
    pipeline: str  # "<template>@<name>"
    resources: dict[str, str]  # the template's index resource -> this collection's


def pipeline_name(template: str, collection: str) -> str:
    return f"{template}@{collection}"


def expand(checker: Any, project: Project) -> None:
    """Compile every collection of the file into ``project`` (errors to ``checker``); then drop the
    templates and point the query pipelines' retrievers at the collections."""
    spec = project.spec
    templates: dict[str, list[CompiledPipeline]] = {}
    for name, collection in spec.collections.items():
        loc = ("collections", name)
        template = _template(checker, loc, collection, project)
        if template is None:
            continue
        templates.setdefault(template, [])
        compiled = project.pipelines.get(template)
        if compiled is None:
            continue  # the template's own errors are reported
        sink = compiled.sink
        if sink is None:
            checker.error(loc + ("template",), f"pipeline '{template}' has no index step to write a collection")
            continue
        renamed = _resources(checker, loc, name, collection, sink, project)
        steps = _steps(checker, loc, collection, compiled, renamed or {})
        if renamed is None or steps is None:
            continue
        own = pipeline_name(template, name)
        if own in spec.pipelines:
            checker.error(loc, f"pipeline '{own}' is defined in the file; collection '{name}' compiles its own")
            continue
        description = collection.description or f"collection '{name}': {compiled.spec.description}".rstrip(": ")
        pipe_spec = compiled.spec.model_copy(update={"schedule": collection.schedule or compiled.spec.schedule,
                                                     "description": description})
        templates[template].append(CompiledPipeline(own, pipe_spec, steps, project, compiled.output))
        project.collections[name] = Collection(name, template, own, renamed)
    if templates:  # each template's place in the file goes to its collections' pipelines
        pipelines = dict(project.pipelines)
        project.pipelines.clear()
        for pipe_name, pipeline in pipelines.items():
            for compiled_pipe in templates.get(pipe_name, [pipeline]):
                project.pipelines[compiled_pipe.name] = compiled_pipe
    _fan_out(project)
    if project.collections:
        _jobs(project)


def _template(checker: Any, loc: tuple, collection: CollectionSpec, project: Project) -> str | None:
    pipelines = project.spec.pipelines
    ingestion = [n for n, p in pipelines.items() if p.kind == PipelineKind.INGESTION]
    if collection.template is not None:
        if collection.template not in ingestion:
            checker.error(loc + ("template",), f"'{collection.template}' is not an ingestion pipeline of this file"
                                               f"{suggest(collection.template, ingestion)}; ingestion pipelines: "
                                               f"{', '.join(ingestion) or 'none'}")
            return None
        return collection.template
    if len(ingestion) != 1:
        checker.error(loc, f"name the ingestion pipeline to compile for this collection in `template` (the file "
                           f"has {len(ingestion)}: {', '.join(ingestion) or 'none'})")
        return None
    return ingestion[0]


def _resources(checker: Any, loc: tuple, name: str, collection: CollectionSpec, sink: CompiledStep,
               project: Project) -> dict[str, str] | None:
    """The collection's own copies of the sink's index resources, added to the project; None on errors."""
    declared = project.spec.resources
    base = [n for n in dict.fromkeys(sink.resources.values()) if declared[n].type in INDEX_TYPES]
    ok = True
    for unknown in set(collection.resources) - set(base):
        checker.error(loc + ("resources", unknown), f"'{unknown}' is not an index resource of this collection's "
                                                    f"template{suggest(unknown, base)}; it has {', '.join(base)}")
        ok = False
    renamed: dict[str, str] = {}
    for resource in base:
        changes = collection.resources.get(resource, {})
        where = loc + ("resources", resource)
        for fixed, why in (("type", f"its template's, {declared[resource].type}"),
                           ("collection", f"the collection's name, '{name}'")):
            if fixed in changes:
                checker.error(where + (fixed,), f"a collection's {resource} keeps its {fixed}: {why}")
                ok = False
        fields = {**_derived_fields(declared[resource].model_dump(), name), **changes}
        try:
            derived = TypeAdapter(ResourceSpec).validate_python(fields)
        except ValidationError as exc:
            for err in exc.errors():
                checker.error(where + tuple(err["loc"][1:]), pydantic_message(err))
            ok = False
            continue
        own = f"{resource}@{name}"
        if own in declared:
            checker.error(loc, f"resource '{own}' is defined in the file; collection '{name}' derives its own")
            ok = False
            continue
        declared[own] = derived
        renamed[resource] = own
    return renamed if ok else None


def _derived_fields(fields: dict[str, Any], name: str) -> dict[str, Any]:
    """A template index resource's fields for collection ``name``: its Chroma collection, or its
    files in ``collections/<name>/`` beside the template's."""
    if fields.get("type") in ("chroma", "milvus"):
        return {**fields, "collection": name}
    if fields.get("type") == "index_state" and fields.get("url"):  # a database state: a schema of its own
        return {**fields, "schema_name": _schema_of(fields.get("schema_name") or "ragline", name)}
    if isinstance(fields.get("path"), str):
        path = Path(fields["path"])
        return {**fields, "path": str(path.parent / "collections" / name / path.name)}
    return fields


def _schema_of(template: str, name: str) -> str:
    """A collection's PostgreSQL schema: the template's and the name (made a plain identifier, with
    a hash of the name when that changed it, so two names never share one)."""
    plain = re.sub(r"[^a-z0-9_]", "_", name.lower())
    schema = f"{template}__{plain}"
    if plain != name or len(schema) > 63:
        schema = f"{schema[:54]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return schema


def _steps(checker: Any, loc: tuple, collection: CollectionSpec, template: CompiledPipeline,
           renamed: dict[str, str]) -> list[CompiledStep] | None:
    """The template's compiled steps over the collection's resources, with its parameters; None on errors."""
    ids = [s.id for s in template.steps]
    changes = {sid: (loc + ("steps", sid), dict(params)) for sid, params in collection.steps.items()}
    ok = True
    for sid in set(changes) - set(ids):
        checker.error(loc + ("steps", sid), f"pipeline '{template.name}' has no step '{sid}'{suggest(sid, ids)}")
        ok = False
    if collection.paths is not None:
        sources = [s.id for s in template.steps if not s.stage.inputs and s.stage.produces == "documents"]
        if len(sources) != 1:
            checker.error(loc + ("paths",), f"pipeline '{template.name}' has {len(sources)} source steps; set each "
                                            f"one's paths under `steps` instead")
            ok = False
        else:
            where, params = changes.get(sources[0], (loc + ("paths",), {}))
            changes[sources[0]] = (where, {**params, "paths": collection.paths})
    steps = []
    for step in template.steps:
        params, prompt = step.params, step.prompt
        if step.id in changes:
            where, given = changes[step.id]
            try:
                params = step.stage.params.model_validate({**step.params.model_dump(exclude_unset=True), **given})
            except ValidationError as exc:
                for err in exc.errors():
                    at = where + tuple(err["loc"][1:]) if where[-1] == "paths" else where + tuple(err["loc"])
                    checker.error(at, pydantic_message(err))
                ok = False
                continue
            prompt = step.spec.prompt or step.stage.default_prompt(params)
            declared = {n: r for n, r in template.project.file_resources().items() if n not in renamed.values()}
            bound, unfilled = with_read_roles(step.stage, step.spec.task, params, step.resources, declared)
            for field, problem in unfilled:  # a role its own parameters read and the template's do not
                checker.error(where + field[1:], problem)
                ok = False
            step = CompiledStep(step.spec, step.stage, step.params, bound, step.upstream, step.wiring, step.prompt)
        resources = {role: renamed.get(resource, resource) for role, resource in step.resources.items()}
        steps.append(CompiledStep(step.spec, step.stage, params, resources, list(step.upstream), step.wiring, prompt))
    return steps if ok else None


def _fan_out(project: Project) -> None:
    """Every retriever of a query pipeline bound to a template's index searches its collections (as
    does a stage that merges them itself, ``Stage.merges_collections``: ``retrieve_summaries``)."""
    if not project.collections:
        return
    for pipeline in project.pipelines.values():
        if pipeline.kind != PipelineKind.QUERY:
            continue
        for step in pipeline.steps:
            if step.stage.produces != "rankings" and not step.stage.merges_collections:
                continue
            bound = set(step.resources.values())
            step.collections = {
                name: {role: collection.resources.get(resource, resource) for role, resource in step.resources.items()}
                for name, collection in project.collections.items() if bound & set(collection.resources)}



def _jobs(project: Project) -> None:
    """Each job bound to a template's index (``tune``, ``adapt``) becomes one job per collection,
    ``<job>@<collection>``, over that collection's index: the template's is empty once collections
    exist. Compiled rather than bound at run time so that every process (a Prefect worker, a stage
    that looks its own step up by name) finds the same pipeline under its name."""
    pipelines = dict(project.pipelines)
    project.pipelines.clear()
    for name, pipeline in pipelines.items():
        bound = {resource for step in pipeline.steps for resource in step.resources.values()}
        reading = [c for c in project.collections.values() if bound & set(c.resources)]
        if pipeline.kind != PipelineKind.JOB or not reading:
            project.pipelines[name] = pipeline
            continue
        for collection in reading:
            own = pipeline_name(name, collection.name)
            steps = [CompiledStep(s.spec, s.stage, s.params, {role: collection.resources.get(r, r)
                                                              for role, r in s.resources.items()},
                                  s.upstream, s.wiring, s.prompt, s.collections) for s in pipeline.steps]
            spec = pipeline.spec.model_copy(update={"description": f"{pipeline.spec.description} (collection "
                                                                   f"'{collection.name}')".lstrip()})
            project.pipelines[own] = CompiledPipeline(own, spec, steps, project, pipeline.output)


def for_collection(project: Project, pipeline: str, collection: str | None) -> str:
    """The pipeline to run for ``pipeline`` (a template or a job compiled per collection, or any other
    pipeline of the file) over one collection: ``<pipeline>@<collection>``, or the only collection's."""
    own = {c: pipeline_name(pipeline, c) for c in project.collections
           if pipeline_name(pipeline, c) in project.pipelines}
    if not own or pipeline in project.pipelines:
        if collection is not None:
            raise InputError(f"pipeline '{pipeline}' is not compiled per collection (collections of "
                             f"{project.path.name}: {', '.join(project.collections) or 'none'})", field="collection")
        return pipeline
    if collection is None and len(own) > 1:
        raise InputError(f"pipeline '{pipeline}' runs over one collection's index: name it with --collection "
                         f"({', '.join(own)})", field="collection")
    if collection is not None and collection not in own:
        raise InputError(f"no collection '{collection}' of pipeline '{pipeline}'{suggest(collection, list(own))}; "
                         f"its collections: {', '.join(own)}", field="collection")
    return own[collection] if collection is not None else next(iter(own.values()))
