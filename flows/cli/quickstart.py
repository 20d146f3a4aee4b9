"""`ragline quickstart`: index a folder, search it and answer the sample question with citations, on
the embedded defaults."""
from __future__ import annotations

import sys

from ragline.flows.cli.common import SAMPLE_QUESTION, open_project, plain, start_llm_flag
from ragline.flows.cli.ingest import index_paths
from ragline.flows.cli.llm import packaged_llms
from ragline.flows.cli.query import print_passages
from ragline.flows.terminal import printable


def register(command) -> None:
    """This module's commands and their flags (``command`` adds a subparser with the common ones)."""
    p = command("quickstart", quickstart, "Index a folder (default: the bundled sample), search it and answer "
                                           "a question with citations.")
    p.add_argument("folder", nargs="?", help="folder to index (default: the pipeline's own paths)")
    p.add_argument("question", nargs="?", default=SAMPLE_QUESTION)
    p.add_argument("-c", "--collection", metavar="NAME",
                   help="with collections declared in pipelines.yaml: the one to index (default: the only one)")
    start_llm_flag(p)


def quickstart(args) -> int:
    from ragline.flows.spec.collections import for_collection

    index = for_collection(open_project(args), "index", args.collection)  # with collections: index@NAME
    project, report = index_paths(args, [args.folder] if args.folder else [], index, orchestrate=True)
    if report.incomplete:
        return 1
    _search_and_evidence(project, args.question)  # no LLM: printed before one is started or waited for
    if "ask" not in project.pipelines or "llm" not in project.spec.resources:
        return 0
    with packaged_llms(project, args.start_llm, required=False) as servers:
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
    print_passages([plain(p) for p in passages[:5]], as_json=False)
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
