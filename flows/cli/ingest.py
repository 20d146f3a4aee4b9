"""`ragline validate`, `index`, `run` and `check`: the pipelines file checked, ingestion run from the
terminal (the paths a user names, the collections), any pipeline run with JSON inputs, the index checked."""
from __future__ import annotations

import json
import sys

from ragline.flows.cli.common import (
    EXIT_SKIPPED, job_collection_flag, json_value, open_project, orchestration_flags, set_overrides)
from ragline.flows.errors import EX_USAGE
from ragline.flows.terminal import printable


def register(command) -> None:
    """This module's commands and their flags (``command`` adds a subparser with the common ones)."""
    p = command("validate", validate, "Check a pipelines file and print every error.")
    p.add_argument("path", nargs="?", help="pipelines file (same as --file)")

    p = command("index", index, "Run an ingestion pipeline (incremental).")
    p.add_argument("paths", nargs="*", help="folders, files or globs to index instead of the pipeline's own")
    p.add_argument("-p", "--pipeline", default="index")
    p.add_argument("-c", "--collection", action="append", metavar="NAME",
                   help="index this collection of pipelines.yaml (repeatable; default: every collection of the "
                        "pipeline, when the file declares collections)")
    p.add_argument("--no-wait", action="store_true", help="fail at once if another run is writing this index")
    p.add_argument("--allow-skipped", action="store_true",
                   help=f"exit 0 even if some documents were skipped (default: exit {EXIT_SKIPPED})")
    orchestration_flags(p, default=True)

    p = command("run", run, "Run any pipeline with JSON inputs.")
    p.add_argument("pipeline")
    p.add_argument("--input", type=json_value, default={}, help='e.g. \'{"query": {"text": "..."}}\'')
    p.add_argument("--set", action="append", default=[], metavar="STEP.PARAM=JSON", help="override a step parameter")
    job_collection_flag(p)
    orchestration_flags(p, default=True)

    register_check(command)


def validate(args) -> int:
    from ragline.flows.spec.compile import load_project, validate_file

    path = args.path or args.file
    errors = validate_file(path)
    for error in errors:
        print(printable(error), file=sys.stderr)
    if errors:
        print(f"{printable(path)}: {len(errors)} error(s)", file=sys.stderr)
        return EX_USAGE  # bad configuration (README's exit codes; errors.ConfigError's)
    project = load_project(path)
    print(printable(f"{path}: OK ({len(project.pipelines)} pipelines: {', '.join(project.pipelines)})"))
    if project.collections:
        print(printable(f"collections: {', '.join(f'{c.name} ({c.pipeline})' for c in project.collections.values())}"))
    if project.overlay is not None:
        print("\n".join(printable(line) for line in project.overlay.describe()))
    return 0


def index_paths(args, paths: list[str], pipeline_name: str, orchestrate: bool):
    """Run an ingestion from the terminal (``paths`` instead of the pipeline's own) with its progress,
    then say what it read, skipped and could not reach."""
    from ragline.flows.run import engine
    from ragline.flows.run.progress import IngestProgress
    from ragline.flows.run.targets import ingestion_for, source_locations

    project = open_project(args)
    pipeline = ingestion_for(project, pipeline_name, paths, wait=not getattr(args, "no_wait", False))
    progress = IngestProgress(f"indexing ({pipeline_name})")
    try:
        report = engine.run(pipeline, orchestrate=orchestrate, progress=progress)
    finally:
        progress.close()
    for failure in report.failures:
        print(printable(f"skipped {failure.source_id}: {failure.reason} (step {failure.stage})"), file=sys.stderr)
    listed = source_locations(pipeline) or report.roots
    origin = " (given on the command line)" if paths else ""
    print(printable(f"sources{origin}: {', '.join(listed) or 'none'}"), file=sys.stderr)
    print(printable(f"{pipeline_name}: {report.summary()} in {report.seconds:.1f} s"))
    if report.incomplete:
        print(printable(f"error: {len(report.incomplete)} source path(s) could not be reached "
                        f"({', '.join(f.source_id for f in report.incomplete)}): nothing was deleted from the index"),
              file=sys.stderr)
    return project, report


def index(args) -> int:
    from ragline.flows.run.targets import ingestion_names

    names = ingestion_names(open_project(args), args.pipeline, args.collection, args.paths)
    code = 0
    for name in names:
        _, report = index_paths(args, args.paths, name, args.orchestrate)
        if report.incomplete:
            code = 1
        elif report.failed and not args.allow_skipped and not code:
            code = EXIT_SKIPPED
    return code


def run(args) -> int:
    from ragline.flows.run import engine
    from ragline.flows.spec.collections import for_collection

    project = open_project(args)
    name = for_collection(project, args.pipeline, args.collection)
    pipeline = project.pipeline(name).with_overrides(set_overrides(args.set))
    print(printable(describe_pipeline(pipeline)), file=sys.stderr)
    result = engine.run(pipeline, args.input, orchestrate=args.orchestrate)
    from ragline.flows.contracts import to_json

    print(json.dumps(to_json(result), indent=2))
    return 0


def describe_pipeline(pipeline) -> str:
    """What `run` is about to do, so an ingestion run (which writes and deletes) is never a surprise."""
    from ragline.flows.contracts import PipelineKind

    steps = " -> ".join(f"{s.id} ({s.stage.name})" for s in pipeline.steps)
    if pipeline.kind in (PipelineKind.QUERY, PipelineKind.JOB):
        return f"running {pipeline.kind} pipeline '{pipeline.name}': {steps}"
    load = pipeline.load_step
    paths = ", ".join(map(str, load.params.paths)) if load is not None else "its sources"
    return (f"running ingestion pipeline '{pipeline.name}': indexes {paths} (relative to "
            f"{pipeline.project.base_dir}) and removes documents no longer found there; steps: {steps}")


def register_check(command) -> None:
    p = command("check", check, "Compare every store (Chroma, BM25) with the index state: all ids, counts, the "
                                 "BM25 version, the embedder. Exit 0: they agree; 1: problems found; 2: bad "
                                 "configuration.")
    p.add_argument("--repair", action="store_true",
                   help="repair what the state allows (delete stray vectors, rebuild BM25, re-embed sources whose "
                        "vectors are missing) and check again")


def check(args) -> int:
    from ragline.flows.run.check import check

    project = open_project(args)

    def reindex(pipeline: str) -> None:
        _, report = index_paths(args, [], pipeline, orchestrate=False)
        if report.incomplete:
            raise RuntimeError(f"re-indexing with '{pipeline}' could not reach every source: nothing was deleted")

    remaining = check(project, args.repair, say=lambda line: print(printable(line)), reindex=reindex)
    if not remaining:
        print("ok: every store agrees with the index state")
        return 0
    print(f"{len(remaining)} problem(s)" + ("" if args.repair else ": `ragline check --repair` repairs what the "
                                                                   "state allows"), file=sys.stderr)
    return 1
