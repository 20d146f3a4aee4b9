"""The walk of one query through the packages (issue 23): which ragline modules a `search` query
enters on its way from the query service to the stages, and how often a call climbs back up the
layering (a module calling into a module of a higher layer, e.g. a resource calling the engine).

Indexes the bundled sample into a temporary folder (--no-prefect), then traces one query as the API's
``QueryService.run`` runs it (on a driver thread) with ``threading.setprofile``. Prints the figures; nothing is written.

    .venv/bin/python bench/query_walk.py
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# lower number = lower layer (pyproject's [tool.importlinter] layers, bottom-up)
LAYERS = [("ragline.flows.errors",), ("ragline.flows.contracts", "ragline.flows.settings"),
          ("ragline.flows.context", "ragline.flows.failpoints", "ragline.flows.terminal"),
          ("ragline.flows.resources",), ("ragline.flows.spec",), ("ragline.tasks",), ("ragline.flows.run",),
          ("ragline.flows.evaluation", "ragline.flows.ops"), ("ragline.flows.serve",), ("ragline.flows.cli",)]


def layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def main() -> None:
    from ragline.flows.cli import main as cli
    from ragline.flows.serve.query_service import QueryService
    from ragline.flows.spec.compile import load_project

    import threading

    threading.setprofile(_profile)  # before any step thread starts: the step pool is shared and lives on
    sys.setprofile(_profile)
    with tempfile.TemporaryDirectory() as tmp:
        project_dir = Path(tmp)
        shutil.copy(REPO / "pipelines.yaml", project_dir / "pipelines.yaml")
        shutil.copytree(REPO / "samples", project_dir / "samples")
        shutil.copytree(REPO / "prompts", project_dir / "prompts")
        assert cli(["index", "-f", str(project_dir / "pipelines.yaml"), "--no-prefect"]) == 0
        service = QueryService(load_project(str(project_dir / "pipelines.yaml")))
        query = {"text": "what does ragline log for observability?"}
        _traced(service, query, record=False)  # warm: models loaded, caches filled, step threads started
        entered, climbs = _traced(service, query)
        service.close()
    print(f"modules entered by one `search` query from QueryService.run: {len(entered)}")
    for module in entered:
        print(f"  {module}")
    print(f"calls that climb back up the layering: {len(climbs)}")
    for caller, callee in sorted(set(climbs)):
        print(f"  {caller} -> {callee}")


RECORD: dict | None = None  # filled while a traced query runs


def _profile(frame, event, arg):
    """One profile function for every thread (step threads are pooled: set once, before warm-up)."""
    if event != "call" or RECORD is None:
        return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("ragline"):
        return
    if module not in RECORD["entered"]:
        RECORD["entered"].append(module)
    caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
    low, high = layer(caller), layer(module)
    if low is not None and high is not None and high > low:
        RECORD["climbs"].append((caller, module))


def _traced(service, query, record: bool = True):
    global RECORD
    from ragline.flows.serve.query_service import _run

    RECORD = {"entered": [], "climbs": []} if record else None
    try:
        _run(service.pipeline("search"), query, None)  # what QueryService.run runs on its driver thread
    finally:
        recorded, RECORD = RECORD, None
    return (recorded["entered"], recorded["climbs"]) if recorded else ([], [])


if __name__ == "__main__":
    main()
