"""Flow runs that start warm: ``ragline serve``'s runner forks each flow-run process from a
forkserver that has already imported Prefect's engine, ragline's and the project's heavy libraries
(chromadb, sentence-transformers, bm25s: each resource type's ``preload``), instead of starting a
fresh interpreter that imports them again for every scheduled run (~3.5 s of CPU here, more than a
one-change ingestion run's own work).

Prefect's runner starts a flow-run process with ``run_flow_in_subprocess``, which asks
``multiprocessing`` for its ``spawn`` context. While serve runs, that module's ``multiprocessing``
name is this module's ``_ForkserverModule``, whose ``get_context("spawn")`` is the forkserver
context; everything else is multiprocessing's own. The child runs exactly what a spawned one runs
(the pickled flow run and its environment), so a run started warm and one started cold differ only
in what was imported already. If Prefect stops asking that way, nothing is patched and runs start
cold (logged): never a different way of running.

The forkserver is one per process (multiprocessing's), started by the first flow run and kept until
the process ends. It dies with serve (``forkserver_prelude`` arms its parent-death signal), and each
flow-run process arms its own on the forkserver (``parent_death.die_with``), so a ``kill -9`` of
serve still takes the runs along. Libraries are imported, not used, before the fork: no thread pool
or model exists yet. Should the forkserver die anyway, multiprocessing starts another at the next
run (with the same imports).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
from typing import Any, Iterator

from ragline.flows.resources import resource_type

log = logging.getLogger(__name__)

# What every flow run imports first: Prefect's engine, the flow (run_pipeline) and ragline's engine.
BASE_MODULES = ("prefect.flow_engine", "ragline.flows.run.entrypoints", "ragline.flows.run.engine",
                "ragline.tasks")


def preload_modules(project: Any) -> list[str]:
    """What a flow run of ``project`` imports anyway, base first, each once: the modules of its
    pipelines' stages and the libraries its resources load (``Resource.preload``)."""
    stages = [step.stage.fn.__module__ for pipeline in project.pipelines.values() for step in pipeline.steps]
    libraries = [m for spec in project.spec.resources.values() for m in resource_type(spec).preload]
    return list(dict.fromkeys([*BASE_MODULES, *stages, *libraries]))


class _ForkserverModule:
    """Stands for ``multiprocessing`` in ``prefect.flow_engine``: the ``spawn`` context it asks for
    a flow run's process is the forkserver context; any other name is multiprocessing's."""

    def __init__(self, context: Any):
        self._context = context

    def get_context(self, method: str | None = None) -> Any:
        return self._context if method == "spawn" else multiprocessing.get_context(method)

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


@contextlib.contextmanager
def warm_flow_runs(modules: list[str]) -> Iterator[bool]:
    """While open, Prefect's flow-run processes fork from a forkserver that imported ``modules``.
    The forkserver starts with the first run (which waits for those imports, as a cold run waits
    for its own), so a serve that runs nothing pays nothing. Yields whether runs start warm; False
    (cold, as Prefect starts them) where Prefect no longer asks ``multiprocessing``'s spawn context
    by that name, or the platform has no forkserver."""
    import prefect.flow_engine as engine

    if engine.__dict__.get("multiprocessing") is not multiprocessing or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        log.warning("flow runs start cold: this Prefect does not start them through multiprocessing's "
                    "spawn context (ragline.flows.serve.supervise.warm)")
        yield False
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ragline.flows.serve.supervise.forkserver_prelude", *modules])
    engine.multiprocessing = _ForkserverModule(context)
    try:
        yield True
    finally:
        engine.multiprocessing = multiprocessing
