"""Retrieval evaluation on BEIR-format datasets with pytrec_eval (trec_eval's own measures)."""
from __future__ import annotations

import csv
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ragline.flows.run import engine
from ragline.flows.spec.compile import Project
from ragline.flows.contracts import Passage
from ragline.flows.files import write_atomic
from ragline.flows.spec.fingerprint import _resource_fingerprint
from ragline.flows.spec.overlay import apply_overlay

METRICS = ("ndcg@10", "recall@100", "mrr@10", "map@10", "p@10")
OWN_INDEX_MARKER = "feedback.json"  # `ragline feedback export --qrels`: judged against the project's own index
EVAL_RUNS = Path(".ragline") / "eval-runs"  # one small JSON record per `ragline eval` run (what `ragline report` plots)


@dataclass
class BeirDataset:
    name: str
    corpus: Path | None  # None: the judgements name documents of the project's own index (a feedback export)
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


def load_beir(folder: str | Path, split: str = "test") -> BeirDataset:
    """corpus.jsonl, queries.jsonl and qrels/<split>.tsv; only queries with judgements are kept.
    A feedback export (``feedback.json`` beside them) has no corpus: its documents are the index's."""
    folder = Path(folder)
    own_index = (folder / OWN_INDEX_MARKER).is_file() and not (folder / "corpus.jsonl").exists()
    for needed in ("queries.jsonl", f"qrels/{split}.tsv") if own_index else ("corpus.jsonl", "queries.jsonl",
                                                                           f"qrels/{split}.tsv"):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder / needed}: missing (a BEIR dataset needs corpus.jsonl, "
                                    f"queries.jsonl and qrels/{split}.tsv)")
    qrels: dict[str, dict[str, int]] = {}
    with open(folder / "qrels" / f"{split}.tsv", newline="", encoding="utf-8") as handle:
        for line_no, row in enumerate(csv.reader(handle, delimiter="\t"), start=1):
            if line_no == 1 and row and not row[-1].strip().lstrip("-").isdigit():
                continue  # header
            if len(row) < 3:
                raise ValueError(f"{folder}/qrels/{split}.tsv:{line_no}: expected query-id, corpus-id, score")
            qrels.setdefault(row[0], {})[row[1]] = int(row[2])
    queries: dict[str, str] = {}
    with open(folder / "queries.jsonl", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                record = json.loads(line)
                if str(record["_id"]) in qrels:
                    queries[str(record["_id"])] = record["text"]
    return BeirDataset(folder.name, None if own_index else folder / "corpus.jsonl", queries, qrels)


def document_id(passage: Passage) -> str:
    """BEIR doc ids are the JSONL record ids the loader keeps as ``doc_id``."""
    return str(passage.metadata.get("doc_id") or passage.source_id)


def to_run(passages: list[Passage], depth: int = 100) -> dict[str, float]:
    """Document scores that keep the pipeline's order (a document ranks at its best chunk)."""
    run: dict[str, float] = {}
    for passage in passages:
        doc = document_id(passage)
        if doc not in run:
            run[doc] = float(depth - len(run))
            if len(run) == depth:
                break
    return run


def score(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> dict[str, float]:
    """Mean nDCG@10, Recall@100, MRR@10, MAP@10 and P@10 over the judged queries."""
    import pytrec_eval

    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100", "map_cut.10", "P.10"})
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:10]) for q, docs in run.items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"})
    per_query = full.evaluate(run)
    per_query_mrr = mrr.evaluate(top10)
    names = {"ndcg@10": "ndcg_cut_10", "recall@100": "recall_100", "map@10": "map_cut_10", "p@10": "P_10"}
    n = len(qrels)  # queries that retrieved nothing count as zero
    result = {m: sum(v[key] for v in per_query.values()) / n for m, key in names.items()}
    result["mrr@10"] = sum(v["recip_rank"] for v in per_query_mrr.values()) / n
    return {m: round(result[m], 5) for m in METRICS}


def ndcg_per_query(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> list[float]:
    """nDCG@10 of each judged query, in ``qrels`` order (0 for one that retrieved nothing): the
    spread the dashboard plots."""
    import pytrec_eval

    scored = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    return [round(scored.get(q, {}).get("ndcg_cut_10", 0.0), 4) for q in qrels]


def eval_workspace(project: Project, dataset: BeirDataset, index_pipeline: str) -> Path:
    """A private index per dataset and per setting that shapes the stored chunks and vectors
    (loading, chunking, embedding, the store), so evaluation never touches the user's index and two
    configurations (say torch and ONNX embeddings) keep their own indexes. Retrieval-only settings
    (BM25's k1, b and stemmer, fusion, depths: what `ragline tune` sets) share one workspace, as
    they share one index outside eval: the ingestion's finalize rebuilds BM25 alone for them."""

    pipeline = project.pipeline(index_pipeline)
    sink = next((s for s in pipeline.steps if s.stage.plan is not None), None)
    middle = [s for s in pipeline.steps if s.stage.inputs and s is not sink]
    stored = {} if sink is None else {
        role: _resource_fingerprint(project.spec.resources[name]) for role, name in sorted(sink.resources.items())
        if project.spec.resources[name].type != "bm25"}
    settings = [pipeline.fingerprint(middle), stored]
    key = hashlib.sha256(json.dumps([str(dataset.corpus.resolve()), index_pipeline, settings],
                                    sort_keys=True, default=str).encode()).hexdigest()[:10]
    return project.base_dir / ".ragline" / "eval" / f"{dataset.name}-{key}"


def in_workspace(project: Project, workspace: Path) -> Project:
    """The project moved into ``workspace`` with the overlay the user's own commands apply (the one
    beside their data, not one in the workspace): eval measures what `search` would run."""

    if project.untuned is None:
        return project.relocated(workspace)
    applied = project.overlay.path if project.overlay is not None else None
    return apply_overlay(project.untuned.relocated(workspace), path=applied)


def require_kinds(project: Project, **names: str | None) -> None:
    """Refuse, before anything runs, a pipeline of the wrong kind (an ingestion pipeline given as the
    query pipeline would load its own paths and delete everything else from the index)."""
    for kind, name in names.items():
        if name is not None and project.pipeline(name).kind != kind:
            fitting = ", ".join(n for n, p in project.pipelines.items() if p.kind == kind) or "none"
            raise ValueError(f"pipeline '{name}' is {_article(project.pipeline(name).kind)} pipeline; this needs "
                             f"{_article(kind)} pipeline ({kind} pipelines in {project.path.name}: {fitting})")


def _article(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def evaluate(project: Project, dataset: BeirDataset, pipeline: str = "search", index_pipeline: str = "index",
             orchestrate: bool = False, progress: Any = None, limit: int | None = None) -> dict[str, Any]:
    """Index the corpus (incrementally) in a private workspace, run every query, score the run. A
    dataset without a corpus (a feedback export) judges the project's own index: nothing is indexed."""
    require_kinds(project, query=pipeline, ingestion=index_pipeline)
    if dataset.corpus is None:
        return {**_run_and_score(project, dataset, pipeline, limit), "workspace": None, "index_seconds": 0.0,
                "index_summary": "the project's own index (not re-indexed)"}
    workspace = eval_workspace(project, dataset, index_pipeline)
    project = in_workspace(project, workspace)
    indexer = project.pipeline(index_pipeline)
    load_step = next(s.id for s in indexer.steps if s.stage.name == "load")
    started = time.perf_counter()
    report = engine.run(indexer.with_overrides({load_step: {"paths": [str(dataset.corpus.resolve())]}}),
                        orchestrate=orchestrate, progress=progress)
    indexed = time.perf_counter() - started
    return {**_run_and_score(project, dataset, pipeline, limit), "workspace": str(workspace),
            "index_seconds": round(indexed, 2), "index_summary": report.summary()}


def _run_and_score(project: Project, dataset: BeirDataset, pipeline: str, limit: int | None) -> dict[str, Any]:
    query_pipeline = project.pipeline(pipeline)
    queries = list(dataset.queries.items())[:limit]
    started = time.perf_counter()
    run = {qid: to_run(engine.run(query_pipeline, {"query": text}, orchestrate=False)) for qid, text in queries}
    searched = time.perf_counter() - started
    qrels = {q: dataset.qrels[q] for q, _ in queries}
    overlay = project.overlay
    return {"dataset": dataset.name, "pipeline": pipeline, "queries": len(queries), **score(run, qrels),
            "overlay": str(overlay.path) if overlay is not None else None,
            "overlay_changes": list(overlay.changes) if overlay is not None else [],
            "query_ms_mean": round(1000 * searched / max(1, len(queries)), 2),
            "per_query": {"ndcg@10": ndcg_per_query(run, qrels)}}


def record_run(data_dir: Path, result: dict[str, Any], split: str) -> Path:
    """Keep one evaluation's figures (metrics, dataset, split, pipeline, overlay) under the data dir's
    ``EVAL_RUNS``, so `ragline report` can show retrieval quality run after run."""
    moment = datetime.now(timezone.utc)
    record = {"time": moment.isoformat(timespec="seconds").replace("+00:00", "Z"), "split": split,
              **{k: v for k, v in result.items() if k not in ("workspace", "per_query")}}
    name = f"{moment.strftime('%Y%m%dT%H%M%S%fZ')}-{result.get('dataset', 'dataset')}.json"
    return write_atomic(Path(data_dir) / EVAL_RUNS / name.replace("/", "_"), json.dumps(record, indent=1))
