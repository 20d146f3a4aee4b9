"""The settings fingerprint: what shapes indexed content, and nothing else.

Per step: its stage name and version, params, prompt texts and resource fingerprints, chained to
the steps its data comes from. Step ids are left out and independent branches are sorted, so
renaming a step or reordering unrelated ones keeps the index; reordering along the data path, or
any change to chunking or embedding settings, re-indexes.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Iterable

from ragline.flows.resources import resource_type

if TYPE_CHECKING:
    from ragline.flows.spec.model import CompiledPipeline, CompiledStep


def pipeline_fingerprint(pipeline: CompiledPipeline, steps: list[CompiledStep]) -> str:
    """Hash of what shapes the content indexed by ``steps``: per step its stage name and version,
    params, prompt texts and resource fingerprints, chained to the chosen steps its data comes
    from. Step ids are left out and independent branches are sorted, so renaming a step or
    reordering unrelated ones keeps the index; reordering along the data path does not."""
    chosen = {s.id: s for s in steps}
    every = {**{s.id: s for s in pipeline.steps}, **chosen}
    digests: dict[str, str] = {}

    def digest(step: CompiledStep) -> str:
        if step.id not in digests:
            feeds = {port: sorted(digest(chosen[p]) for p in _chosen_producers(every, producers, chosen))
                     for port, producers in sorted(step.wiring.items())}
            digests[step.id] = _sha([_content(pipeline, step), feeds])
        return digests[step.id]

    return _sha(sorted(digest(s) for s in steps))[:16]

def _content(pipeline: CompiledPipeline, step: CompiledStep) -> list[Any]:
    """The id-free part of one step's fingerprint."""
    shaping = step.stage.shaping_roles(step.params) if step.stage.shaping_roles else set(step.resources)
    resources = {role: _resource_fingerprint(pipeline.project.spec.resources[name])
                 for role, name in sorted(step.resources.items()) if role in shaping}
    names = [step.prompt] if step.prompt else []
    names += sorted(step.stage.extra_prompts(step.params))
    library = pipeline.project.prompts
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
    return resource_type(spec).fingerprint_fields(spec)
