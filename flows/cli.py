"""The `ragline` command: validate, index, search, eval, tune, run, quickstart, api, serve, mcp, feedback export, report."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ragline.flows.errors import EX_USAGE, DependencyUnavailable, InputError, RaglineError
from ragline.flows.terminal import configure_terminal, printable

# Only what every command needs is imported here (issue 24.5): `--help` and `validate` never load
# Prefect, Chroma, torch or a model; each command imports what it uses.
DEFAULT_FILE = "pipelines.yaml"  # compile.DEFAULT_FILE
API_PORT = 8080  # serve.DEFAULT_PORT: `ragline serve` and `ragline api`; the LLM has 8000

EXIT_SKIPPED = 3  # the run completed, but some documents could not be read and were skipped

SAMPLE_QUESTION = "What happens to a document that cannot be read?"  # one the packaged 135M model answers


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Prefect's per-task lines stay in the dashboard; the terminal shows ragline's progress and, on
    # failure, one line (-v: every INFO record and the tracebacks)
    waits_for_llm = args.handler in (_ask, _quickstart, _eval, _run)  # a slow or hung LLM is said so
    configure_terminal(args.verbose, ("ragline.llm",) if waits_for_llm else (), prefect=args.handler is _serve)
    if not args.verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING" if args.handler is _serve else
                              "CRITICAL")
    if args.allow_module:
        from ragline.flows.spec.registry import set_allowed_modules

        set_allowed_modules(args.allow_module)
    if getattr(args, "no_tuned", False):
        from ragline.flows import settings

        settings.export("tuned", "0")  # this process and the ones it starts (flow runs, workers)
    if args.handler is _serve:  # it supervises its runner, API and signals itself
        return _dispatch(args)
    if args.handler in (_search, _ask):
        try:
            served = _served(args)
        except KeyboardInterrupt:  # Ctrl-C while the API answers: nothing of ours to stop
            print("interrupted", file=sys.stderr)
            return 130
        if served is not None:
            return served
    from ragline.flows.ops import prefect_server

    with prefect_server.interrupt_guard():  # Ctrl-C ends the process within seconds, whatever it is doing
        return _dispatch(args)


def _dispatch(args) -> int:
    """Run the command; every failure becomes one clear line and an exit status."""
    orchestrated = getattr(args, "orchestrate", False) or args.handler is _quickstart
    try:
        if not orchestrated:
            return args.handler(args)
        from ragline.flows.ops import prefect_server

        # ragline's own Prefect API when none is configured: shared by commands until it is idle
        with prefect_server.local_api(announce=True):
            return args.handler(args)
    except KeyboardInterrupt:
        from ragline.flows.ops import prefect_server

        return prefect_server.interrupted_exit()
    except RaglineError as exc:  # its class says the exit status; a failure of ours keeps its traceback for -v
        if exc.exit_code == 1 and getattr(args, "verbose", False):
            raise
        from ragline.flows.spec.parse import SpecValidationError

        listed = exc.errors if isinstance(exc, SpecValidationError) else None
        for line in listed or [f"error: {exc}"]:
            print(printable(line), file=sys.stderr)
        if listed:
            print(f"{len(listed)} error(s)", file=sys.stderr)
        return exc.exit_code
    except (KeyError, FileNotFoundError, ValueError) as exc:
        print(f"error: {printable(exc.args[0] if exc.args else exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a stage failure: one clear line, the traceback only with -v
        if getattr(args, "verbose", False):
            raise
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragline", description="Declarative RAG pipelines on Prefect.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        p.add_argument("-f", "--file", default=DEFAULT_FILE, help="pipelines file (default: pipelines.yaml)")
        p.add_argument("-v", "--verbose", action="store_true", help="full tracebacks")
        p.add_argument("--allow-module", action="append", default=[], metavar="MODULE",
                       help="a module user stages may be imported from (with RAGLINE_ALLOW_MODULES and "
                            "[tool.ragline] allow_modules in pyproject.toml); pipelines.yaml can only narrow it")
        p.add_argument("--data-dir", type=Path,
                       help="keep every index (Chroma embedded, BM25, state) in this folder instead of the file's")
        p.add_argument("--no-tuned", action="store_true",
                       help="ignore the overlay `ragline tune` wrote (pipelines.tuned.yaml); also RAGLINE_TUNED=0")
        return p

    p = command("validate", _validate, "Check a pipelines file and print every error.")
    p.add_argument("path", nargs="?", help="pipelines file (same as --file)")

    p = command("index", _index, "Run an ingestion pipeline (incremental).")
    p.add_argument("paths", nargs="*", help="folders, files or globs to index instead of the pipeline's own")
    p.add_argument("-p", "--pipeline", default="index")
    p.add_argument("-c", "--collection", action="append", metavar="NAME",
                   help="index this collection of pipelines.yaml (repeatable; default: every collection of the "
                        "pipeline, when the file declares collections)")
    p.add_argument("--no-wait", action="store_true", help="fail at once if another run is writing this index")
    p.add_argument("--allow-skipped", action="store_true",
                   help=f"exit 0 even if some documents were skipped (default: exit {EXIT_SKIPPED})")
    _orchestration_flags(p, default=True)

    p = command("search", _search, "Search the index and print ranked passages.")
    p.add_argument("question")
    p.add_argument("-p", "--pipeline", default="search")
    p.add_argument("-k", "--top", type=int, default=5, help="passages to print")
    p.add_argument("--where", type=_json_value, help='metadata filter, e.g. \'{"format": "markdown"}\'')
    _collection_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    _orchestration_flags(p, default=False)

    p = command("ask", _ask, "Answer a question from the index, with citations (needs the LLM server).")
    p.add_argument("question")
    p.add_argument("-p", "--pipeline", default="ask")
    p.add_argument("--history", type=_json_value, default=[],
                   help='earlier turns, e.g. \'[{"role": "user", "content": "..."}, {"role": "assistant", ...}]\'')
    p.add_argument("--where", type=_json_value, help="metadata filter")
    _collection_flag(p)
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole answer object as JSON")
    _orchestration_flags(p, default=False)
    _start_llm_flag(p)

    p = command("eval", _eval, "Evaluate a query pipeline: retrieval on a BEIR folder, answers on an RGB file, or "
                               "(no labels) on a test set generated from the index, answers scored by the LLM judge.")
    p.add_argument("--dataset",
                   help="BEIR folder (corpus.jsonl, queries.jsonl, qrels/), an RGB-format .json file, or a "
                        "generated test set (.jsonl)")
    p.add_argument("--generate-testset", type=int, metavar="N",
                   help="write N questions made from the indexed documents by the LLM (pseudo-query stage) "
                        "to --testset, with their source passages")
    p.add_argument("--testset", help="a generated test set: retrieval (source hit@10, MRR@10) on the project's "
                                     "own index; default .ragline/testsets/generated.jsonl")
    p.add_argument("--judge", action="store_true",
                   help="also answer each test-set question (--answer-pipeline) and score faithfulness, answer "
                        "and context relevance with the configured LLM (no labels needed)")
    p.add_argument("--answer-pipeline", default="ask", help="the pipeline whose answers --judge scores")
    p.add_argument("--seed", type=int, default=0, help="--generate-testset: the same seed makes the same set")
    p.add_argument("-p", "--pipeline", help="default: search (BEIR, test set), ask (RGB)")
    p.add_argument("--index-pipeline", default="index", help="the ingestion pipeline that indexes the dataset's "
                                                             "corpus (BEIR, RGB) into a private copy")
    p.add_argument("-c", "--collection", metavar="NAME",
                   help="index the dataset's corpus with this collection's pipeline (default: the only collection "
                        "of --index-pipeline, when pipelines.yaml declares collections)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, help="evaluate the first N judged queries only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _orchestration_flags(p, default=None)  # None: a flow run (its report on the dashboard) when an API is configured
    _start_llm_flag(p)

    p = command("tune", _tune, "Tune hybrid retrieval on pseudo-queries made from the index (no labels) and write "
                               "the choice as an overlay that search and ask use (pipelines.yaml is never written).")
    p.add_argument("-p", "--pipeline", default="tune")
    p.add_argument("--set", action="append", default=[], metavar="STEP.PARAM=JSON",
                   help="override a step parameter, e.g. pairs.n=500 or tune.min_gain=0.01")
    p.add_argument("--dry-run", action="store_true", help="report the candidates, write nothing")
    _job_collection_flag(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _orchestration_flags(p, default=True)

    p = command("run", _run, "Run any pipeline with JSON inputs.")
    p.add_argument("pipeline")
    p.add_argument("--input", type=_json_value, default={}, help='e.g. \'{"query": {"text": "..."}}\'')
    p.add_argument("--set", action="append", default=[], metavar="STEP.PARAM=JSON", help="override a step parameter")
    _job_collection_flag(p)
    _orchestration_flags(p, default=True)

    p = command("api", _api, "Serve the HTTP API: queries, OpenAI-compatible chat, documents (uploads ingested in this "
                             "process), health (OpenAPI at /docs).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=API_PORT, help=f"default {API_PORT} (the LLM endpoint has 8000)")
    p.add_argument("--token",
                   help="bearer token, required off loopback (prefer RAGLINE_API_TOKEN: flags show in ps)")
    p.add_argument("--max-body-bytes", type=int, default=1_000_000)
    p.add_argument("--cors-origin", action="append", default=[], help="allow this browser origin (CORS is off)")
    _start_llm_flag(p)

    p = command("mcp", _mcp, "Serve the project to an MCP client over stdio (Claude Desktop, Cursor): tools search, "
                             "ask, list_collections, get_passage, list_documents and documents as resources, as the "
                             "local operator (every collection and document). Over HTTP: /mcp of `api` and `serve`.")
    _start_llm_flag(p)

    p = command("serve", _serve, "Serve every pipeline as a Prefect deployment (schedules included) plus the "
                                 "HTTP API, in one supervised process.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=API_PORT, help=f"default {API_PORT} (the LLM endpoint has 8000)")
    p.add_argument("--token",
                   help="bearer token, required off loopback (prefer RAGLINE_API_TOKEN: flags show in ps)")
    p.add_argument("--no-api", action="store_true", help="serve the deployments only")
    p.add_argument("--start-prefect", action="store_true",
                   help="start a local Prefect server when PREFECT_API_URL is not set")
    p.add_argument("--poll-seconds", type=_positive(float), default=2.0,
                   help="how often the runner looks for new runs")
    p.add_argument("--limit", type=_positive(int), help="flow runs at once (default: PREFECT_RUNNER_PROCESS_LIMIT, 5)")
    p.add_argument("--keep-schedules", action="store_true", help="do not pause schedules when serve stops")
    p.add_argument("--serve-jobs", action="store_true", default=None,
                   help="also deploy job pipelines (tune, adapt, summarize) that declare no schedule "
                        "(RAGLINE_SERVE_JOBS); without it they have no deployment to start")
    p.add_argument("--keep-results-days", type=_keep_days, default=30.0, metavar="DAYS",
                   help="delete served runs' JSON results older than this (at start, then hourly); 0: keep all")
    p.add_argument("--cold-runs", action="store_true",
                   help="start each flow run in a fresh interpreter (Prefect's way) instead of forking it from "
                        "a process that imported Prefect, ragline and the project's libraries once")
    _start_llm_flag(p)

    _check_command(command)
    _keys_command(command)
    _feedback_command(command)

    p = command("report", _report, "Write one self-contained HTML page of the served queries (query log), "
                                   "feedback, eval runs and ingestion: latency per step, refusals, ratings over time.")
    p.add_argument("--out", type=Path, default=Path("report.html"), help="the page (default: report.html)")
    p.add_argument("--since", default="7d", help="the period shown: 30m, 12h, 7d, 4w or all (default 7d)")

    p = command("prefect", _prefect, "Show or stop ragline's local Prefect server (shared by commands until "
                                     "RAGLINE_PREFECT_IDLE_SECONDS pass unused).")
    p.add_argument("action", choices=("status", "stop"))

    p = command("quickstart", _quickstart, "Index a folder (default: the bundled sample), search it and answer "
                                           "a question with citations.")
    p.add_argument("folder", nargs="?", help="folder to index (default: the pipeline's own paths)")
    p.add_argument("question", nargs="?", default=SAMPLE_QUESTION)
    p.add_argument("-c", "--collection", metavar="NAME",
                   help="with collections declared in pipelines.yaml: the one to index (default: the only one)")
    _start_llm_flag(p)
    return parser


# ----------------------------------------------------------------------------- ragline keys (issue 19.2)
def _keys_command(command) -> None:
    from ragline.flows.serve.scopes import SCOPES

    p = command("keys", _keys, "Manage the API keys of this project's `ragline api`/`serve` (kept hashed in "
                               "<data dir>/.ragline/keys.json; a running server sees changes on the next request).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (once: it is never shown again)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.add_argument("--scope", action="append", required=True, choices=SCOPES,
                        help="what the key may do (repeat; admin implies all)")
    create.add_argument("--collection", action="append", required=True, metavar="NAME",
                        help="a Chroma collection the key may use (repeat), or * for all")
    create.add_argument("--group", action="append", default=[], help="a group of the key's holder (document ACLs)")
    create.add_argument("--expires", default="90d", help="lifetime: 12h, 90d, 4w (default 90d, at most 365d)")
    listing = actions.add_parser("list", help="every key: id, name, rights, expiry, status (never a secret)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = actions.add_parser("revoke", help="refuse a key from the next request on")
    revoke.add_argument("id")
    rotate = actions.add_parser("rotate", help="a new secret for a key (same rights); the old one is refused")
    rotate.add_argument("id")
    rotate.add_argument("--expires", help="new lifetime (default: as long as the key was made to live)")


def _keys(args) -> int:
    from ragline.flows.serve.keys import KeyStore, describe, keys_file, parse_lifetime

    store = KeyStore(keys_file(args.data_dir or Path(args.file).resolve().parent))
    if args.action == "create":
        record, key = store.create(args.name, args.scope, args.collection, args.group, parse_lifetime(args.expires))
        print(f"created key {record.id} ({record.name}), expires {record.expires.isoformat()}; store it now, it "
              f"is not shown again:", file=sys.stderr)
        print(key)
    elif args.action == "list":
        rows = [describe(k) for k in store.list()]
        if args.json:
            print(json.dumps(rows, indent=2))
        for row in [] if args.json else rows:
            print(f"{row['id']}  {row['status']:<7}  {row['name']}  scopes={','.join(row['scopes'])}  "
                  f"collections={','.join(row['collections'])}  groups={','.join(row['groups']) or '-'}  "
                  f"expires={row['expires']}")
    elif args.action == "revoke":
        record = store.revoke(args.id)
        print(f"revoked key {record.id} ({record.name})")
    else:
        record, key = store.rotate(args.id, parse_lifetime(args.expires) if args.expires else None)
        print(f"rotated key {record.id} ({record.name}): the old secret is refused from now; new key, "
              f"expires {record.expires.isoformat()}:", file=sys.stderr)
        print(key)
    return 0


# ----------------------------------------------------------------------------- ragline check (issue 16)
def _check_command(command) -> None:
    p = command("check", _check, "Compare every store (Chroma, BM25) with the index state: all ids, counts, the "
                                 "BM25 version, the embedder. Exit 0: they agree; 1: problems found; 2: bad "
                                 "configuration.")
    p.add_argument("--repair", action="store_true",
                   help="repair what the state allows (delete stray vectors, rebuild BM25, re-embed sources whose "
                        "vectors are missing) and check again")


def _check(args) -> int:
    from ragline.flows.run.check import check

    project = _project(args)

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


# ----------------------------------------------------------------------------- ragline feedback (issue 20.3)
def _feedback_command(command) -> None:
    p = command("feedback", _feedback, "Feedback given to served answers (POST /v1/feedback).")
    actions = p.add_subparsers(dest="feedback_action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="write the feedback joined with the query log's entries as JSONL, "
                                               "or (--qrels) as a BEIR-style folder for `ragline eval` and tune",
                                description="Feedback joined with the logged query it rates (question, retrieved "
                                            "ids, answer), one JSON object a line.")
    export.add_argument("-f", "--file", default=argparse.SUPPRESS, help="pipelines file (default: pipelines.yaml)")
    export.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS,
                        help="the served data dir (default: the pipelines file's folder)")
    export.add_argument("--out", type=Path, help="write the JSONL here (default: standard output)")
    export.add_argument("--qrels", type=Path, metavar="DIR",
                        help="write queries.jsonl, qrels/train.tsv and qrels/test.tsv here instead: rated answers "
                             "as judgements of the index's documents (`ragline eval --dataset DIR`)")
    export.add_argument("--test-share", type=float, default=0.3,
                        help="share of the questions put in the test split (the rest: train); default 0.3")


def _feedback(args) -> int:
    from ragline.flows.files import write_atomic
    from ragline.flows.serve.feedback import export_qrels, joined
    from ragline.flows.serve.layout import data_dir_of

    data_dir = data_dir_of(_project(args))
    if args.qrels is not None:
        if not 0 <= args.test_share <= 1:
            raise InputError(f"--test-share {args.test_share}: expected a share between 0 and 1")
        summary = export_qrels(data_dir, args.qrels, args.test_share)
        print(printable(f"{args.qrels}: {summary['queries']} judged questions ({summary['train']} train, "
                        f"{summary['test']} test) from {summary['rated_answers']} rated answers; skipped "
                        f"{summary['skipped_no_question']} without a logged question, {summary['skipped_no_relevant']} "
                        f"without a relevant document"))
        return 0
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in joined(data_dir))
    if args.out is None:
        sys.stdout.write(lines)
    else:
        write_atomic(args.out, lines)
        print(printable(f"{args.out}: {lines.count(chr(10))} feedback record(s)"), file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- ragline report (issue 20.5)
def _report(args) -> int:
    from ragline.flows.files import write_atomic
    from ragline.flows.serve.layout import data_dir_of
    from ragline.flows.serve.report import build, ingestion_rows, parse_since

    since = parse_since(args.since)
    project = _project(args)
    write_atomic(args.out, build(data_dir_of(project), since, ingestion_rows(project)))
    print(printable(f"{args.out}: report of {data_dir_of(project)} (since {args.since})"), file=sys.stderr)
    return 0


def _prefect(args) -> int:
    from ragline.flows.ops import prefect_server

    print(prefect_server.stop_shared_server() if args.action == "stop" else prefect_server.describe_shared_server())
    return 0


def _json_value(text: str) -> Any:
    """A JSON argument; a bad one is one line naming the problem (a value nested deeper than
    Python's parser goes raised a RecursionError with a traceback)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise argparse.ArgumentTypeError("the JSON is nested too deeply") from None
    except ValueError as exc:
        shown = text if len(text) <= 80 else text[:80] + "…"
        raise argparse.ArgumentTypeError(f"invalid JSON {printable(shown)!r}: {exc}") from None


def _start_llm_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-start-llm", dest="start_llm", action="store_false",
                   help="do not start the packaged LLM (vLLM, deploy/vllm/) when the configured local endpoint "
                        "is down (also RAGLINE_START_LLM=0)")


def _orchestration_flags(p: argparse.ArgumentParser, default: bool | None) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prefect", dest="orchestrate", action="store_true", help="run as a Prefect flow")
    group.add_argument("--no-prefect", dest="orchestrate", action="store_false", help="run in-process, no flow run")
    p.set_defaults(orchestrate=default)


# ----------------------------------------------------------------------------- commands
def _project(args):
    """The pipelines file, with its indexes moved to ``--data-dir`` when one is given."""
    from ragline.flows.spec.compile import load_project

    project = load_project(args.file)
    return project.relocated(args.data_dir) if getattr(args, "data_dir", None) else project


def _query_pipeline(project, name: str):
    """A query pipeline by name; an ingestion pipeline is refused before anything runs (it would
    load its own paths and delete every other document from the index)."""
    from ragline.flows.evaluation.retrieval import require_kinds

    require_kinds(project, query=name)
    return project.pipeline(name)


def _validate(args) -> int:
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
    from ragline.flows.run import engine
    from ragline.flows.evaluation.retrieval import require_kinds
    from ragline.flows.run.progress import IngestProgress

    project = _project(args)
    require_kinds(project, ingestion=pipeline_name)
    pipeline = project.pipeline(pipeline_name)
    overrides: dict[str, dict[str, Any]] = {}
    if paths:  # relative to the current folder, unlike the file's own paths (relative to the file)
        load_step = next(s.id for s in pipeline.steps if s.stage.name == "load")
        overrides[load_step] = {"paths": [str(Path(p).resolve()) for p in paths]}
    sink = next((s.id for s in pipeline.steps if s.stage.plan is not None), None)
    if getattr(args, "no_wait", False) and sink is not None:
        overrides[sink] = {"wait": False}
    pipeline = pipeline.with_overrides(overrides) if overrides else pipeline
    progress = IngestProgress(f"indexing ({pipeline_name})")
    try:
        report = engine.run(pipeline, orchestrate=orchestrate, progress=progress)
    finally:
        progress.close()
    for failure in report.failures:
        print(printable(f"skipped {failure.source_id}: {failure.reason} (step {failure.stage})"), file=sys.stderr)
    listed = _source_locations(pipeline) or report.roots
    origin = " (given on the command line)" if paths else ""
    print(printable(f"sources{origin}: {', '.join(listed) or 'none'}"), file=sys.stderr)
    print(printable(f"{pipeline_name}: {report.summary()} in {report.seconds:.1f} s"))
    if report.incomplete:
        print(printable(f"error: {len(report.incomplete)} source path(s) could not be reached "
                        f"({', '.join(f.source_id for f in report.incomplete)}): nothing was deleted from the index"),
              file=sys.stderr)
    return project, report


def _source_locations(pipeline) -> list[str]:
    """The load step's roots as absolute paths (the file's own are relative to its folder): what
    the user can find on disk, whatever names the index gives them."""
    load = next((s for s in pipeline.steps if s.stage.name == "load"), None)
    if load is None:
        return []
    return [os.path.abspath(os.path.join(pipeline.project.base_dir, os.path.expanduser(entry.path)))
            if entry.type == "local" else str(entry) for entry in load.params.paths]


def _index(args) -> int:
    names = _ingestion_names(_project(args), args.pipeline, args.collection, args.paths)
    code = 0
    for name in names:
        _, report = index_paths(args, args.paths, name, args.orchestrate)
        if report.incomplete:
            code = 1
        elif report.failed and not args.allow_skipped and not code:
            code = EXIT_SKIPPED
    return code


def _ingestion_names(project, pipeline: str, collections: list[str] | None, paths: list[str]) -> list[str]:
    """The ingestion pipelines `ragline index` runs: ``pipeline``, or its collections' (``index@NAME``):
    those named with --collection, by default all of them (folders given on the command line go to
    one collection only)."""
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


def _collection_flag(p) -> None:
    p.add_argument("-c", "--collection", action="append", metavar="NAME",
                   help="search this collection of pipelines.yaml (repeatable; default: all of them)")


def _job_collection_flag(p) -> None:
    p.add_argument("-c", "--collection", metavar="NAME",
                   help="a job that reads the index (tune, adapt) reads this collection's (default: the only one, "
                        "when pipelines.yaml declares collections)")


def _search(args) -> int:
    from ragline.flows.run import engine

    pipeline = _query_pipeline(_project(args), args.pipeline)
    query: dict[str, Any] = {"text": args.question, "filters": args.where, "collections": args.collection}
    passages = engine.run(pipeline, {"query": query}, orchestrate=args.orchestrate)
    _print_passages([_plain(p) for p in passages[: args.top]], args.json)
    return 0


def _ask(args) -> int:
    from ragline.flows.run import engine

    pipeline = _query_pipeline(_project(args), args.pipeline)
    streamed: list[str] = []

    def show(token: str) -> None:
        streamed.append(token)
        print(printable(token, keep_newlines=True), end="", flush=True)

    if args.stream:
        pipeline = pipeline.with_overrides({s.id: {"stream": True} for s in pipeline.steps
                                            if "stream" in s.stage.params.model_fields})
    query = {"text": args.question, "history": args.history, "filters": args.where, "collections": args.collection}
    with _packaged_llms(pipeline.project, args.start_llm, [args.pipeline]):
        answer = engine.run(pipeline, {"query": query}, orchestrate=args.orchestrate,
                            on_token=show if args.stream and not args.json else None)
    _print_answer(answer.model_dump(mode="json"), args.json, bool(streamed))
    return 0


def _plain(item: Any) -> Any:
    return item.model_dump(mode="json") if hasattr(item, "model_dump") else item


def _print_answer(answer: dict[str, Any], as_json: bool, streamed: bool) -> None:
    """An answer (``Answer`` as JSON, in-process or from the API): its text, or the refusal and its
    reason, then its numbered sources."""
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    if streamed:
        print("\n")
        if answer["refused"] or answer.get("answered_by") == "evidence":
            print(printable(answer["text"], keep_newlines=True))
    else:
        print(printable(answer["text"], keep_newlines=True))
    if answer["refused"] and answer.get("reason"):
        print(printable(f"({answer['reason']})"))
    elif answer.get("answered_by") == "evidence":
        print(printable(f"(evidence answer{': ' + answer['reason'] if answer.get('reason') else ''})"))
    for source in [] if answer["refused"] else answer.get("sources", []):
        where = f" ({source['collection']})" if source.get("collection") else ""
        print(printable(f"[{source['number']}] {source.get('title') or source['source_id']} — {source.get('path')}"
                        f"{where}"))
    if answer.get("invalid_citations"):
        print(f"warning: citations with no matching reference: {answer['invalid_citations']}", file=sys.stderr)


def _print_passages(passages: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(passages, indent=2))
        return
    if not passages:
        print("no passages found")
    for rank, p in enumerate(passages, start=1):
        source = (p.get("metadata") or {}).get("source", p["source_id"])
        collection = (p.get("metadata") or {}).get("collection")
        source += f" ({collection})" if collection else ""
        print(f"{rank}. [{p['score']:.4f}] {printable(p.get('title') or p['source_id'])}\n   {printable(source)}")
        snippet = " ".join(p["text"].split())
        print(f"   {printable(snippet[:300])}{'…' if len(snippet) > 300 else ''}\n")


# ----------------------------------------------------------------------------- a running API (issue 24.5)
def _served(args) -> int | None:
    """`search` or `ask` answered by a running local `ragline api`/`serve` of this very project
    (``serve.discovery``): its models are loaded, so it answers in milliseconds where this process
    would load the embedder first. None: there is none to use (or it refused our token): run here."""
    if args.orchestrate or args.no_tuned:
        return None
    from ragline.flows.serve.discovery import find

    service, why = find(args.file, args.data_dir)
    if service is None:
        if why:
            print(printable(f"({why}: running in-process)"), file=sys.stderr)
        return None
    from ragline.flows import settings

    if service.tuned and not settings.get("tuned"):  # RAGLINE_TUNED=0: the API's overlay is not wanted
        return None
    token = _client_token(service)
    if service.token_required and not token:
        print(printable(f"(the ragline API at {service.url} needs a token: set RAGLINE_API_TOKEN to use it; "
                        f"running in-process)"), file=sys.stderr)
        return None
    body: dict[str, Any] = {"question": args.question, "pipeline": args.pipeline, "filters": args.where}
    if args.collection:
        body["collections"] = args.collection
    if args.handler is _search:
        body["top_k"] = args.top
    else:
        body["history"] = args.history
        body["stream"] = bool(args.stream and not args.json)
    try:
        response = _post(f"{service.url}/v1/query", body, token)
    except _Refused as refused:
        if refused.status == 401:
            print(printable(f"(the ragline API at {service.url} refused the token in RAGLINE_API_TOKEN: running "
                            f"in-process)"), file=sys.stderr)
            return None
        print(printable(f"error: {refused.message} (ragline API at {service.url})"), file=sys.stderr)
        return EX_USAGE if refused.status < 500 else 1
    except OSError as exc:  # not listening (yet), reset: this process can still answer
        print(printable(f"(the ragline API at {service.url} did not answer ({exc}): running in-process)"),
              file=sys.stderr)
        return None
    print(printable(f"(answered by the running ragline API at {service.url}, pid {service.pid})"), file=sys.stderr)
    with response:
        if body.get("stream"):
            return _print_stream(response)
        result = json.load(response)
    if args.handler is _search:
        _print_passages(result["passages"], args.json)
    else:
        _print_answer(result["answer"], args.json, streamed=False)
    return 0


def _client_token(service) -> str | None:
    """The token the CLI sends: where `ragline api` reads its own (RAGLINE_API_TOKEN, through settings)."""
    from ragline.flows import settings

    return settings.get("api_token") or None


class _Refused(RaglineError):
    """The running API answered the query with an error status (its message; 401: not our token)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _post(url: str, body: dict[str, Any], token: str | None):
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=900)  # an answer may wait for a busy LLM
    except urllib.error.HTTPError as exc:
        with exc:
            try:
                message = json.load(exc)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
        raise _Refused(exc.code, message) from None


def _print_stream(response) -> int:
    """The API's server-sent events: tokens as they come, then the answer (or its error)."""
    event, streamed = None, False
    for raw in response:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            if event == "token" and data is not None:
                streamed = True
                print(printable(data["text"], keep_newlines=True), end="", flush=True)
            elif event == "answer":
                _print_answer(data["answer"], as_json=False, streamed=streamed)
                return 0
            elif event == "error":
                print(printable(f"error: {data['error']['message']}"), file=sys.stderr)
                return 1
    print("error: the ragline API's answer stream ended early", file=sys.stderr)
    return 1


def _eval(args) -> int:
    from ragline.flows.evaluation.retrieval import METRICS, evaluate, load_beir, record_run
    from ragline.flows.run.progress import IngestProgress
    from ragline.flows.spec.collections import for_collection

    project = _project(args)
    if args.generate_testset is not None:
        return _generate_testset(args, project)
    if args.judge or args.testset or (args.dataset and _is_testset(args.dataset)):
        return _eval_testset(args, project)
    if not args.dataset:
        raise InputError("ragline eval needs --dataset, --testset, --judge or --generate-testset N")
    if Path(args.dataset).is_file():
        return _eval_answers(args, project)
    args.pipeline = args.pipeline or "search"
    dataset = load_beir(args.dataset, args.split)
    progress = IngestProgress(f"indexing {dataset.name}", enabled=not args.json)
    index_pipeline = for_collection(project, args.index_pipeline, args.collection)
    try:
        result = _evaluation(args, "beir", {"dataset": dataset.name, "split": args.split, "pipeline": args.pipeline},
                             lambda: evaluate(project, dataset, args.pipeline, index_pipeline,
                                              orchestrate=bool(args.orchestrate), progress=progress, limit=args.limit))
    finally:
        progress.close()
    record_run(Path(project.data_dir or project.base_dir).resolve(), result, args.split)
    if args.json:
        print(json.dumps(result))
        return 0
    print(printable(f"{dataset.name} ({args.split}, {result['queries']} queries), pipeline '{args.pipeline}'"))
    print(printable(f"  tuned overlay: {result['overlay']} ({len(result['overlay_changes'])} settings applied)"
                    if result["overlay"] else "  tuned overlay: none (pipelines file as written)"))
    for metric in METRICS:
        print(f"  {metric:<11} {result[metric]:.4f}")
    for line in _depth_lines(result["documents_per_query"]) + _unevaluated_lines(result["not_evaluated"]):
        print(printable(line))
    print(printable(f"  index: {result['index_summary']} in {result['index_seconds']} s; "
                    f"query: {result['query_ms_mean']} ms mean"))
    return 0


def _depth_lines(depth: dict[str, Any]) -> list[str]:
    """What the document-level metrics were computed over (a pipeline returns chunks, not documents)."""
    line = (f"  metrics over distinct documents: recall@{depth['target']} over the top {depth['target']} documents "
            f"of each query (retrieval depth multiplied up to {depth['deepest_scale']}x to reach them)")
    if not depth["queries_short"]:
        return [line]
    return [line, f"  {depth['queries_short']} queries found fewer than {depth['target']} documents (fewest "
                  f"{depth['fewest']}: the index or the depth limit ran out): {', '.join(depth['short_queries'])}"]


def _unevaluated_lines(skipped: dict[str, str]) -> list[str]:
    """Each judged query that was not evaluated, grouped by why (a past-limit group is counted)."""
    by_reason: dict[str, list[str]] = {}
    for qid, reason in skipped.items():
        by_reason.setdefault(reason, []).append(qid)
    lines = []
    for reason, ids in by_reason.items():
        named = ", ".join(ids) if not reason.startswith("past --limit") else f"{ids[0]} ... {ids[-1]}"
        lines.append(f"  not evaluated ({len(ids)} judged queries, {reason}): {named}")
    return lines


def _evaluation(args, kind: str, settings: dict[str, Any], work) -> dict[str, Any]:
    """``work()``, as a flow run whose report the dashboard shows beside it when Prefect is used:
    ``--prefect``, or by default when a Prefect API is configured (``--no-prefect``: never)."""
    from ragline.flows.evaluation import publish
    from ragline.flows.ops.prefect_server import configured_api_url

    as_flow = args.orchestrate if args.orchestrate is not None else configured_api_url() is not None
    return publish.run(work, kind=kind, settings=settings, as_flow=as_flow, required=args.orchestrate is True)


def _is_testset(path: str) -> bool:
    from ragline.flows.evaluation.judge import is_testset

    return Path(path).is_file() and is_testset(path)


def _testset_path(args, project) -> Path:
    from ragline.flows.evaluation.judge import DEFAULT_TESTSET

    given = args.testset or args.dataset
    return Path(given) if given else Path(project.data_dir or project.base_dir).resolve() / DEFAULT_TESTSET


def _generate_testset(args, project) -> int:
    from ragline.flows.evaluation.judge import generate_testset, save_testset

    if args.generate_testset < 1:
        raise InputError(f"--generate-testset {args.generate_testset}: give a number of questions of 1 or more")
    path = _testset_path(args, project)
    if args.dataset and not _is_testset(args.dataset) and Path(args.dataset).exists():
        raise InputError(f"{args.dataset}: not a generated test set; write one with --testset PATH (evaluation "
                         "data is never overwritten)")
    with _packaged_llms(project, args.start_llm, [args.answer_pipeline]):
        rows, stats = generate_testset(project, args.generate_testset, seed=args.seed, pipeline=args.answer_pipeline)
    save_testset(path, rows)
    if args.json:
        print(json.dumps({**stats, "path": str(path)}))
    else:
        print(printable(f"{stats['questions']} questions from {stats['documents']} documents in {stats['seconds']} s "
                        f"written to {path}"))
    return 0 if rows else 1


def _eval_testset(args, project) -> int:
    from ragline.flows.evaluation.judge import evaluate_testset
    from ragline.flows.evaluation.retrieval import record_run

    path = _testset_path(args, project)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no test set; make one with `ragline eval --generate-testset N`")
    if not _is_testset(str(path)):
        raise InputError(f"{path}: not a generated test set (--judge scores answers to generated questions; "
                         "labelled data goes to --dataset without --judge)")
    pipeline = args.pipeline or "search"
    with _packaged_llms(project, args.start_llm, [args.answer_pipeline] if args.judge else [pipeline]):
        result = _evaluation(args, "generated", {"dataset": path.stem, "split": "generated", "pipeline": pipeline},
                             lambda: evaluate_testset(project, path, pipeline, args.answer_pipeline, judge=args.judge,
                                                      limit=args.limit))
    record_run(Path(project.data_dir or project.base_dir).resolve(),
               {k: v for k, v in result.items() if k != "items"}, "generated")
    if args.json:
        print(json.dumps(result))
        return 0
    print(printable(f"{result['dataset']} (generated, {result['queries']} questions), pipeline '{pipeline}'"))
    print(f"  hit@10      {result['hit@10']:.4f}\n  mrr@10      {result['mrr@10']:.4f}")
    if args.judge:
        summary = result["judge"]
        print(printable(f"  judged by {result['judge_model']} ({summary['llm_calls']} calls, {summary['seconds']} s; "
                        f"{summary['refused']} refusals, {summary['unreadable']} unreadable verdicts)"))
        for name in ("faithfulness", "answer_relevance", "context_relevance", "context_relevance_cosine"):
            value = result[name]
            print(f"  {name:<25} {'-' if value is None else f'{value:.4f}'}")
    return 0


def _eval_answers(args, project) -> int:
    from ragline.flows.evaluation.answers import evaluate_answers
    from ragline.flows.spec.collections import for_collection

    index_pipeline = for_collection(project, args.index_pipeline, args.collection)
    with _packaged_llms(project, args.start_llm, [args.pipeline or "ask"]):
        result = _evaluation(args, "answers", {"dataset": Path(args.dataset).name, "pipeline": args.pipeline or "ask"},
                             lambda: evaluate_answers(project, args.dataset, args.pipeline or "ask", limit=args.limit,
                                                      orchestrate=bool(args.orchestrate), index_pipeline=index_pipeline))
    if args.json:
        print(json.dumps(result))
        return 0
    print(printable(f"{result['dataset']} ({result['questions']} questions), pipeline '{result['pipeline']}', "
                    f"model {result['model']}"))
    for corpus in ("positive", "negative", "positive_wrong"):
        print(printable(f"  {corpus:15} " + ", ".join(f"{k} {v}" for k, v in result[corpus].items())))
    for name, figures in result["fact_check"].items():
        print(printable(f"  fact check {name}: {figures}"))
    return 0


def _set_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    for item in items:
        target, _, value = item.partition("=")
        step, _, param = target.partition(".")
        if not (step and param and value):
            raise InputError(f"--set {item!r}: expected STEP.PARAM=JSON")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        overrides.setdefault(step, {})[param] = parsed
    return overrides


def _tune(args) -> int:
    from ragline.flows.run import engine
    from ragline.flows.contracts import TuneReport
    from ragline.flows.evaluation.retrieval import require_kinds
    from ragline.flows.spec.collections import for_collection
    from ragline.tasks.tune_retrieval import summary

    project = _project(args)
    name = for_collection(project, args.pipeline, args.collection)
    require_kinds(project, job=name)
    pipeline = project.pipeline(name)
    overrides = _set_overrides(args.set)
    if args.dry_run:
        for step in pipeline.steps:
            if "write" in step.stage.params.model_fields:
                overrides.setdefault(step.id, {})["write"] = False
    result = engine.run(pipeline.with_overrides(overrides), orchestrate=args.orchestrate)
    if not isinstance(result, TuneReport):
        raise InputError(f"pipeline '{args.pipeline}' does not end in a tune_retrieval step")
    print(json.dumps(result.model_dump(mode="json")) if args.json else printable(summary(result), keep_newlines=True))
    return 0


def _run(args) -> int:
    from ragline.flows.run import engine
    from ragline.flows.spec.collections import for_collection

    project = _project(args)
    name = for_collection(project, args.pipeline, args.collection)
    pipeline = project.pipeline(name).with_overrides(_set_overrides(args.set))
    print(printable(_describe(pipeline)), file=sys.stderr)
    result = engine.run(pipeline, args.input, orchestrate=args.orchestrate)
    from ragline.flows.contracts import to_json

    print(json.dumps(to_json(result), indent=2))
    return 0


def _describe(pipeline) -> str:
    """What `run` is about to do, so an ingestion run (which writes and deletes) is never a surprise."""
    from ragline.flows.contracts import PipelineKind

    steps = " -> ".join(f"{s.id} ({s.stage.name})" for s in pipeline.steps)
    if pipeline.kind in (PipelineKind.QUERY, PipelineKind.JOB):
        return f"running {pipeline.kind} pipeline '{pipeline.name}': {steps}"
    load = next((s for s in pipeline.steps if s.stage.name == "load"), None)
    paths = ", ".join(map(str, load.params.paths)) if load is not None else "its sources"
    return (f"running ingestion pipeline '{pipeline.name}': indexes {paths} (relative to "
            f"{pipeline.project.base_dir}) and removes documents no longer found there; steps: {steps}")


def _api(args) -> int:
    from ragline.flows.serve.api import serve_api
    from ragline.flows.serve.documents import api_documents

    with contextlib.ExitStack() as stack:
        _api_llms(_project(args), args.start_llm, stack)
        documents, upload_limits = api_documents(args.file, data_dir=args.data_dir)  # runs ingest in-process
        serve_api(args.file, host=args.host, port=args.port, token=_token(args), data_dir=args.data_dir,
                  max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin, routers=[documents],
                  body_limits=upload_limits)
    return 0


def _mcp(args) -> int:
    from ragline.flows.serve.mcp import serve_stdio

    with contextlib.ExitStack() as stack:  # stdout is the protocol's: every line of ours goes to stderr
        _api_llms(_project(args), args.start_llm, stack, command="ragline mcp")
        serve_stdio(args.file, data_dir=args.data_dir)
    return 0


def _token(args) -> str | None:
    from ragline.flows import settings

    return args.token or settings.get("api_token") or None


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: a port number, 1 to 65535")
    return port


def _positive(kind):
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            number = 0
        if not number > 0:
            raise argparse.ArgumentTypeError(f"{value!r}: a number above 0")
        return number

    parse.__name__ = kind.__name__
    return parse


def _keep_days(value: str) -> float:
    days = float(value)
    if not days >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of days, 0 or more")
    return days


def _serve(args) -> int:
    from ragline.flows.serve.service import serve

    # the packaged LLM is started (and supervised) by serve, once every argument and port checked out
    return serve(args.file, api=not args.no_api, host=args.host, port=args.port, token=_token(args),
                 start_prefect=args.start_prefect, data_dir=args.data_dir, poll_seconds=args.poll_seconds,
                 limit=args.limit, pause_on_shutdown=not args.keep_schedules,
                 keep_results_days=args.keep_results_days or None, start_llm=args.start_llm,
                 warm_runs=not args.cold_runs, serve_jobs=args.serve_jobs)


# ----------------------------------------------------------------------------- the LLM (issue 24.3)
class LLMDown(DependencyUnavailable):
    """An LLM endpoint a command needs accepts no connection, and ragline is not to start it."""


def _llm_endpoints(project, pipelines=None) -> set[tuple[str, str]]:
    """(base_url, model) of the LLM resources the named pipelines use (all of the file's: None)."""
    used = None if pipelines is None else {name for p in pipelines for s in project.pipeline(p).steps
                                          for name in s.resources.values()}
    return {(spec.base_url, spec.model) for name, spec in project.spec.resources.items()
            if getattr(spec, "type", None) == "openai_compatible" and (used is None or name in used)}


def _accepts_connections(base_url: str, timeout: float = 3.0) -> bool:
    """Something listens at the endpoint (a hung or busy server too: the pipeline's own checks say which)."""
    import socket
    from urllib.parse import urlsplit

    from ragline.flows.ops.llm_server import endpoint_port

    try:
        with socket.create_connection((urlsplit(base_url).hostname or "127.0.0.1", endpoint_port(base_url)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def _how_to_start(base_url: str, model: str, enabled: bool) -> str:
    """One line: the endpoint that is down and the command that starts one there."""
    from ragline.flows.ops.llm_server import PACKAGED_MODEL, endpoint_port, is_local, start_enabled

    down = f"the LLM endpoint {base_url} (model '{model}') did not answer: nothing accepts connections there"
    if not is_local(base_url):
        return (f"{down}; start that server, or point RAGLINE_LLM_BASE_URL at one that runs (the packaged "
                f"model runs here with `ragline serve`)")
    if model != PACKAGED_MODEL:
        return (f"{down}; start your server for '{model}' on port {endpoint_port(base_url)} (ragline starts only "
                f"the packaged model, '{PACKAGED_MODEL}')")
    if not (enabled and start_enabled()):
        return (f"{down}; start it with `VLLM_PORT={endpoint_port(base_url)} bash deploy/vllm/serve.sh`, or let "
                f"ragline start it (without --no-start-llm and RAGLINE_START_LLM=0)")
    return f"{down}, and the packaged LLM could not start there"


@contextlib.contextmanager
def _packaged_llms(project, enabled: bool, pipelines=None, required: bool = True):
    """The packaged model on vLLM for each local LLM endpoint of ``pipelines`` that is down, for this
    command's life, as `quickstart` and `serve` do. An endpoint that is down and not ours to start
    (remote, another model, --no-start-llm) is ``LLMDown`` in one line when ``required``."""
    from ragline.flows.ops.llm_server import local_llm, should_start

    with contextlib.ExitStack() as stack:
        servers = []
        for base_url, model in sorted(_llm_endpoints(project, pipelines)):
            if _accepts_connections(base_url):
                continue
            why: list[str] = []
            server = None
            if should_start(base_url, model, enabled=enabled, say=lambda line: None):
                def say(line: str) -> None:
                    if line.startswith("could not start"):
                        why.append(line)  # it becomes the error's end
                    else:
                        print(printable(line), file=sys.stderr, flush=True)

                server = stack.enter_context(local_llm(base_url, model, enabled=enabled, say=say))
            if server is not None:
                servers.append(server)
            elif required:
                raise LLMDown(_how_to_start(base_url, model, enabled) + "".join(f": {line}" for line in why))
            for line in why:  # quickstart searches without an LLM: the reason, in one line
                print(printable(line), file=sys.stderr, flush=True)
        yield servers


def _api_llms(project, enabled: bool, stack: contextlib.ExitStack, command: str = "ragline api") -> None:
    """`ragline api`'s LLMs, as `serve`'s: the packaged one started in the background and supervised
    (/readyz reports it until it answers); any other endpoint that is down is one line, and the API
    serves search meanwhile."""
    from ragline.flows.ops.llm_server import ManagedLLM, PACKAGED_MODEL, should_start

    def say(line: str) -> None:
        print(printable(f"{command}: {line}"), file=sys.stderr, flush=True)

    for base_url, model in sorted(_llm_endpoints(project)):
        if _accepts_connections(base_url):
            continue
        if should_start(base_url, model, enabled=enabled, say=lambda line: None):
            say(f"starting the packaged LLM ({PACKAGED_MODEL} on vLLM) at {base_url} in the background "
                f"(--no-start-llm to skip); /readyz reports it until it answers")
            stack.callback(ManagedLLM(base_url, say=say).start().stop)
        else:
            say(f"warning: {_how_to_start(base_url, model, enabled)}; answers fail until it runs")


def _quickstart(args) -> int:
    from ragline.flows.spec.collections import for_collection

    index = for_collection(_project(args), "index", args.collection)  # with collections: index@NAME
    project, report = index_paths(args, [args.folder] if args.folder else [], index, orchestrate=True)
    if report.incomplete:
        return 1
    _search_and_evidence(project, args.question)  # no LLM: printed before one is started or waited for
    if "ask" not in project.pipelines or "llm" not in project.spec.resources:
        return 0
    with _packaged_llms(project, args.start_llm, required=False) as servers:
        try:
            return _generated_answer(project, args.question)
        except Exception:
            dead = [server for server in servers if server.exited() is not None]
            if not dead:
                raise
            for server in dead:  # the cause, in one line with its log's tail (not the client's traceback)
                print(f"error: {server.death()}", file=sys.stderr)
            return 1


def _search_and_evidence(project, question: str) -> None:
    """The search's top passages, then the evidence answer (``ask_extractive``: no LLM, about a second)."""
    from ragline.flows.run import engine

    print(f"\nsearch: {printable(question)}\n")
    passages = engine.run(project.pipeline("search"), {"query": question}, orchestrate=True)
    _print_passages([_plain(p) for p in passages[:5]], as_json=False)
    if "ask_extractive" in project.pipelines:
        answer = engine.run(project.pipeline("ask_extractive"), {"query": question}, orchestrate=True)
        print(printable(f"evidence: {answer.text}" + (f"  ({answer.reason})" if answer.refused else ""),
                        keep_newlines=True))
        _print_sources(answer)


def _generated_answer(project, question: str) -> int:
    """The `ask` pipeline's answer, once its LLM answers (evidence first: see pipelines.yaml)."""
    from ragline.flows.run import engine

    llm = project.resource("llm")
    if llm.health().status != "up":
        print(printable(f"(no LLM server at {llm.spec.base_url}: start one with `bash deploy/vllm/setup.sh && "
                        f"bash deploy/vllm/serve.sh`, then `.venv/bin/ragline ask \"...\"` answers with citations)"))
        return 0
    print(f"\nask: {printable(question)}\n")
    answer = engine.run(project.pipeline("ask"), {"query": question}, orchestrate=True)
    label = (f"  ({answer.reason})" if answer.refused else
             f"  (evidence answer{': ' + answer.reason if answer.reason else ''})" if answer.answered_by == "evidence"
             else "")
    print(printable(f"answer: {answer.text}{label}", keep_newlines=True))
    _print_sources(answer)
    return 0


def _print_sources(answer) -> None:
    for source in [] if answer.refused else answer.sources:
        page = f", {source.page}" if source.page else ""
        print(printable(f"  [{source.number}] {source.title or source.source_id} — {source.path}{page}"))


if __name__ == "__main__":
    sys.exit(main())
