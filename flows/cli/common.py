"""What every command shares: the defaults (pipelines file, API port, exit statuses), the project
and pipeline a command names, and the flags several commands take."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ragline.flows.errors import InputError
from ragline.flows.terminal import printable


# Only what every command needs is imported here (issue 24.5): `--help` and `validate` never load
# Prefect, Chroma, torch or a model; each command imports what it uses.
DEFAULT_FILE = "pipelines.yaml"  # compile.DEFAULT_FILE


API_PORT = 8080  # serve.DEFAULT_PORT: `ragline serve` and `ragline api`; the LLM has 8000


EXIT_SKIPPED = 3  # the run completed, but some documents could not be read and were skipped


SAMPLE_QUESTION = "What happens to a document that cannot be read?"  # one the packaged 135M model answers


def json_value(text: str) -> Any:
    """A JSON argument; a bad one is one line naming the problem (a value nested deeper than
    Python's parser goes raised a RecursionError with a traceback)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise argparse.ArgumentTypeError("the JSON is nested too deeply") from None
    except ValueError as exc:
        shown = text if len(text) <= 80 else text[:80] + "…"
        raise argparse.ArgumentTypeError(f"invalid JSON {printable(shown)!r}: {exc}") from None


def start_llm_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-start-llm", dest="start_llm", action="store_false",
                   help="do not start the packaged LLM (vLLM, deploy/vllm/) when the configured local endpoint "
                        "is down (also RAGLINE_START_LLM=0)")


def orchestration_flags(p: argparse.ArgumentParser, default: bool | None) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prefect", dest="orchestrate", action="store_true", help="run as a Prefect flow")
    group.add_argument("--no-prefect", dest="orchestrate", action="store_false", help="run in-process, no flow run")
    p.set_defaults(orchestrate=default)


def open_project(args, only: list[str] | None = None):
    """The pipelines file, with its indexes moved to ``--data-dir`` when one is given; ``only``:
    just these pipelines compiled (``load_project``)."""
    from ragline.flows.spec.compile import load_project

    project = load_project(args.file, only=only)
    return project.relocated(args.data_dir) if getattr(args, "data_dir", None) else project


def open_query_pipeline(args):
    """``--pipeline``, a query pipeline, compiled alone (the rest of the file is not checked: a cold
    query starts sooner); a name that is not a query pipeline of the file gets the error the whole
    file gives, listing the pipelines it has."""
    from ragline.flows.spec.model import UnknownPipeline, WrongPipelineKind

    try:
        return query_pipeline(open_project(args, only=[args.pipeline]), args.pipeline)
    except (UnknownPipeline, WrongPipelineKind):  # said with every pipeline of the file
        return query_pipeline(open_project(args), args.pipeline)


def query_pipeline(project, name: str):
    """A query pipeline by name; an ingestion pipeline is refused before anything runs (it would
    load its own paths and delete every other document from the index)."""
    from ragline.flows.spec.model import require_kinds

    require_kinds(project, query=name)
    return project.pipeline(name)


def collection_flag(p) -> None:
    p.add_argument("-c", "--collection", action="append", metavar="NAME",
                   help="search this collection of pipelines.yaml (repeatable; default: all of them)")


def job_collection_flag(p) -> None:
    p.add_argument("-c", "--collection", metavar="NAME",
                   help="a job that reads the index (tune, adapt) reads this collection's (default: the only one, "
                        "when pipelines.yaml declares collections)")


def plain(item: Any) -> Any:
    return item.model_dump(mode="json") if hasattr(item, "model_dump") else item


def set_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
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


def api_token(args) -> str | None:
    from ragline.flows import settings

    return args.token or settings.auth().api_token or None


def port_number(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: a port number, 1 to 65535")
    return port


def positive(kind):
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


def keep_days(value: str) -> float:
    days = float(value)
    if not days >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of days, 0 or more")
    return days
