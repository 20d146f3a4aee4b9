"""The `ragline` command: one module per command group (``ingest``: validate, index, run, check;
``query``: search, ask; ``measure``: eval, tune, feedback, report; ``serving``: api, mcp, serve,
keys, prefect; ``quickstart``), what they share in ``common`` and the LLM endpoints in ``llm``.
Each command imports what it runs (issue 24.5): `--help` and `validate` never load Prefect, Chroma,
torch or a model."""
from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path

from ragline.flows.cli import ingest, measure, query, quickstart, serving
from ragline.flows.cli.common import API_PORT, DEFAULT_FILE, EXIT_SKIPPED, SAMPLE_QUESTION

__all__ = ["main", "API_PORT", "DEFAULT_FILE", "EXIT_SKIPPED", "SAMPLE_QUESTION"]
from ragline.flows.errors import RaglineError
from ragline.flows.terminal import configure_terminal, printable


def main(argv: list[str] | None = None) -> int:
    return _main(_parser().parse_args(argv))


def run() -> None:
    """The `ragline` console script. After a query command (search, ask: they write nothing) the
    process closes its resources (a store's client releases its files: Milvus Lite's lock) and ends
    without the interpreter's teardown, which freed every module and object one by one: ~0.15 s of
    a cold `ragline search` (issue 38). By then Python has joined the non-daemon threads and run
    every other atexit handler (logging's flush, the reading copies' removal): this one is
    registered first, so it runs last."""
    ended: list[int] = []
    atexit.register(_exit_without_teardown, ended)
    args = _parser().parse_args()
    code = _main(args)
    if args.handler in (query.search, query.ask):
        ended.append(code)
    sys.exit(code)


def _exit_without_teardown(ended: list[int]) -> None:
    if not ended:  # an error, or another command: the usual exit
        return
    if "ragline.flows.resources" in sys.modules:
        from ragline.flows.resources import close_resources

        close_resources()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ended[0])


def _main(args: argparse.Namespace) -> int:
    # Prefect's per-task lines stay in the dashboard; the terminal shows ragline's progress and, on
    # failure, one line (-v: every INFO record and the tracebacks); a slow or hung LLM is said so
    waits_for_llm = args.handler in (query.ask, quickstart.quickstart, measure.evaluate, ingest.run)
    configure_terminal(args.verbose, ("ragline.llm",) if waits_for_llm else (), prefect=args.handler is serving.serve)
    if not args.verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING" if args.handler is serving.serve else
                              "CRITICAL")
    if args.allow_module:
        from ragline.flows.spec.registry import set_allowed_modules

        set_allowed_modules(args.allow_module)
    if getattr(args, "no_tuned", False):
        from ragline.flows import settings

        settings.export("tuned", "0")  # this process and the ones it starts (flow runs, workers)
    if args.handler is serving.serve:  # it supervises its runner, API and signals itself
        return _dispatch(args)
    if args.handler in (query.search, query.ask):
        try:
            served = query.answer_by_api(args)
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
    orchestrated = getattr(args, "orchestrate", False) or args.handler is quickstart.quickstart
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

    ingest.register(command)
    query.register(command)
    measure.register(command)
    serving.register(command)
    quickstart.register(command)
    return parser


if __name__ == "__main__":
    run()
