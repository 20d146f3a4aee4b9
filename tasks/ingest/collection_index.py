"""The index of each named collection, for query stages that read the index but are not spread
across collections (the retrievers are: ``flows.spec.collections``). With ``collections:``
declared, a step's own index resources are the ingestion template's, which nothing writes; these
helpers give such a stage the same resource of the collections a query searches, or of the one a
passage came from (its ``metadata.collection``). Without collections: the step's own resource."""
from __future__ import annotations

from typing import Any

from ragline.flows.context import StepContext
from ragline.flows.contracts import COLLECTION_KEY  # noqa: F401  (re-exported to the stages)



def by_collection(ctx: StepContext, role: str, own: Any, names: list[str] | None = None) -> dict[str | None, Any]:
    """The step's ``role`` resource in each named collection of ``names`` (all when None), in the
    file's order; ``{None: own}`` when the file declares none or the resource is no collection's."""
    project = ctx.project
    if project is None or not project.collections:
        return {None: own}
    bound = project.pipeline(ctx.pipeline).step(ctx.step_id).resources.get(role)
    found = {c.name: project.resource(c.resources[bound]) for c in project.collections.values()
             if bound in c.resources and (names is None or c.name in names)}
    return found or {None: own}


def in_collection(ctx: StepContext, role: str, own: Any, name: str | None) -> Any:
    """The step's ``role`` resource in collection ``name`` (a passage's); ``own`` for None or a
    collection the resource is not part of."""
    return by_collection(ctx, role, own, [name]).get(name, own) if name else own
