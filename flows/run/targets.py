"""What an ingestion asked for from outside the file runs: the pipelines of the collections it names,
the folders it gives instead of the file's own (relative to where it was asked, not to the file),
and where the sources it reads are on disk. The terminal's `ragline index` and `quickstart` ask
this way; the engine decides it, so any client asks the same."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ragline.flows.errors import InputError
from ragline.flows.spec.model import CompiledPipeline, Project, require_kinds


def ingestion_names(project: Project, pipeline: str, collections: list[str] | None, paths: list[str]) -> list[str]:
    """The ingestion pipelines to run for ``pipeline``: itself, or its collections' (``index@NAME``):
    those named in ``collections``, by default all of them (``paths`` given go to one collection only)."""
    own = {c.name: c.pipeline for c in project.collections.values() if c.template == pipeline}
    if not collections:
        if own and pipeline not in project.pipelines:
            if paths and len(own) > 1:
                raise InputError(f"folders given for '{pipeline}', which indexes {len(own)} collections "
                                 f"({', '.join(own)}): name one with --collection", field="collection")
            return list(own.values())
        return [pipeline]
    unknown = [name for name in collections if name not in own]
    if unknown:
        raise InputError(f"no collection {', '.join(repr(n) for n in unknown)} of pipeline '{pipeline}' in "
                         f"{project.path}; its collections: {', '.join(own) or 'none'}", field="collection")
    if paths and len(collections) > 1:
        raise InputError("folders given for several collections: name one with --collection", field="collection")
    return [own[name] for name in dict.fromkeys(collections)]


def ingestion_for(project: Project, name: str, paths: list[str] | tuple[()] = (), wait: bool = True) -> CompiledPipeline:
    """The ingestion pipeline ``name`` reading ``paths`` (resolved against the current folder) instead
    of its own, its sink failing at once instead of waiting when another run writes the index
    (``wait=False``). Any other kind is refused before anything runs."""
    require_kinds(project, ingestion=name)
    pipeline = project.pipeline(name)
    overrides: dict[str, dict[str, Any]] = {}
    if paths:
        overrides[load_step_id(pipeline)] = {"paths": [str(Path(p).resolve()) for p in paths]}
    if not wait and pipeline.sink is not None:
        overrides[pipeline.sink.id] = {"wait": False}
    return pipeline.with_overrides(overrides) if overrides else pipeline


def source_locations(pipeline: CompiledPipeline) -> list[str]:
    """The load step's roots as absolute paths (the file's own are relative to its folder): what
    the user can find on disk, whatever names the index gives them."""
    load = pipeline.load_step
    if load is None:
        return []
    return [os.path.abspath(os.path.join(pipeline.project.base_dir, os.path.expanduser(entry.path)))
            if entry.type == "local" else str(entry) for entry in load.params.paths]


def load_step_id(pipeline: CompiledPipeline) -> str:
    """The id of the step that reads the sources, to give it other paths; refused where there is none."""
    if pipeline.load_step is None:
        raise InputError(f"pipeline '{pipeline.name}' has no load step to give paths to", field="paths")
    return pipeline.load_step.id
