"""`ragline eval`, `tune`, `feedback` and `report`: retrieval and answers measured (BEIR, RGB, a test
set generated from the index, the LLM judge), hybrid retrieval tuned without labels, served feedback
exported, the served queries reported as one page."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ragline.flows.cli.common import (
    job_collection_flag, open_project, orchestration_flags, set_overrides, start_llm_flag)
from ragline.flows.cli.llm import packaged_llms
from ragline.flows.errors import InputError
from ragline.flows.terminal import printable


def register(command) -> None:
    """This module's commands and their flags (``command`` adds a subparser with the common ones)."""
    p = command("eval", evaluate, "Evaluate a query pipeline: retrieval on a BEIR folder, answers on an RGB file, or "
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
    orchestration_flags(p, default=None)  # None: a flow run (its report on the dashboard) when an API is configured
    start_llm_flag(p)

    p = command("tune", tune, "Tune hybrid retrieval on pseudo-queries made from the index (no labels) and write "
                               "the choice as an overlay that search and ask use (pipelines.yaml is never written).")
    p.add_argument("-p", "--pipeline", default="tune")
    p.add_argument("--set", action="append", default=[], metavar="STEP.PARAM=JSON",
                   help="override a step parameter, e.g. pairs.n=500 or tune.min_gain=0.01")
    p.add_argument("--dry-run", action="store_true", help="report the candidates, write nothing")
    job_collection_flag(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    orchestration_flags(p, default=True)

    register_feedback(command)

    p = command("report", report, "Write one self-contained HTML page of the served queries (query log), "
                                   "feedback, eval runs and ingestion: latency per step, refusals, ratings over time.")
    p.add_argument("--out", type=Path, default=Path("report.html"), help="the page (default: report.html)")
    p.add_argument("--since", default="7d", help="the period shown: 30m, 12h, 7d, 4w or all (default 7d)")


def evaluate(args) -> int:
    from ragline.flows.evaluation.retrieval import METRICS, evaluate, load_beir, record_run
    from ragline.flows.run.progress import IngestProgress
    from ragline.flows.spec.collections import for_collection

    project = open_project(args)
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
    with packaged_llms(project, args.start_llm, [args.answer_pipeline]):
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
    with packaged_llms(project, args.start_llm, [args.answer_pipeline] if args.judge else [pipeline]):
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
    with packaged_llms(project, args.start_llm, [args.pipeline or "ask"]):
        result = _evaluation(args, "answers", {"dataset": Path(args.dataset).name, "pipeline": args.pipeline or "ask"},
                             lambda: evaluate_answers(project, args.dataset, args.pipeline or "ask",
                                                      limit=args.limit, orchestrate=bool(args.orchestrate),
                                                      index_pipeline=index_pipeline))
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


def tune(args) -> int:
    from ragline.flows.run import engine
    from ragline.flows.contracts import TuneReport
    from ragline.flows.spec.model import require_kinds
    from ragline.flows.spec.collections import for_collection
    from ragline.tasks.jobs.tune_retrieval import summary

    project = open_project(args)
    name = for_collection(project, args.pipeline, args.collection)
    require_kinds(project, job=name)
    pipeline = project.pipeline(name)
    overrides = set_overrides(args.set)
    if args.dry_run:
        for step in pipeline.steps:
            if "write" in step.stage.params.model_fields:
                overrides.setdefault(step.id, {})["write"] = False
    result = engine.run(pipeline.with_overrides(overrides), orchestrate=args.orchestrate)
    if not isinstance(result, TuneReport):
        raise InputError(f"pipeline '{args.pipeline}' does not end in a tune_retrieval step")
    print(json.dumps(result.model_dump(mode="json")) if args.json else printable(summary(result), keep_newlines=True))
    return 0


def register_feedback(command) -> None:
    p = command("feedback", feedback, "Feedback given to served answers (POST /v1/feedback).")
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


def feedback(args) -> int:
    from ragline.flows.files import write_atomic
    from ragline.flows.serve.routers.feedback import export_qrels, joined
    from ragline.flows.serve.layout import data_dir_of

    data_dir = data_dir_of(open_project(args))
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


def report(args) -> int:
    from ragline.flows.files import write_atomic
    from ragline.flows.serve.layout import data_dir_of
    from ragline.flows.serve.report import build, ingestion_rows, parse_since

    since = parse_since(args.since)
    project = open_project(args)
    write_atomic(args.out, build(data_dir_of(project), since, ingestion_rows(project)))
    print(printable(f"{args.out}: report of {data_dir_of(project)} (since {args.since})"), file=sys.stderr)
    return 0
