"""Retrieval evaluation on BEIR-format datasets with pytrec_eval (trec_eval's own measures)."""
from __future__ import annotations

import csv
import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ragline.flows.run import engine
from ragline.flows.run.targets import load_step_id
from ragline.flows.spec.compile import Project
from ragline.flows.spec.model import require_kinds
from ragline.flows.contracts import Passage
from ragline.flows.files import write_atomic
from ragline.flows.spec.fingerprint import _resource_fingerprint
from ragline.flows.spec.overlay import apply_overlay

METRICS = ("ndcg@10", "recall@100", "mrr@10", "map@10", "p@10")
TOP, DEEP = 10, 100  # distinct documents the @10 metrics and Recall@100 are computed over
OWN_INDEX_MARKER = "feedback.json"  # `ragline feedback export --qrels`: judged against the project's own index
EVAL_RUNS = Path(".ragline") / "eval-runs"  # one small JSON record per `ragline eval` run (what `ragline report` plots)


@dataclass
class BeirDataset:
    name: str
    corpus: Path | None  # None: the judgements name documents of the project's own index (a feedback export)
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    # judged query ids that cannot be evaluated, with the reason (named in the result, never dropped silently)
    unevaluable: dict[str, str] = field(default_factory=dict)


def load_beir(folder: str | Path, split: str = "test") -> BeirDataset:
    """corpus.jsonl, queries.jsonl and qrels/<split>.tsv; only queries with judgements are kept, and a
    judged id without a usable query text is kept in ``unevaluable`` with the reason. A feedback
    export (``feedback.json`` beside them) has no corpus: its documents are the index's."""
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
                    queries[str(record["_id"])] = record.get("text")
    texts = {q: t for q, t in queries.items() if isinstance(t, str) and t.strip()}
    unevaluable = {q: _why_no_text(folder, q, queries) for q in qrels if q not in texts}
    return BeirDataset(folder.name, None if own_index else folder / "corpus.jsonl", texts, qrels, unevaluable)


def _why_no_text(folder: Path, qid: str, queries: dict[str, Any]) -> str:
    if qid not in queries:
        return f"no query with this _id in {folder / 'queries.jsonl'}"
    return f"its query in {folder / 'queries.jsonl'} has no text"


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


def score(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]],
          deep: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """Mean nDCG@10, Recall@100, MRR@10, MAP@10 and P@10 over the judged queries; Recall@100 on
    ``deep`` (the ranking retrieved to 100 distinct documents) when given, else on ``run``."""
    import pytrec_eval

    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map_cut.10", "P.10"})
    recall = pytrec_eval.RelevanceEvaluator(qrels, {"recall.100"})
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:10]) for q, docs in run.items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"})
    per_query = full.evaluate(run)
    per_query_recall = recall.evaluate(run if deep is None else deep)
    per_query_mrr = mrr.evaluate(top10)
    names = {"ndcg@10": "ndcg_cut_10", "map@10": "map_cut_10", "p@10": "P_10"}
    n = len(qrels)  # queries that retrieved nothing count as zero
    result = {m: sum(v[key] for v in per_query.values()) / n for m, key in names.items()}
    result["recall@100"] = sum(v["recall_100"] for v in per_query_recall.values()) / n
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
    sink = pipeline.sink
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
    load_step = load_step_id(indexer)
    started = time.perf_counter()
    report = engine.run(indexer.with_overrides({load_step: {"paths": [str(dataset.corpus.resolve())]}}),
                        orchestrate=orchestrate, progress=progress)
    indexed = time.perf_counter() - started
    return {**_run_and_score(project, dataset, pipeline, limit), "workspace": str(workspace),
            "index_seconds": round(indexed, 2), "index_summary": report.summary()}


def _run_and_score(project: Project, dataset: BeirDataset, pipeline: str, limit: int | None) -> dict[str, Any]:
    query_pipeline = project.pipeline(pipeline)
    judged = list(dataset.queries.items())
    queries = judged[:limit]
    skipped = {**dataset.unevaluable, **{q: f"past --limit {limit}" for q, _ in judged[len(queries):]}}
    deepened = Deepening(query_pipeline)
    started = time.perf_counter()
    runs = {qid: deepened.documents(text) for qid, text in queries}
    searched = time.perf_counter() - started
    run, deep = {q: top for q, (top, _) in runs.items()}, {q: ranked for q, (_, ranked) in runs.items()}
    qrels = {q: dataset.qrels[q] for q, _ in queries}
    overlay = project.overlay
    return {"dataset": dataset.name, "pipeline": pipeline, "queries": len(queries), **score(run, qrels, deep),
            "judged_queries": len(dataset.qrels), "not_evaluated": skipped,
            "documents_per_query": deepened.summary(deep),
            "overlay": str(overlay.path) if overlay is not None else None,
            "overlay_changes": list(overlay.changes) if overlay is not None else [],
            "query_ms_mean": round(1000 * searched / max(1, len(queries)), 2),
            "per_query": {"ndcg@10": ndcg_per_query(run, qrels)}}


class Deepening:
    """Runs a query pipeline deep enough for document-level metrics: a pipeline returns chunks, and
    a document spanning several fills several of its places, so its top 100 passages can be far
    fewer than 100 documents (Recall@100 over 57 documents on average on one collection). The
    pipeline as configured serves the @10 metrics (what `search` shows) unless it yields fewer than
    10 documents; for Recall@100 its retrieval depths (a retriever's ``k``, a ranker's ``top_k``)
    are multiplied until 100 distinct documents come back or the index (or a field's limit) runs out."""

    def __init__(self, pipeline: Any):
        self.pipeline = pipeline
        self._scaled: dict[int, Any] = {1: pipeline}
        self.deepest = 1

    def documents(self, text: str) -> tuple[dict[str, float], dict[str, float]]:
        """The query's top-10 run and its 100-document run (``to_run`` scores)."""
        scale, top, passages_before = 1, None, -1
        while True:
            passages = engine.run(self._at(scale), {"query": text}, orchestrate=False)
            ranked = to_run(passages, DEEP)
            top = ranked if top is None and len(ranked) >= TOP else top
            deeper = _next_scale(scale, len(ranked), len(passages))
            exhausted = len(passages) <= passages_before or deeper is None or (
                _depth_overrides(self.pipeline, deeper) == _depth_overrides(self.pipeline, scale))
            if len(ranked) >= DEEP or exhausted:
                return (top if top is not None else ranked), ranked
            scale, passages_before = deeper, len(passages)
            self.deepest = max(self.deepest, scale)

    def _at(self, scale: int) -> Any:
        """The pipeline with its depths multiplied by ``scale`` (compiled once per scale)."""
        if scale not in self._scaled:
            self._scaled[scale] = self.pipeline.with_overrides(_depth_overrides(self.pipeline, scale))
        return self._scaled[scale]

    def summary(self, deep: dict[str, dict[str, float]]) -> dict[str, Any]:
        """What Recall@100 was computed over, for the output."""
        short = sorted(q for q, docs in deep.items() if len(docs) < DEEP)
        return {"target": DEEP, "deepest_scale": self.deepest, "queries_short": len(short),
                "fewest": min((len(d) for d in deep.values()), default=0), "short_queries": short}


def _next_scale(scale: int, documents: int, passages: int) -> int | None:
    """The next depth multiplier: enough for 100 documents at the chunks-per-document seen so far."""
    if passages == 0:
        return None
    return scale * max(2, -(-DEEP * 5 // (4 * max(1, documents))))


def _depth_overrides(pipeline: Any, scale: int) -> dict[str, dict[str, int]]:
    """Each retriever's ``k`` and each ranker's ``top_k`` times ``scale``, within the field's limit."""
    overrides: dict[str, dict[str, int]] = {}
    for step in pipeline.steps:
        name = {"rankings": "k", "passages": "top_k"}.get(step.stage.produces)
        value = getattr(step.params, name, None) if name else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            overrides[step.id] = {name: min(value * scale, _limit(step.stage.params, name))}
    return overrides


def _limit(params: type, name: str) -> int:
    """A depth field's upper bound (``le``), or a generous one when it has none."""
    for rule in params.model_fields[name].metadata:
        if getattr(rule, "le", None) is not None:
            return int(rule.le)
    return 10_000


def record_run(data_dir: Path, result: dict[str, Any], split: str) -> Path:
    """Keep one evaluation's figures (metrics, dataset, split, pipeline, overlay) under the data dir's
    ``EVAL_RUNS``, so `ragline report` can show retrieval quality run after run."""
    moment = datetime.now(timezone.utc)
    record = {"time": moment.isoformat(timespec="seconds").replace("+00:00", "Z"), "split": split,
              **{k: v for k, v in result.items() if k not in ("workspace", "per_query")}}
    name = f"{moment.strftime('%Y%m%dT%H%M%S%fZ')}-{result.get('dataset', 'dataset')}.json"
    return write_atomic(Path(data_dir) / EVAL_RUNS / name.replace("/", "_"), json.dumps(record, indent=1))
