"""The query pipelines a tuning serves (one dense and one BM25 retriever fused over this index) and
their overlay entries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from ragline.flows.contracts import PipelineKind


@dataclass(frozen=True)
class Target:
    """A query pipeline the tuner sets: its fuse step and the two retrievers feeding it."""

    pipeline: str
    fuse: str
    dense: str
    sparse: str
    sparse_resource: str
    gate: str | None = None  # its answerability step, whose similarity floor the tuner sets


# ----------------------------------------------------------------------------- targets
def find_targets(project: Any, names: list[str], resources: dict[str, str]) -> list[Target]:
    """The query pipelines (named, or all) whose fuse step is fed by one dense and one BM25
    retriever over the tuner's own store, embedder and BM25 index."""
    wanted = names or [n for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY]
    targets, problems = [], []
    for name in wanted:
        pipeline = project.pipeline(name)  # a named pipeline that does not exist is an error
        if pipeline.kind != PipelineKind.QUERY:
            problems.append(f"'{name}' is not a query pipeline")
            continue
        for step in reversed(pipeline.steps):  # the last: the ranking the pipeline returns (PRF fuses twice)
            if step.stage.name != "fuse":
                continue
            feeders = [pipeline.step(s) for s in step.wiring.get("rankings", [])]
            dense = [s for s in feeders if s.stage.name == "retrieve_dense"]
            bm25 = [s for s in feeders if s.stage.name == "retrieve_sparse"]
            if len(feeders) != 2 or len(dense) != 1 or len(bm25) != 1:
                continue
            same = (any(b.get("store") == resources.get("store") and b.get("embedder") == resources.get("embedder")
                        for b in bindings(dense[0]))
                    and any(b.get("sparse") == resources.get("sparse") for b in bindings(bm25[0])))
            if not same:
                problems.append(f"'{name}' searches other resources than the tuner's")
                continue
            gate = next((s.id for s in pipeline.steps if s.stage.name == "answerable"), None)
            targets.append(Target(name, step.id, dense[0].id, bm25[0].id, resources["sparse"], gate))
            break
        else:
            if names:
                problems.append(f"'{name}' has no fuse step fed by one dense and one BM25 retriever")
    if names and problems:
        raise ValueError("cannot tune " + "; ".join(problems))
    if not targets:
        raise ValueError("no query pipeline fuses one dense and one BM25 retriever over this index: nothing to tune")
    return targets


def bindings(step: Any) -> list[dict[str, str]]:
    """A retriever's resources: its own and, over named collections, each collection's (a tuner bound
    to one collection's index tunes the retrievers that search it; its BM25 parameters go to that
    collection's BM25 resource, the fusion and depths to the pipeline, shared by every collection)."""
    return [step.resources, *step.collections.values()]


def current_setting(project: Any, target: Target, bm25: Any) -> dict[str, Any]:
    """What the file says now for one target, in the tuner's terms."""
    pipeline = project.pipeline(target.pipeline)
    fuse = pipeline.step(target.fuse).params
    w_dense = fuse.weights.get(target.dense, 1.0)
    w_sparse = fuse.weights.get(target.sparse, 1.0)
    total = w_dense + w_sparse
    return {"method": fuse.method, "k": fuse.k,
            "dense_weight": round(w_dense / total, 4) if total > 0 else 0.5,
            "depth_dense": pipeline.step(target.dense).params.k,
            "depth_sparse": pipeline.step(target.sparse).params.k,
            "bm25": {"k1": bm25.k1, "b": bm25.b, "stemmer": bm25.stemmer}}


def overlay_entries(project: Any, targets: list[Target], setting: dict[str, Any],
                    floor: float | None = None, probability_floor: float | None = None,
                    expansions: dict[tuple[str, str], dict[str, Any]] | None = None,
                    own_settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The overlay for a setting: the BM25 resource's parameters and, per target pipeline, its
    fuse step's method, constant and weights, its retrievers' depth, its gate's thresholds and
    its expansion steps turned on (with their settings) or off. ``own_settings``: a pipeline's own
    fusion and depths (one whose expansion makes a hybrid win where the others stay single)."""
    pipelines: dict[str, dict[str, dict[str, Any]]] = {}
    for t in targets:
        own = (own_settings or {}).get(t.pipeline, setting)
        alpha = own["dense_weight"]
        pipelines[t.pipeline] = {
            t.fuse: {"method": own["method"], "k": own["k"],
                     "weights": {t.dense: round(alpha, 4), t.sparse: round(1.0 - alpha, 4)}},
            t.dense: {"k": own["depth_dense"]},
            t.sparse: {"k": own["depth_sparse"]},
        }
        thresholds = {"min_similarity": floor, "min_probability": probability_floor}
        if t.gate is not None and any(v is not None for v in thresholds.values()):
            pipelines[t.pipeline][t.gate] = {k: v for k, v in thresholds.items() if v is not None}
    for (pipeline, step), fields in (expansions or {}).items():
        pipelines.setdefault(pipeline, {})[step] = fields
    resources = {name: dict(setting["bm25"]) for name in sorted({t.sparse_resource for t in targets})}
    return {"resources": resources, "pipelines": pipelines}
