"""The tuned overlay: settings `ragline tune` chose, applied on top of the pipelines file.

``ragline tune`` never writes pipelines.yaml. It writes ``<stem>.tuned.yaml`` beside the data the
settings were tuned on (the pipelines file's folder, or the ``--data-dir`` folder), holding:

- ``resources`` and ``pipelines``: resource fields and step parameters to set (validated exactly
  like ``ragline run --set``);
- ``replaces``: the values pipelines.yaml had for them when tuning ran. An entry whose value the
  user has changed in pipelines.yaml since then is not applied (the file wins, with a note in
  ``ragline validate`` and a warning), nor is one whose pipeline, step or resource is gone;
- ``tuned``: provenance (when, on how many chunks and pseudo-queries, the figure of the chosen
  setting and of the file's own) and ``candidates``: every setting tried with its figures;
- ``adapted``: written by the ``adapt`` job (``adapt_embedder``): the embedder resource it points at
  the domain-adapted model, and that model's provenance. Each writer keeps the other's entries:
  tuning after adapting keeps the adapted model (and tunes with it), adapting after tuning keeps
  the tuned settings.

``load_project`` applies it unless ``tuned=False`` (``ragline --no-tuned``, ``RAGLINE_TUNED=0``).
The applied values are recorded as the pipelines' overrides and the project's resource overrides,
so a step that runs in another process (Prefect, Dask, Ray) runs with exactly the driver's values.
Delete the file to go back to pipelines.yaml as written.
"""
from __future__ import annotations

import datetime as _dt
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ragline.flows import settings
from ragline.flows.files import write_atomic
from ragline.flows.spec.parse import LocatedYaml, SpecError, SpecValidationError, pydantic_message
from ragline.flows.resources import ResourceSpec

if TYPE_CHECKING:
    from ragline.flows.contracts import TuneReport
    from ragline.flows.spec.model import Project
    from ragline.tasks.jobs.adapt_embedder import AdaptReport

ENV = settings.env_name("tuned")
SUFFIX = ".tuned.yaml"
HEADER = "# Written by `ragline tune`"
log = logging.getLogger("ragline.overlay")


def enabled_by_default() -> bool:
    """Whether commands apply the overlay: yes unless RAGLINE_TUNED is 0, false, no or off."""
    return settings.project().tuned


def overlay_path(project: "Project", explicit: str | None = None) -> Path:
    """Where the overlay of this project's data lives: ``<stem>.tuned.yaml`` in the data folder
    (the pipelines file's folder unless the indexes were moved), or ``explicit`` (relative to the
    pipelines file's folder)."""
    if explicit:
        path = Path(explicit)
        return (path if path.is_absolute() else project.base_dir / path).resolve()
    return ((project.data_dir or project.base_dir) / f"{project.path.stem}{SUFFIX}").resolve()


class OverlayFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    tuned: dict[str, Any] = Field(default_factory=dict)
    adapted: dict[str, Any] = Field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    pipelines: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    replaces: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    candidates: list[dict[str, Any]] = Field(default_factory=list)


@dataclass
class AppliedOverlay:
    """What an overlay changed in a project, and what it left alone (and why)."""

    path: Path
    tuned: dict[str, Any]
    adapted: dict[str, Any] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)  # "pipelines search, step fuse: k 60 -> 20"
    notes: list[str] = field(default_factory=list)  # entries not applied

    def describe(self) -> list[str]:
        info, adapted = self.tuned, self.adapted
        writers = []
        if info:
            writers.append(f"ragline tune, {info.get('at', '?')}, "
                           f"{(info.get('pseudo_queries') or {}).get('count', '?')} pseudo-queries")
        if adapted:
            writers.append(f"adapt, {adapted.get('at', '?')}, {adapted.get('pairs', '?')} pairs")
        lines = [f"tuned overlay {self.path} ({'; '.join(writers) or 'empty'}; "
                 f"--no-tuned or {ENV}=0 ignores it):"]
        if adapted:
            lines.append(f"  adapted embedder: {adapted.get('model')} (from {adapted.get('base_model')}; "
                         f"the next ingestion re-embeds with it)")
        chosen, baseline, metric = info.get("chosen") or {}, info.get("baseline") or {}, info.get("metric", "")
        if chosen:
            lines.append(f"  chosen: {chosen.get('name')} ({metric} {chosen.get(metric)}; pipelines.yaml's own "
                         f"{baseline.get(metric)} on the same pseudo-queries)")
        lines += [f"  sets {c}" for c in self.changes] or ["  changes nothing: pipelines.yaml's settings won"]
        lines += [f"  not applied: {n}" for n in self.notes]
        return lines


def apply_overlay(project: "Project", path: Path | None = None) -> "Project":
    """The project with its overlay applied (if there is one); it remembers the plain project,
    so moving the data (``relocated``) or changing a resource applies the right overlay again.
    ``path``: that overlay instead of the data folder's (eval applies the user's own to its
    private workspace)."""

    plain = project.untuned or project
    path = path or overlay_path(plain)
    resources = dict(plain.spec.resources)
    resource_overrides = {k: dict(v) for k, v in plain.resource_overrides.items()}
    step_overrides: dict[str, dict[str, dict[str, Any]]] = {}
    applied: AppliedOverlay | None = None
    doc: LocatedYaml | None = None
    if path.is_file():
        doc, overlay = _read(path)
        applied = AppliedOverlay(path, overlay.tuned, overlay.adapted)
        errors: list[SpecError] = []
        for name, fields in overlay.resources.items():
            if name not in resources:
                applied.notes.append(f"resource '{name}' is no longer in {plain.path.name}")
                continue
            current = resources[name].model_dump()
            if name == overlay.adapted.get("resource") and not Path(str(fields.get("model", "."))).exists():
                applied.notes.append(f"resource '{name}': the adapted model {fields['model']} is gone; kept "
                                     f"{plain.path.name}'s (run the adapt job again)")
                continue
            drift = _drift(current, fields, overlay.replaces.get("resources", {}).get(name, {}))
            if drift:
                applied.notes.append(f"resource '{name}': {plain.path.name} changed {drift} since tuning; "
                                     f"kept {plain.path.name}'s (run `ragline tune` again)")
                continue
            try:
                resources[name] = TypeAdapter(ResourceSpec).validate_python({**current, **fields})
            except ValidationError as exc:
                errors += [SpecError(str(path), doc.line(("resources", name) + tuple(e["loc"][1:])),
                                     pydantic_message(e), field=f"resources.{name}." + ".".join(map(str, e["loc"][1:])))
                           for e in exc.errors()]
                continue
            resource_overrides[name] = {**resource_overrides.get(name, {}), **fields}
            applied.changes += [f"resource {name}: {k} {current.get(k)!r} -> {v!r}" for k, v in fields.items()
                                if current.get(k) != v]
        for pipe_name, steps in overlay.pipelines.items():
            if pipe_name not in plain.pipelines:
                if plain.partial and pipe_name in plain.spec.pipelines:
                    continue  # in the file, not compiled for this run
                applied.notes.append(f"pipeline '{pipe_name}' is no longer in {plain.path.name}")
                continue
            pipeline = plain.pipelines[pipe_name]
            replaced = overlay.replaces.get("pipelines", {}).get(pipe_name, {})
            for step_id, fields in steps.items():
                step = next((s for s in pipeline.steps if s.id == step_id), None)
                if step is None:
                    applied.notes.append(f"pipeline '{pipe_name}' has no step '{step_id}' any more")
                    continue
                current = step.params.model_dump()
                drift = _drift(current, fields, replaced.get(step_id, {}))
                if drift:
                    applied.notes.append(f"pipeline '{pipe_name}', step '{step_id}': {plain.path.name} changed "
                                         f"{drift} since tuning; kept {plain.path.name}'s (run `ragline tune` again)")
                    continue
                step_overrides.setdefault(pipe_name, {})[step_id] = fields
                applied.changes += [f"pipeline {pipe_name}, step {step_id}: {k} {current.get(k)!r} -> {v!r}"
                                    for k, v in fields.items() if current.get(k) != v]
        if errors:
            raise SpecValidationError(errors)
        for note in applied.notes:
            log.warning("%s: %s", path.name, note)
    tuned = plain._copy(resources, plain.data_dir)
    tuned.resource_overrides = resource_overrides
    errors = []
    for pipe_name, overrides in step_overrides.items():
        try:
            tuned.pipelines[pipe_name] = plain.pipelines[pipe_name].with_overrides(overrides).moved_to(tuned)
        except SpecValidationError as exc:
            errors += [SpecError(str(path), _line(doc, pipe_name, e), e.message, e.pipeline, e.step, e.field)
                       for e in exc.errors]
    if errors:
        raise SpecValidationError(errors)
    tuned.untuned, tuned.overlay = plain, applied
    return tuned


def _drift(current: dict[str, Any], fields: dict[str, Any], replaced: dict[str, Any]) -> str:
    """The fields the user changed since tuning: neither what tuning replaced nor what it set."""
    changed = [f"{k} ({replaced[k]!r} -> {current.get(k)!r})" for k, v in fields.items()
               if k in replaced and current.get(k) not in (replaced[k], v)]
    return ", ".join(changed)


def _line(doc: LocatedYaml | None, pipeline: str, error: SpecError) -> int | None:
    if doc is None:
        return None
    loc: tuple[Any, ...] = ("pipelines", pipeline)
    if error.step:
        loc += (error.step,)
        if error.field and error.field.startswith("with."):
            loc += tuple(error.field[5:].split("."))
    return doc.line(loc)


def _read(path: Path) -> tuple[LocatedYaml, OverlayFile]:
    hint = f"run `ragline tune` again, or delete {path.name} (or ignore it with --no-tuned)"
    try:
        doc = LocatedYaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SpecValidationError([SpecError(str(path), None, f"cannot read the tuned overlay ({exc}): {hint}")])
    try:
        return doc, OverlayFile.model_validate(doc.data or {})
    except ValidationError as exc:
        raise SpecValidationError([SpecError(str(path), doc.line(tuple(e["loc"])), f"{pydantic_message(e)}: {hint}",
                                             field=".".join(map(str, e["loc"]))) for e in exc.errors()])


# ----------------------------------------------------------------------------- writing
def write_overlay(project: "Project", path: Path, report: "TuneReport", state_generation: int | None = None) -> Path:
    """Write the tuner's choice as the overlay, atomically, keeping an adapted embedder the file
    names. Refuses to write over the pipelines file or over any file ragline did not write."""
    plain = project.untuned or project
    path = _writable(plain, path)
    resources, pipelines = report.overrides.get("resources", {}), report.overrides.get("pipelines", {})
    chosen, baseline = report.chosen, report.baseline
    document = {
        "version": 1,
        "tuned": {
            "at": _now(),
            "pipelines_file": plain.path.name,
            "index": {"chunks": report.chunks, "generation": state_generation},
            "pseudo_queries": {"count": report.pairs, "strategies": report.strategies},
            "metric": report.metric,
            "chosen": {"name": chosen.name, **chosen.scores} if chosen else None,
            "baseline": {"name": baseline.name, **baseline.scores} if baseline else None,
            "reason": report.reason,
            "expansions": {stage: entry.get("reason", "") for stage, entry in report.expansions.items()},
            "seconds": report.seconds,
        },
        "resources": resources,
        "pipelines": pipelines,
        "replaces": _replaced(plain, resources, pipelines),
        "candidates": [{"name": c.name, **c.scores} for c in report.candidates],
    }
    previous = _previous(path)
    if previous is not None:
        _keep_other_collections(plain, document, previous)
    if previous is not None and previous.adapted:
        _keep_adaptation(plain, document, previous)
    return _write(path, plain, document)


def _keep_other_collections(plain: "Project", document: dict[str, Any], previous: OverlayFile) -> None:
    """Carry the BM25 settings tuned for other named collections (``tune@<collection>`` tunes one:
    the others' indexes were rebuilt with theirs) into a document the tuner wrote."""
    own = {r for c in plain.collections.values() for r in c.resources.values()}
    document["resources"] = dict(document["resources"])  # the report's own overrides stay as tuned
    for name, fields in previous.resources.items():
        if name in own and name not in document["resources"]:
            document["resources"][name] = fields
            replaced = previous.replaces.get("resources", {}).get(name)
            if replaced is not None:
                document["replaces"].setdefault("resources", {})[name] = replaced


def write_adaptation(project: "Project", path: Path, report: "AdaptReport") -> Path:
    """Point the report's embedder resource at the adapted model in the overlay, atomically,
    keeping whatever ``ragline tune`` wrote there."""
    plain = project.untuned or project
    path = _writable(plain, path)
    previous = _previous(path)
    document = previous.model_dump() if previous is not None else OverlayFile().model_dump()
    document["resources"].setdefault(report.embedder, {})["model"] = report.model_path
    replaced = _replaced(plain, {report.embedder: {"model": report.model_path}}, {})["resources"][report.embedder]
    document["replaces"].setdefault("resources", {}).setdefault(report.embedder, {}).update(replaced)
    document["adapted"] = {"at": _now(), "resource": report.embedder, "model": report.model_path,
                           "base_model": report.base_model, "key": report.key, "pairs": report.pairs,
                           "strategies": report.strategies, "chunks": report.chunks,
                           "train_seconds": report.timings.get("training"), "stopped_early": report.stopped_early}
    return _write(path, plain, document)


def _keep_adaptation(plain: "Project", document: dict[str, Any], previous: OverlayFile) -> None:
    """Carry the adapted model's entry (and what it replaced) into a document the tuner wrote."""
    name = previous.adapted.get("resource")
    model = previous.resources.get(name, {}).get("model")
    if name not in plain.spec.resources or model is None:
        return
    document["adapted"] = previous.adapted
    document["resources"].setdefault(name, {})["model"] = model
    before = previous.replaces.get("resources", {}).get(name, {}).get("model")
    document["replaces"].setdefault("resources", {}).setdefault(name, {})["model"] = before


def _replaced(plain: "Project", resources: dict[str, dict[str, Any]],
              pipelines: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The values pipelines.yaml has for the fields an overlay sets (to notice later edits)."""
    return {
        "resources": {name: {k: plain.spec.resources[name].model_dump(mode="json").get(k) for k in fields}
                      for name, fields in resources.items()},
        "pipelines": {p: {sid: {k: plain.pipeline(p).step(sid).params.model_dump(mode="json").get(k) for k in fields}
                          for sid, fields in steps.items()} for p, steps in pipelines.items()},
    }


def _writable(plain: "Project", path: Path) -> Path:
    path = Path(path).resolve()
    if path == plain.path.resolve() or path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"refusing to write the tuned overlay to {path}: it must be a separate .yaml file")
    if path.exists() and not path.read_text(encoding="utf-8", errors="replace").startswith(HEADER):
        raise ValueError(f"refusing to overwrite {path}: it was not written by `ragline tune`")
    return path


def _previous(path: Path) -> OverlayFile | None:
    """The overlay already at ``path`` (ours, see ``_writable``), or None; an unreadable one is replaced."""
    if not path.is_file():
        return None
    try:
        return _read(path)[1]
    except SpecValidationError as exc:
        log.warning("%s: replacing an unreadable overlay (%s)", path.name, exc)
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _write(path: Path, plain: "Project", document: dict[str, Any]) -> Path:
    header = (f"{HEADER} (and the adapt job) from pseudo-queries made from the index (no labels); every ragline\n"
              f"# command applies it on top of {plain.path.name}, which is never written. `ragline validate` shows\n"
              f"# what it changes; --no-tuned or {ENV}=0 ignores it; delete it to go back to {plain.path.name}.\n")
    text = header + yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=160, allow_unicode=True)
    return write_atomic(path, text)
