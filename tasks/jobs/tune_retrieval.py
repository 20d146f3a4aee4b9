"""Self-tuning retrieval: score candidate settings on pseudo-queries and write the best as an overlay.

The tuner finds the query pipelines that fuse one dense and one BM25 retriever over this step's
index (``search`` and ``ask`` in the shipped file), ranks every pseudo-query once per retriever
(dense from Chroma, BM25 for each candidate k1, b and stemmer on an in-memory index over the
corpus text, never the published one), then scores every fusion candidate on those cached
rankings, which is cheap: reciprocal rank fusion with its constant k and the dense/BM25 weight,
min-max score combination with the same weight, the retrievers' depth. A weight of 0 or 1 is
BM25 or dense alone, so the best candidate is never below the better single retriever on the
pseudo-queries. Every candidate is scored exactly as ``fuse`` ranks passages and ``eval`` ranks
documents (a document at its best chunk), with the source document as the one relevant item.

Bias control: an inverse-cloze or title query is cut out of its document; the source is scored
without that text (dense: its chunks re-embedded without it; BM25: the in-memory index holds
them without it), so a query never finds its document by its own words.

Answerability gates (``answerable`` steps of the tuned pipelines) get their thresholds from the
same pseudo-queries, which are answerable by construction: ``min_similarity`` is the similarity
that ``gate_keep`` of them clear with their own source. With ``gate_llm_pairs``, the gate's own LLM
check is asked, as the gate asks it, about each pseudo-query twice: with its source (without the
cut) among the closest chunks of other documents (answerable), and with those chunks only (on the
topic, not answering: unanswerable, like RGB's negatives). ``min_probability`` is the P(answerable)
that ``gate_keep`` of the answerable ones clear, and it is set only if it refuses at least
``gate_llm_min_refusal`` of the unanswerable ones: a model that cannot tell them apart would cost a
call per question for nothing, so its check stays off (the report says why). No label is read.

Query expansion (``expand_prf``, ``expand_terms`` mode corpus) on the query path of a tuned
pipeline's BM25 retriever, opt-in there with ``enabled: false``: the stages' own code is replayed on
an in-memory BM25 index of the chunks as the tuner scores them (each source without its cut, so
feedback cannot re-find the text a query was cut from), for a grid of settings, on the chosen
setting and on the best fused one with the same BM25; a step is turned on only for a significant
gain over the chosen setting without it (the same paired bootstrap). ``dense: true`` and mode llm
are not replayed: such steps stay as the file has them.

Query2doc (a ``rewrite`` step in mode hyde with ``keyword: true`` on the BM25 side) is decided the
same way when the tuner has an LLM: the step's own pseudo-documents for a bounded, evenly spread
sample of ``query2doc_pairs`` pseudo-queries (one call each), appended to the BM25 query for each
``query_repeats`` tried (a step with ``samples`` > 1: its samples, one call of ``n`` completions
each, and every ``query2doc_agreement`` tried on them for free; ``query2doc_samples`` also tries
self-consistency on a step of one sample, for one more call per pseudo-query). The
``expand_context`` window is chosen by a label-free criterion, since it changes the text of hits
and not their order: how often the expanded top passages hold the chunk a pseudo-query was cut
from, against the tokens they show (the smallest window within a margin of the best).

The choice goes into the overlay beside the pipelines file (``flows.overlay``), which every
command applies on top of it; pipelines.yaml itself is never written.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
import pytrec_eval
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Candidate, GateCalibration, PipelineKind, PseudoQuery, TuneReport
from ragline.flows.spec.registry import stage
from ragline.flows.resources.stores.bm25 import LegacyVersion, in_memory, ranked, tokenize
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.stores.state import IndexState
from ragline.tasks.generate.answerable import kept_floor, max_cosine, probability
from ragline.tasks.rewrite.expand_prf import with_feedback
from ragline.tasks.refine.expand_context import grow, token_counts
from ragline.tasks.rewrite.expand_terms import corpus_terms, with_terms
from ragline.tasks.rewrite.rewrite import SAMPLE_TEMPERATURE, agreed_terms, query2doc
from ragline.tasks.retrieve.fuse import fused_order, fused_scores
from ragline.tasks.ingest.pseudo_queries import without
from ragline.tasks.retrieve.sparse import LEASE_STALE_SECONDS
from ragline.flows.contracts import ContextDocument, Passage, Query
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.resources.stores.protocols import DenseStore, SparseIndex

Metric = Literal["ndcg@10", "mrr@10", "recall@100"]
METRICS = ("ndcg@10", "mrr@10", "recall@100")
QUERY_BATCH = 32  # query vectors per Chroma call
GATE_DOCUMENTS = 3  # references per LLM calibration question: its source and the closest other documents


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipelines: list[str] = Field(default_factory=list,
                                 description="query pipelines to tune; empty: every one that fuses a dense and a "
                                             "BM25 retriever over this step's index")
    metric: Metric = Field("ndcg@10", description="what the choice maximises on the pseudo-queries")
    methods: list[Literal["rrf", "score"]] = Field(["rrf", "score"], min_length=1, description="fusion methods")
    rrf_k: list[int] = Field([5, 10, 20, 40, 60, 100], min_length=1, description="RRF constants tried")
    dense_weights: list[float] = Field([0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0], min_length=1,
                                       description="dense share of the fusion weight (BM25 gets the rest); "
                                                   "0: BM25 alone, 1: dense alone")
    depths: list[int] = Field([50, 100], min_length=1, description="passages per retriever tried (k)")
    bm25_k1: list[float] = Field([0.9, 1.2, 1.5], min_length=1, description="BM25 k1 values tried")
    bm25_b: list[float] = Field([0.5, 0.75, 0.9], min_length=1, description="BM25 b values tried")
    bm25_stemmer: list[Literal["english", "none"]] = Field(["english", "none"], min_length=1,
                                                           description="stemmers tried")
    bm25_fused: int = Field(3, ge=1, le=50, description="best BM25 variants (alone) that enter fusion, plus the "
                                                         "current one")
    gate_keep: float | None = Field(0.98, gt=0.5, lt=1.0,
                                    description="answerability gates get the similarity floor that this share of "
                                                "pseudo-queries clears with their own source; null: leave gates "
                                                "as the file sets them")
    gate_llm_pairs: int = Field(0, ge=0, le=2000,
                                description="pseudo-queries put through the gates' LLM check (one 1-token call "
                                            "each) to set min_probability to what gate_keep of them clear; 0: "
                                            "leave min_probability as the file sets it (it needs a model that "
                                            "reads: the packaged ones do not)")
    gate_llm_min_refusal: float = Field(0.25, ge=0, le=1,
                                        description="set min_probability only if it refuses at least this share "
                                                    "of the pseudo-queries asked without their source")
    min_gain: float = Field(0.0, ge=0.0, le=1.0, description="keep pipelines.yaml's setting unless a candidate "
                                                              "beats it by more than this on the metric")
    confidence: float = Field(0.95, gt=0.5, lt=1.0,
                              description="leave the best single retriever only for a fused candidate whose "
                                          "paired-bootstrap interval of the gain over it, at this confidence and "
                                          "simultaneous over all the fused candidates, is above 0; an opt-in step "
                                          "(expansions, query2doc) is turned on only where an interval "
                                          "simultaneous over all its settings tried is")
    bootstrap: int = Field(1000, ge=100, le=100_000, description="bootstrap resamples of the pseudo-queries")
    seed: int = Field(0, description="bootstrap seed: the same pairs give the same choice")
    recall_margin: float = Field(0.01, ge=0.0, le=1.0,
                                 description="recall guard: a candidate that loses more Recall@100 than this to "
                                             "another one ...")
    recall_trade: float = Field(0.005, ge=0.0, le=1.0,
                                description="... is never chosen for a gain of this much of the metric or less")
    expansions: bool = Field(True, description="decide the expand_prf / expand_terms steps (mode corpus, dense: "
                                                "false) that feed a tuned pipeline's BM25 retriever: on, with the "
                                                "best settings below, only for a significant gain over off")
    prf_docs: list[int] = Field([5, 10], min_length=1, description="expand_prf: feedback passages tried")
    prf_terms: list[int] = Field([5, 10, 20], min_length=1, description="expand_prf: feedback terms tried")
    prf_query_weight: list[float] = Field([0.5, 0.7, 0.9], min_length=1,
                                          description="expand_prf: the request's own share tried")
    related_terms: list[int] = Field([5, 10, 20, 30], min_length=1, description="expand_terms: terms tried")
    related_weight: list[float] = Field([0.1, 0.2, 0.3, 0.5], min_length=1,
                                        description="expand_terms: the added terms' share tried")
    query2doc_pairs: int = Field(100, ge=0, le=2000,
                                 description="query2doc (rewrite mode hyde, keyword: true, on the BM25 side of a tuned "
                                             "pipeline): pseudo-queries whose pseudo-document the LLM writes, one "
                                             "call each, to decide it on or off; 0: leave such steps as the file "
                                             "has them")
    query2doc_repeats: list[Annotated[int, Field(ge=1, le=20)]] = Field([1, 3, 5], min_length=1,
                                                                        description="query2doc: query_repeats tried")
    query2doc_agreement: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        [0.4, 0.6, 0.8], min_length=1, description="query2doc with samples > 1 (self-consistency): min_agreement "
                                                   "tried, on the same samples (no further LLM call)")
    query2doc_samples: int = Field(0, ge=0, le=16, description="also try query2doc with self-consistency on a step "
                                                               "of one sample: this many samples (one more LLM call "
                                                               "per pseudo-query); 0 or 1: only the step's own")
    context: bool = Field(True, description="decide the expand_context steps of tuned pipelines: the smallest window "
                                             "whose top passages hold the pseudo-query's source chunk within "
                                             "context_margin of the best window")
    context_neighbours: list[Annotated[int, Field(ge=0, le=10_000)]] = Field(
        [0, 1, 2, 4], min_length=1, description="expand_context: neighbours tried (0: no expansion)")
    context_tokens: list[Annotated[int, Field(ge=16, le=32_768)]] = Field(
        [256, 512, 1024], min_length=1, description="expand_context: max_tokens tried")
    context_margin: float = Field(0.02, ge=0.0, le=1.0,
                                  description="expand_context: the smallest window (tokens shown) whose hold rate is "
                                              "within this of the best window's")
    context_pairs: int = Field(300, ge=1, le=5000, description="expand_context: pseudo-queries replayed (those "
                                                                 "cut from a chunk)")
    max_seconds: float | None = Field(600.0, gt=0, description="stop trying BM25 variants after this long")
    write: bool = Field(True, description="write the overlay (false: report only)")
    overlay: str | None = Field(None, description="overlay file; default: <pipelines file stem>.tuned.yaml beside "
                                                  "the data (the pipelines file's folder, or --data-dir)")


@dataclass(frozen=True)
class Target:
    """A query pipeline the tuner sets: its fuse step and the two retrievers feeding it."""

    pipeline: str
    fuse: str
    dense: str
    sparse: str
    sparse_resource: str
    gate: str | None = None  # its answerability step, whose similarity floor the tuner sets


@dataclass
class Rankings:
    """Per query, each retriever's ranking at full depth: (chunk index, score) pairs, best first."""

    docs: np.ndarray  # the document index of every chunk index
    dense: list[list[tuple[int, float]]]
    sparse: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)  # by BM25 variant name
    # per query, the cosine similarity of its source's closest chunk (without the cut): what an
    # answerability gate sees when the question is answerable (None: no source)
    source_similarity: list[float | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # every chunk's text as BM25 scored it (sources without the cut)
    tokens: dict[str, list[list[str]]] = field(default_factory=dict)  # those texts' BM25 terms, by stemmer


def reads_roles(params: Params) -> dict[str, tuple[str, str] | None]:
    """The LLM calibrates the gates' ``min_probability`` (``gate_llm_pairs`` > 0 with ``gate_keep``: needed),
    and writes query2doc's pseudo-documents (``expansions`` with ``query2doc_pairs`` > 0: where the file
    has one; without it those steps are left undecided, as the report says); nothing otherwise."""
    if params.gate_llm_pairs and params.gate_keep is not None:
        return {"llm": ("gate_llm_pairs", f"gate_llm_pairs: {params.gate_llm_pairs} asks the LLM about that many "
                                          f"pseudo-queries")}
    if params.expansions and params.query2doc_pairs:
        return {"llm": None}
    return {}


@stage("tune_retrieval", params=Params, produces="tuning", kind="job",
       uses={"store": ("chroma", "milvus"), "embedder": ("sentence_transformer",), "sparse": ("bm25", "milvus"),
             "state": ("index_state",), "llm": ("openai_compatible",)}, reads_roles=reads_roles)
def tune_retrieval(pairs: list[PseudoQuery], params: Params, ctx: StepContext, store: DenseStore,
                   embedder: Embedder, sparse: SparseIndex, state: IndexState,
                   llm: LLMClient | None = None) -> TuneReport:
    """Score fusion and BM25 settings on pseudo-queries; write the best as the tuned overlay."""
    started = time.perf_counter()
    project = ctx.project
    if project is None:
        raise RuntimeError("tune_retrieval needs the compiled project (run it through the engine)")
    step = project.pipeline(ctx.pipeline).step(ctx.step_id)
    plain = project.untuned or project  # pipelines.yaml as written: the setting to beat, whatever was tuned before
    targets = find_targets(plain, params.pipelines, step.resources)
    if not pairs:
        raise ValueError("no pseudo-queries to tune on (is the index empty?)")
    timings: dict[str, float] = {}
    bm25_spec = plain.spec.resources[targets[0].sparse_resource]
    if getattr(bm25_spec, "analyzer", "ragline") != "ragline":  # a milvus resource splitting text itself
        raise ValueError(f"tune scores BM25 settings on ragline's terms; the milvus resource "
                         f"'{targets[0].sparse_resource}' splits text with Milvus's {bm25_spec.analyzer!r} analyzer: "
                         f"set `analyzer: ragline` (the default) to tune it")
    base = current_setting(plain, targets[0], bm25_spec)
    clock = time.perf_counter()
    generation, rows = consistent_read(state, ctx)
    corpus = Corpus.from_rows(rows)
    pairs = [p for p in pairs if p.source_id in corpus.doc_index]  # a document deleted since: left out
    timings["corpus"] = time.perf_counter() - clock
    deadline = None if params.max_seconds is None else time.monotonic() + params.max_seconds
    cache, exhausted = rank_pairs(pairs, corpus, store, embedder, bm25_spec, params, base, deadline, ctx, timings)
    relevant = [{corpus.doc_index[p.source_id]} for p in pairs]
    top_k = plain.pipeline(targets[0].pipeline).step(targets[0].fuse).params.top_k
    clock = time.perf_counter()
    per_query: dict[str, np.ndarray] = {}
    candidates = grid(params, base, cache, relevant, top_k, per_query)
    by_name = {c.name: c for c in candidates}
    baseline = by_name.get(setting_name(base)) or score_settings([base], cache, relevant, top_k, per_query)[0]
    decision = choose(candidates, baseline, params, per_query)
    chosen, reason = decision.chosen, decision.reason
    timings["scoring"] = time.perf_counter() - clock
    floor = kept_floor(gate_similarities(pairs, cache.source_similarity), params.gate_keep)
    gate = next((t for t in targets if t.gate), None)
    calibration = None
    if params.gate_llm_pairs and params.gate_keep is not None and gate is not None:
        if llm is None:
            raise ValueError("gate_llm_pairs needs an openai_compatible resource (llm) in the file, or set it to 0")
        clock = time.perf_counter()
        calibration = calibrate_gate(gate_probabilities(pairs, corpus, cache, llm, plain, gate, params.gate_llm_pairs),
                                     params.gate_keep, params.gate_llm_min_refusal)
        timings["gate_llm"] = time.perf_counter() - clock
    p_floor = calibration.threshold if calibration is not None and calibration.enabled else None
    expansions = find_expansions(plain, targets) if params.expansions else []
    decisions: dict[str, dict[str, Any]] = {}
    if expansions:
        clock = time.perf_counter()
        fused = next((c for c in candidates if not is_single(c) and c.setting["bm25"] == chosen.setting["bm25"]), None)
        decisions = decide_expansions(expansions, plain, pairs, corpus, cache, chosen, fused, bm25_spec, relevant,
                                      top_k, params, per_query)
        timings["expansions"] = time.perf_counter() - clock
        if any(e.stage == QUERY2DOC for e in expansions):
            clock = time.perf_counter()
            decisions[QUERY2DOC] = decide_query2doc(expansions, plain, pairs, corpus, cache, chosen, fused, bm25_spec,
                                                    relevant, top_k, params, llm)
            timings["query2doc"] = time.perf_counter() - clock
    contexts = find_contexts(plain, targets) if params.context else []
    context_fields: dict[tuple[str, str], dict[str, Any]] = {}
    if contexts:
        clock = time.perf_counter()
        decisions["expand_context"] = decide_context(contexts, pairs, corpus, cache, chosen, top_k, params, state,
                                                     embedder)
        if decisions["expand_context"].get("fields"):
            context_fields = {(c.pipeline, c.step): decisions["expand_context"]["fields"] for c in contexts}
        timings["expand_context"] = time.perf_counter() - clock
    steps, own = expansion_entries(expansions, decisions)
    overrides = overlay_entries(plain, targets, chosen.setting, floor, p_floor, {**steps, **context_fields}, own)
    report = TuneReport(metric=params.metric, pairs=len(pairs), chunks=len(corpus.ids),
                        strategies={s: sum(p.strategy == s for p in pairs) for s in sorted({p.strategy for p in pairs})},
                        candidates=candidates, baseline=baseline, chosen=chosen, reason=reason,
                        rule=decision.rule, single=decision.single, gain_interval=decision.interval,
                        by_strategy=by_strategy(pairs, candidates, per_query, params.metric,
                                                {"chosen": chosen, "best single": decision.single,
                                                 "pipelines.yaml": baseline}),
                        overrides=overrides, budget_exhausted=exhausted, expansions=decisions,
                        gate_floor=floor if gate is not None else None, gate_llm=calibration,
                        timings={k: round(v, 2) for k, v in timings.items()})
    report.seconds = round(time.perf_counter() - started, 2)
    if state.generation != generation:
        ctx.logger.warning("the index changed while tuning (generation %d -> %d): the overlay records %d, the "
                           "generation the settings were tuned on; run `ragline tune` again", generation,
                           state.generation, generation)
    # the job runner (flows.run.jobs) writes the overlay and rebuilds BM25 with it: a stage only reports
    report.write_requested, report.overlay_file, report.generation = params.write, params.overlay, generation
    report.state_resource = step.resources.get("state")
    report.sparse_resources = sorted({t.sparse_resource for t in targets})
    ctx.logger.info("tune: chose %s (%s %.4f) over %d candidates", chosen.name, params.metric,
                    chosen.scores[params.metric], len(candidates))
    return report


WRITER_WAIT_SECONDS = 3600.0  # how long tune waits for an ingestion run to finish before reading


def consistent_read(state: IndexState, ctx: StepContext) -> tuple[int, list[tuple[str, str, dict[str, Any]]]]:
    """The generation and the chunks of one published state: wait while an ingestion run writes
    (its batches move the state and Chroma apart), then read both in one transaction. The
    overlay records this generation. Read-only: no lease is taken, nothing is written."""

    told, deadline = False, time.monotonic() + WRITER_WAIT_SECONDS
    while (holder := state.lease_holder()) is not None and not holder.stale(time.time(), LEASE_STALE_SECONDS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the index is still being written by {holder.describe()}: try `ragline tune` later")
        if not told:
            ctx.logger.warning("waiting: the index is being written by %s; tune reads it when that run ends",
                               holder.describe())
            told = True
        time.sleep(0.5)
    return state.snapshot()


# ----------------------------------------------------------------------------- targets
def find_targets(project: Any, names: list[str], resources: dict[str, str]) -> list[Target]:
    """The query pipelines (named, or all) whose fuse step is fed by one dense and one BM25
    retriever over the tuner's own store, embedder and BM25 index."""
    wanted = names or [n for n, p in project.pipelines.items() if p.kind == PipelineKind.QUERY]
    targets, problems = [], []
    for name in wanted:
        pipeline = project.pipeline(name)  # a named pipeline that does not exist is an error
        if pipeline.kind != PipelineKind.QUERY:
            problems.append(f"'{name}' is not a query pipeline")
            continue
        for step in reversed(pipeline.steps):  # the last: the ranking the pipeline returns (PRF fuses twice)
            if step.stage.name != "fuse":
                continue
            feeders = [pipeline.step(s) for s in step.wiring.get("rankings", [])]
            dense = [s for s in feeders if s.stage.name == "retrieve_dense"]
            bm25 = [s for s in feeders if s.stage.name == "retrieve_sparse"]
            if len(feeders) != 2 or len(dense) != 1 or len(bm25) != 1:
                continue
            same = (any(b.get("store") == resources.get("store") and b.get("embedder") == resources.get("embedder")
                        for b in bindings(dense[0]))
                    and any(b.get("sparse") == resources.get("sparse") for b in bindings(bm25[0])))
            if not same:
                problems.append(f"'{name}' searches other resources than the tuner's")
                continue
            gate = next((s.id for s in pipeline.steps if s.stage.name == "answerable"), None)
            targets.append(Target(name, step.id, dense[0].id, bm25[0].id, resources["sparse"], gate))
            break
        else:
            if names:
                problems.append(f"'{name}' has no fuse step fed by one dense and one BM25 retriever")
    if names and problems:
        raise ValueError("cannot tune " + "; ".join(problems))
    if not targets:
        raise ValueError("no query pipeline fuses one dense and one BM25 retriever over this index: nothing to tune")
    return targets


def bindings(step: Any) -> list[dict[str, str]]:
    """A retriever's resources: its own and, over named collections, each collection's (a tuner bound
    to one collection's index tunes the retrievers that search it; its BM25 parameters go to that
    collection's BM25 resource, the fusion and depths to the pipeline, shared by every collection)."""
    return [step.resources, *step.collections.values()]


def current_setting(project: Any, target: Target, bm25: Any) -> dict[str, Any]:
    """What the file says now for one target, in the tuner's terms."""
    pipeline = project.pipeline(target.pipeline)
    fuse = pipeline.step(target.fuse).params
    w_dense = fuse.weights.get(target.dense, 1.0)
    w_sparse = fuse.weights.get(target.sparse, 1.0)
    total = w_dense + w_sparse
    return {"method": fuse.method, "k": fuse.k,
            "dense_weight": round(w_dense / total, 4) if total > 0 else 0.5,
            "depth_dense": pipeline.step(target.dense).params.k,
            "depth_sparse": pipeline.step(target.sparse).params.k,
            "bm25": {"k1": bm25.k1, "b": bm25.b, "stemmer": bm25.stemmer}}


def gate_similarities(pairs: list[PseudoQuery], similarity: list[float | None]) -> list[float | None]:
    """The source similarities the gate's floor comes from: of the pairs worded like a question or
    a sentence (keyword queries are terse, so their similarities are far lower than a real
    question's: with them the floor refused nothing off-topic); all when too few are left."""
    worded = [s for p, s in zip(pairs, similarity) if p.strategy != "keywords"]
    return worded if sum(s is not None for s in worded) >= 20 else similarity


def overlay_entries(project: Any, targets: list[Target], setting: dict[str, Any],
                    floor: float | None = None, probability_floor: float | None = None,
                    expansions: dict[tuple[str, str], dict[str, Any]] | None = None,
                    own_settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The overlay for a setting: the BM25 resource's parameters and, per target pipeline, its
    fuse step's method, constant and weights, its retrievers' depth, its gate's thresholds and
    its expansion steps turned on (with their settings) or off. ``own_settings``: a pipeline's own
    fusion and depths (one whose expansion makes a hybrid win where the others stay single)."""
    pipelines: dict[str, dict[str, dict[str, Any]]] = {}
    for t in targets:
        own = (own_settings or {}).get(t.pipeline, setting)
        alpha = own["dense_weight"]
        pipelines[t.pipeline] = {
            t.fuse: {"method": own["method"], "k": own["k"],
                     "weights": {t.dense: round(alpha, 4), t.sparse: round(1.0 - alpha, 4)}},
            t.dense: {"k": own["depth_dense"]},
            t.sparse: {"k": own["depth_sparse"]},
        }
        thresholds = {"min_similarity": floor, "min_probability": probability_floor}
        if t.gate is not None and any(v is not None for v in thresholds.values()):
            pipelines[t.pipeline][t.gate] = {k: v for k, v in thresholds.items() if v is not None}
    for (pipeline, step), fields in (expansions or {}).items():
        pipelines.setdefault(pipeline, {})[step] = fields
    resources = {name: dict(setting["bm25"]) for name in sorted({t.sparse_resource for t in targets})}
    return {"resources": resources, "pipelines": pipelines}


def expansion_entries(expansions: list[Expansion], decisions: dict[str, dict[str, Any]],
                      ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, dict[str, Any]]]:
    """The overlay's fields per expansion step decided (its settings and on, or off), and the own
    fusion setting of each pipeline whose expansion won with another fusion than the chosen one."""
    entries, own = {}, {}
    for e in expansions:
        decision = decisions.get(e.stage, {})
        if e.problem is None and decision.get("enabled") is not None:
            entries[(e.pipeline, e.step)] = decision["fields"] if decision["enabled"] else {"enabled": False}
            if decision["enabled"] and decision.get("fusion_changed"):
                own[e.pipeline] = {k: v for k, v in decision["setting"].items() if k != "expansion"}
    return entries, own


def calibrate_gate(probabilities: tuple[list[float], list[float]], keep: float, min_refusal: float) -> GateCalibration:
    """The threshold ``keep`` of the answerable pseudo-queries clear, what it refuses of the
    unanswerable ones, the check's AUC, and whether that is worth a call per question."""
    answerable, unanswerable = probabilities
    threshold = kept_floor(answerable, keep)
    calibration = GateCalibration(pairs=len(answerable), threshold=threshold, auc=auc(answerable, unanswerable))
    if threshold is None:
        calibration.reason = f"too few pseudo-queries ({len(answerable)}; 20 or more place the threshold)"
        return calibration
    calibration.refused_unanswerable = round(float(np.mean([u < threshold for u in unanswerable])), 4)
    calibration.refused_answerable = round(float(np.mean([a < threshold for a in answerable])), 4)
    calibration.enabled = calibration.refused_unanswerable >= min_refusal
    calibration.reason = (f"at {threshold:.3f} the check refuses {calibration.refused_unanswerable:.0%} of the "
                          f"pseudo-queries asked without their source and {calibration.refused_answerable:.0%} with it "
                          f"(AUC {calibration.auc:.2f}): "
                          + ("set" if calibration.enabled else f"left off (under {min_refusal:.0%})"))
    return calibration


def auc(positive: list[float], negative: list[float]) -> float | None:
    """The chance that a positive scores above a negative (ties count half): 1.0 separates them
    perfectly, 0.5 is chance; None without both."""
    pairs = [(p > n) + 0.5 * (p == n) for p in positive for n in negative]
    return round(sum(pairs) / len(pairs), 4) if pairs else None


def gate_probabilities(pairs: list[PseudoQuery], corpus: "Corpus", cache: "Rankings", llm: LLMClient,
                       project: Any, target: Target, n: int) -> tuple[list[float], list[float]]:
    """P(answerable) from ``target``'s gate, asked exactly as it asks (its prompt, its clipping) for
    up to ``n`` pseudo-queries, questions first (LLM-written, then titles, then inverse cloze): with
    the query's source chunk (without the cut) among the closest chunks of other documents (its
    place varies, so a model's position bias does not set the threshold), and with those only."""

    step = project.pipeline(target.pipeline).step(target.gate)
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    rank = {"llm": 0, "title": 1}

    def prompt(question: str, texts: list[str]) -> str:
        documents = [ContextDocument(number=k, passage=Passage(chunk_id=str(k), source_id=str(k), text=t))
                     for k, t in enumerate(texts, start=1)]
        return project.prompts.render(step.prompt, question=clip(question, step.params.max_request_chars),
                                      documents=documents)

    with_source, without_source = [], []
    for i in sorted(range(len(pairs)), key=lambda i: rank.get(pairs[i].strategy, 2))[:n]:
        pair = pairs[i]
        source = corpus.doc_index[pair.source_id]
        own = position.get(pair.chunk_id, corpus.chunks_of[source][0])
        texts = [corpus.texts[c] for c in closest_of_other_documents(cache.dense[i], corpus.docs, source)]
        without_source.append(prompt(pair.text, texts))
        texts = texts[:GATE_DOCUMENTS - 1]
        texts.insert(i % (len(texts) + 1), without(corpus.texts[own], pair.cut))
        with_source.append(prompt(pair.text, texts))
    values = llm.map(lambda text: probability(llm, text), with_source + without_source)
    return values[:len(with_source)], values[len(with_source):]


def closest_of_other_documents(ranking: list[tuple[int, float]], docs: np.ndarray, source: int,
                               n: int = GATE_DOCUMENTS) -> list[int]:
    """The best-ranked chunk of each of the first ``n`` documents in ``ranking`` other than ``source``."""
    seen, chunks = {source}, []
    for chunk, _ in ranking:
        doc = int(docs[chunk])
        if doc not in seen:
            seen.add(doc)
            chunks.append(chunk)
            if len(chunks) == n:
                break
    return chunks


# ----------------------------------------------------------------------------- the corpus and rankings
@dataclass
class Corpus:
    ids: list[str]  # chunk ids, sorted (fuse breaks score ties by chunk id)
    texts: list[str]
    docs: np.ndarray  # document index of each chunk
    doc_ids: list[str]
    doc_index: dict[str, int]
    chunks_of: dict[int, list[int]]

    @classmethod
    def from_state(cls, state: IndexState) -> "Corpus":
        return cls.from_rows(state.chunk_rows())

    @classmethod
    def from_rows(cls, rows: list[tuple[str, str, dict[str, Any]]]) -> "Corpus":
        rows = sorted(rows, key=lambda r: r[0])
        doc_ids = sorted({str(r[2]["source_id"]) for r in rows})
        doc_index = {d: i for i, d in enumerate(doc_ids)}
        docs = np.fromiter((doc_index[str(r[2]["source_id"])] for r in rows), dtype=np.int64, count=len(rows))
        chunks_of: dict[int, list[int]] = {}
        for i, d in enumerate(docs.tolist()):
            chunks_of.setdefault(d, []).append(i)
        return cls([r[0] for r in rows], [r[1] for r in rows], docs, doc_ids, doc_index, chunks_of)

    def masked(self, pairs: list[PseudoQuery]) -> dict[int, str]:
        """chunk index -> its text without what a pair cut out of its document (changed chunks only)."""
        changed: dict[int, str] = {}
        for pair in pairs:
            if not pair.cut or pair.source_id not in self.doc_index:
                continue
            for c in self.chunks_of[self.doc_index[pair.source_id]]:
                text = without(changed.get(c, self.texts[c]), pair.cut)
                if text != self.texts[c]:
                    changed[c] = text
        return changed


def bm25_variants(params: Params, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The BM25 settings to try, the current one first (it is always tried, whatever the budget)."""
    grid = [{"k1": k1, "b": b, "stemmer": s}
            for s, k1, b in itertools.product(params.bm25_stemmer, params.bm25_k1, params.bm25_b)]
    current = dict(base["bm25"])
    return [current] + [v for v in grid if v != current]


def variant_name(v: dict[str, Any]) -> str:
    return f"bm25 k1={v['k1']:g} b={v['b']:g} {v['stemmer']}"


def rank_pairs(pairs: list[PseudoQuery], corpus: Corpus, store: DenseStore, embedder: Embedder, spec: Any,
               params: Params, base: dict[str, Any], deadline: float | None,
               ctx: StepContext | None = None, timings: dict[str, float] | None = None) -> tuple[Rankings, bool]:
    """Each retriever's ranking of every pseudo-query, at the deepest depth tried, with every
    source scored without the text cut out of it."""
    depth = max([*params.depths, base["depth_dense"], base["depth_sparse"]])
    return rank_queries([p.text for p in pairs], corpus, store, embedder, spec, bm25_variants(params, base), depth,
                        corpus.masked(pairs), [corpus.doc_index.get(p.source_id) for p in pairs], deadline,
                        ctx, timings)


def rank_queries(queries: list[str], corpus: Corpus, store: DenseStore, embedder: Embedder, spec: Any,
                 variants: list[dict[str, Any]], depth: int, changed: dict[int, str] | None = None,
                 sources: list[int | None] | None = None, deadline: float | None = None,
                 ctx: StepContext | None = None, timings: dict[str, float] | None = None) -> tuple[Rankings, bool]:
    """Dense and BM25 (each variant) rankings of ``queries``, on the corpus with ``changed`` chunk
    texts; ``sources[i]``: the document query i was cut from, re-scored without the cut."""
    timings = {} if timings is None else timings
    changed = changed or {}
    clock = time.perf_counter()
    similarity: list[float | None] = []
    dense = dense_rankings(queries, depth, corpus, store, embedder, changed, sources or [None] * len(queries),
                           similarity)
    cache = Rankings(docs=corpus.docs, dense=dense, source_similarity=similarity)
    timings["dense"] = time.perf_counter() - clock
    clock = time.perf_counter()
    texts = cache.texts = [changed.get(i, t) for i, t in enumerate(corpus.texts)]
    exhausted = False
    tokens = cache.tokens
    for variant in variants:
        if cache.sparse and deadline is not None and time.monotonic() > deadline:
            exhausted = True
            if ctx is not None:
                ctx.logger.warning("tune: time budget spent after %d BM25 variants", len(cache.sparse))
            break
        if variant["stemmer"] not in tokens:
            tokens[variant["stemmer"]] = tokenize(texts, variant["stemmer"], spec.stopwords)
        vspec = spec.model_copy(update=variant)
        cache.sparse[variant_name(variant)] = sparse_rankings(queries, depth, tokens[variant["stemmer"]], vspec)
    timings["bm25"] = time.perf_counter() - clock
    return cache, exhausted


def dense_rankings(queries: list[str], depth: int, corpus: Corpus, store: DenseStore, embedder: Embedder,
                   changed: dict[int, str], sources: list[int | None],
                   similarity: list[float | None] | None = None) -> list[list[tuple[int, float]]]:
    """Chroma's ranking per query; the query's own source document is re-scored from its chunks as
    they would be without the cut text (re-embedded), and put back in place. ``similarity``
    receives each query's cosine similarity to its source's closest chunk."""
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    store.check_embedder(embedder.spec.vectors_key(), embedder.spec.model)
    vectors = embedder.encode_queries(queries)
    source_chunks = {c for s in sources if s is not None for c in corpus.chunks_of.get(s, [])}
    stored = store.vectors([corpus.ids[c] for c in sorted(source_chunks - set(changed))])
    order = sorted(set(changed) & source_chunks)
    fresh = dict(zip(order, embedder.encode_documents([changed[c] for c in order]))) if order else {}
    vector_of = {c: fresh[c] if c in fresh else stored.get(corpus.ids[c]) for c in source_chunks}
    extra = max((len(corpus.chunks_of.get(s, [])) for s in sources if s is not None), default=0)
    results = [r for start in range(0, len(vectors), QUERY_BATCH)  # Chroma: a bounded number of SQL variables
               for r in store.query(vectors[start:start + QUERY_BATCH], depth + extra)]
    rankings = []
    for query_vector, passages, source in zip(vectors, results, sources):
        ranking = [(position[p.chunk_id], p.score) for p in passages if p.chunk_id in position]
        own = [c for c in corpus.chunks_of.get(source, []) if vector_of.get(c) is not None] \
            if source is not None else []
        if similarity is not None:
            similarity.append(max_cosine(query_vector, np.stack([vector_of[c] for c in own])) if own else None)
        if own:
            mine = set(own)
            ranking = [r for r in ranking if r[0] not in mine]
            scores = store.score(query_vector, np.stack([vector_of[c] for c in own]))
            floor = ranking[depth - 1][1] if len(ranking) >= depth else -np.inf
            ranking += [(c, float(s)) for c, s in zip(own, scores) if s >= floor]
        ranking.sort(key=lambda r: (-r[1], r[0]))  # chunk indexes sort like chunk ids
        rankings.append(ranking[:depth])
    return rankings


def sparse_rankings(queries: list[str], depth: int, tokens: list[list[str]],
                    spec: Any) -> list[list[tuple[int, float]]]:
    """BM25's ranking per query on an in-memory index of these tokens (hits scoring 0 dropped, as
    the published index's search does)."""
    retriever = in_memory(tokens, spec)
    query_tokens = tokenize(queries, spec.stemmer, spec.stopwords)
    rankings: list[list[tuple[int, float]]] = [[] for _ in queries]
    if not tokens:
        return rankings
    for i, terms in enumerate(query_tokens):
        if terms:
            scores = retriever.get_scores(terms)
            rankings[i] = [(d, float(scores[d])) for d in ranked(scores, depth).tolist()]  # ties: chunk id order
    return rankings


# ----------------------------------------------------------------------------- candidates and scores
def setting_name(s: dict[str, Any]) -> str:
    expansion = s.get("expansion")
    return _fusion_name(s) + (f", {expansion['name']}" if expansion else "")


def sparse_key(s: dict[str, Any]) -> str:
    """The cached BM25 ranking a setting fuses: its variant's, expanded when the setting expands the query."""
    expansion = s.get("expansion")
    return variant_name(s["bm25"]) + (f" + {expansion['name']}" if expansion else "")


def _fusion_name(s: dict[str, Any]) -> str:
    alpha = s["dense_weight"]
    depth = s["depth_dense"] if s["depth_dense"] == s["depth_sparse"] else f"{s['depth_dense']}/{s['depth_sparse']}"
    if alpha >= 1.0:
        return f"dense alone, depth {depth}"
    bm25 = variant_name(s["bm25"])
    if alpha <= 0.0:
        return f"{bm25} alone, depth {depth}"
    fusion = f"rrf k={s['k']}" if s["method"] == "rrf" else "score"
    return f"{fusion}, dense weight {alpha:g}, {bm25}, depth {depth}"


def grid(params: Params, base: dict[str, Any], cache: Rankings, relevant: list[set[int]],
         top_k: int, per_query: dict[str, np.ndarray] | None = None) -> list[Candidate]:
    """Every candidate, scored, best first: each BM25 variant alone, dense alone, and fusion of
    dense with the best few BM25 variants (and the current one) at every method, constant,
    weight and depth."""
    variants = {variant_name(v): v for v in bm25_variants(params, base) if variant_name(v) in cache.sparse}
    alone = [_setting(base, v, "rrf", 60, 0.0, d) for v in variants.values() for d in params.depths]
    alone += [_setting(base, base["bm25"], "rrf", 60, 1.0, d) for d in params.depths]
    scored = score_settings(alone, cache, relevant, top_k, per_query)
    solo = sorted((c for c in scored if c.setting["dense_weight"] == 0.0),
                  key=lambda c: -c.scores[params.metric])
    fused_variants = [variant_name(base["bm25"])]
    for c in solo:
        name = variant_name(c.setting["bm25"])
        if name not in fused_variants and len(fused_variants) <= params.bm25_fused:
            fused_variants.append(name)
    fusion = []
    for name in fused_variants:
        for depth in params.depths:
            for alpha in params.dense_weights:
                if alpha <= 0.0 or alpha >= 1.0:
                    continue  # alone: scored above
                for method in params.methods:
                    for k in (params.rrf_k if method == "rrf" else [60]):
                        fusion.append(_setting(base, variants[name], method, k, alpha, depth))
    fusion.append(dict(base))  # the file's own setting, exactly (its own depths, constant and weights)
    scored += score_settings(fusion, cache, relevant, top_k, per_query)
    unique = {c.name: c for c in scored}
    return sorted(unique.values(), key=lambda c: (-round(c.scores[params.metric], 5), -round(c.scores["mrr@10"], 5),
                                                  _changes(c.setting, base), -c.setting["depth_dense"], c.name))


def _changes(setting: dict[str, Any], base: dict[str, Any]) -> int:
    """How many settings differ from the file's (ties go to the candidate that changes least)."""
    flat = lambda s: {**{k: v for k, v in s.items() if k != "bm25"}, **s["bm25"]}  # noqa: E731
    a, b = flat(setting), flat(base)
    return sum(a.get(k) != b.get(k) for k in set(a) | set(b))


def _setting(base: dict[str, Any], bm25: dict[str, Any], method: str, k: int, alpha: float,
             depth: int) -> dict[str, Any]:
    return {"method": method, "k": k if method == "rrf" else base["k"], "dense_weight": alpha,
            "depth_dense": depth, "depth_sparse": depth, "bm25": dict(bm25)}


def is_single(c: Candidate) -> bool:
    return c.setting["dense_weight"] in (0.0, 1.0)


@dataclass
class Decision:
    chosen: Candidate
    reason: str
    rule: str
    single: Candidate | None = None
    interval: list[float] | None = None  # of the chosen (or best fused) candidate minus ``single``


def choose(candidates: list[Candidate], baseline: Candidate, params: Params,
           per_query: dict[str, np.ndarray]) -> Decision:
    """The best single retriever unless a fused candidate beats it significantly on the pseudo-
    queries (paired bootstrap: the lower end of the gain's interval above 0); among those, the
    best by the metric that the recall guard lets through; pipelines.yaml's own setting when
    it is allowed and the choice beats it by no more than min_gain. The intervals are simultaneous
    over every fused candidate (max-T, as the on/off switches'): the choice is the best of hundreds
    of settings, so one of them clearing 0 by luck must be as rare as one setting doing so alone."""
    metric = params.metric
    singles = [c for c in candidates if is_single(c)]
    single = recall_guarded(singles, params)[0] if singles else baseline
    fused = [c for c in candidates if not is_single(c)]
    intervals = gain_intervals(fused, single, per_query, params, simultaneous=True)
    words = interval_words(params, len(fused))
    significant = [c for c in fused if intervals[c.name][0] > 0]
    allowed = recall_guarded([*significant, single], params)
    chosen = allowed[0]
    top = max([*significant, single], key=lambda c: c.scores[metric])
    best_fused = significant[0] if significant else (fused[0] if fused else None)
    shown = chosen if not is_single(chosen) else best_fused
    interval = intervals.get(shown.name) if shown is not None else None
    low, high = interval if interval else (0.0, 0.0)
    if shown is not None and is_single(chosen):
        rule = "no significant gain" if top is single else "recall guard"
        why = (f"no fused candidate beats the best single retriever significantly (best: {shown.name}, "
               f"{low:+.4f} to {high:+.4f} {metric}, {words})"
               if rule == "no significant gain" else
               f"{top.name} gains no more than {params.recall_trade:g} {metric} for a Recall@100 loss over "
               f"{params.recall_margin:g}")
        reason = f"{single.name} alone: {why}"
    elif shown is not None:
        rule = "significant gain" if chosen is top else "recall guard"
        reason = (f"{chosen.scores[metric] - single.scores[metric]:+.4f} {metric} over the best single retriever "
                  f"({single.name}; {words} {low:+.4f} to {high:+.4f})")
        if rule == "recall guard":
            reason += (f"; {top.name} scores up to {params.recall_trade:g} higher but loses over "
                       f"{params.recall_margin:g} Recall@100")
    else:
        rule, reason = "no fused candidate", f"{single.name} alone: no fused candidate was tried"
    allowed_names = {c.name for c in allowed}
    gain = chosen.scores[metric] - baseline.scores[metric]
    if chosen.name != baseline.name and baseline.name in allowed_names and gain <= params.min_gain:
        rule = "min_gain"
        reason = (f"the current setting is kept: {chosen.name} beats it by {gain:+.4f} {metric}, "
                  f"not more than min_gain {params.min_gain:g}")
        chosen = baseline
        interval = intervals.get(baseline.name)
    elif chosen.name == baseline.name:
        reason = f"the current setting is the choice: {reason}"
    return Decision(chosen, reason, rule, single, [round(v, 5) for v in interval] if interval else None)


def recall_guarded(pool: list[Candidate], params: Params) -> list[Candidate]:
    """``pool`` best first without any candidate that another one in it beats by more than
    recall_margin Recall@100 while losing no more than recall_trade on the metric."""
    metric = params.metric
    ordered = sorted(pool, key=lambda c: -c.scores[metric])  # stable: the grid's order breaks ties
    kept = [c for c in ordered if not any(
        c.scores[metric] - o.scores[metric] <= params.recall_trade
        and o.scores["recall@100"] - c.scores["recall@100"] > params.recall_margin for o in ordered)]
    return kept or ordered[:1]


def gain_intervals(candidates: list[Candidate], single: Candidate, per_query: dict[str, np.ndarray],
                   params: Params, simultaneous: bool = False) -> dict[str, tuple[float, float]]:
    """Per candidate, the paired-bootstrap interval of its mean gain over ``single`` on the metric:
    the same resampled pseudo-queries for every candidate, from a fixed seed. Per candidate (each
    interval alone at ``confidence``: the percentile interval), or ``simultaneous``: all of them at
    once (max-T), so that the chance that *any* of the k intervals misses its candidate's true gain
    stays within 1 - confidence whatever k; see ``simultaneous_intervals``."""
    if not candidates or single.name not in per_query:
        return {}
    column = METRICS.index(params.metric)
    base = per_query[single.name][:, column]
    n = len(base)
    if n == 0:
        return {c.name: (0.0, 0.0) for c in candidates}
    # each resample's count of every pseudo-query, drawn in one call (the same stream as a draw per resample)
    drawn = np.random.default_rng(params.seed).integers(0, n, (params.bootstrap, n))
    offsets = n * np.arange(params.bootstrap)[:, None]
    counts = np.bincount((drawn + offsets).ravel(), minlength=params.bootstrap * n).reshape(params.bootstrap, n)
    gains = np.stack([per_query[c.name][:, column] - base for c in candidates], axis=1)  # (n, candidates)
    means = counts @ gains / n  # (resamples, candidates)
    tail = 100 * (1 - params.confidence) / 2
    if simultaneous:
        low, high = simultaneous_intervals(means, gains.mean(axis=0), tail)
    else:
        low, high = np.percentile(means, [tail, 100 - tail], axis=0)
    return {c.name: (float(lo), float(hi)) for c, lo, hi in zip(candidates, low, high)}


def simultaneous_intervals(means: np.ndarray, observed: np.ndarray, tail: float) -> tuple[np.ndarray, np.ndarray]:
    """Max-T bootstrap intervals of k mean gains that hold together: ``means`` (resamples x k) are
    the resampled means, ``observed`` the k means of the pseudo-queries themselves. Each candidate's
    deviation is standardised by its bootstrap standard error (so that the noisiest candidate does
    not set the bar for a steady one); per resample, the largest standardised deviation over the k
    candidates upwards (and, for the upper ends, downwards); its 100 - ``tail`` percentile ``c`` gives
    every candidate ``observed - c * se`` as its lower end (``observed + c' * se`` its upper end).
    Every lower end is then above the true gain in at most ``tail`` % of samples for all k at once,
    as one candidate's percentile interval is alone. With k = 1 it is the basic bootstrap interval.
    A candidate whose gain does not vary over the resamples (the same figure on every pseudo-query,
    e.g. a setting that changes no ranking) has its observed gain as both ends."""
    se = means.std(axis=0)
    varies = se > 1e-12
    low, high = observed.astype(float).copy(), observed.astype(float).copy()
    if varies.any():
        z = (means[:, varies] - observed[varies]) / se[varies]  # (resamples, varying candidates)
        up, down = np.percentile(z.max(axis=1), 100 - tail), np.percentile((-z).max(axis=1), 100 - tail)
        low[varies] = observed[varies] - up * se[varies]
        high[varies] = observed[varies] + down * se[varies]
    return low, high


@dataclass(frozen=True)
class SwitchVerdict:
    """Whether an opt-in step beats ``off`` (the ranking without it): ``best`` is ``off`` unless a
    candidate gains significantly; ``shown`` is what the report names (the best, else the top one);
    ``low``..``high`` its interval, simultaneous over the ``family`` candidates tried."""
    best: Candidate
    top: Candidate
    shown: Candidate
    low: float
    high: float
    gain: float
    family: int


def switch_verdict(candidates: list[Candidate], off: Candidate, per_query: dict[str, np.ndarray],
                   params: Params) -> SwitchVerdict:
    """The paired-bootstrap decision for a step that is on or off: on only for a candidate whose
    interval of gain over ``off`` is above 0 and whose gain exceeds min_gain, recall guard applied.
    The intervals are simultaneous over all the candidates (max-T): picking the best of k settings
    must not turn a step on by the luck of one of k tries, so "off" is wrongly left with a chance of
    about (1 - confidence) / 2 for the whole family (as for one setting alone), not for each setting."""
    intervals = gain_intervals(candidates, off, per_query, params, simultaneous=True)
    metric = params.metric
    significant = [c for c in candidates if intervals[c.name][0] > 0
                   and c.scores[metric] - off.scores[metric] > params.min_gain]
    best = recall_guarded([*significant, off], params)[0]
    top = max(candidates, key=lambda c: c.scores[metric])
    shown = best if best is not off else top
    low, high = intervals[shown.name]
    return SwitchVerdict(best, top, shown, low, high, shown.scores[metric] - off.scores[metric], len(candidates))


def interval_words(params: Params, family: int) -> str:
    """How an interval is named in a reason: simultaneous over the ``family`` settings tried."""
    return f"{params.confidence:.0%} interval simultaneous over {family} settings"


def by_strategy(pairs: list[PseudoQuery], candidates: list[Candidate], per_query: dict[str, np.ndarray],
                metric: str, shown: dict[str, Candidate | None]) -> dict[str, dict[str, Any]]:
    """Per generator: how many pairs, the figures of the chosen, best single and file's setting
    on its pairs alone, and the candidate it alone would rank first."""
    column = METRICS.index(metric)
    out: dict[str, dict[str, Any]] = {}
    for strategy in sorted({p.strategy for p in pairs}):
        rows = np.array([i for i, p in enumerate(pairs) if p.strategy == strategy])
        entry: dict[str, Any] = {"pairs": len(rows)}
        for label, c in shown.items():
            if c is not None and c.name in per_query:
                entry[label] = {"name": c.name, **{m: round(float(per_query[c.name][rows, j].mean()), 5)
                                                   for j, m in enumerate(METRICS)}}
        own = max((c for c in candidates if c.name in per_query),
                  key=lambda c: per_query[c.name][rows, column].mean(), default=None)
        if own is not None:
            entry["own best"] = {"name": own.name, metric: round(float(per_query[own.name][rows, column].mean()), 5)}
        out[strategy] = entry
    return out


def score_settings(settings: list[dict[str, Any]], cache: Rankings, relevant: list[set[int]],
                   top_k: int, per_query: dict[str, np.ndarray] | None = None) -> list[Candidate]:
    """Each setting's mean nDCG@10, MRR@10 and Recall@100 over the queries (documents ranked at
    their best chunk, as ``eval`` does), fusing the cached rankings with ``fuse``'s own fusion;
    ``per_query`` receives each setting's figures per query (for the paired test)."""
    runs: list[dict[str, dict[str, float]]] = [{} for _ in settings]
    names = cache.docs.astype(str)  # of each chunk's document, as the judgements name it
    groups: dict[tuple[str, int, int], list[int]] = {}
    for i, s in enumerate(settings):
        groups.setdefault((sparse_key(s), s["depth_dense"], s["depth_sparse"]), []).append(i)
    for (variant, d_dense, d_sparse), rows in groups.items():
        sparse = cache.sparse[variant]
        weights = np.array([[settings[i]["dense_weight"], 1 - settings[i]["dense_weight"]] for i in rows])
        ks = np.array([settings[i]["k"] for i in rows], dtype=np.float64)[:, None]
        is_rrf = np.array([settings[i]["method"] == "rrf" for i in rows])[:, None]
        for q in range(len(relevant)):
            fused = fused_scores([cache.dense[q][:d_dense], sparse[q][:d_sparse]], weights, ks, is_rrf)
            if fused is None:
                continue
            chunk = np.array(fused[0])
            for row, i in enumerate(rows):
                order = chunk[fused_order(fused[1][row], fused[2][row], top_k)]
                runs[i][str(q)] = document_run(names[order].tolist())
    values = _metrics(runs, relevant)
    n = max(1, len(relevant))
    totals = values.sum(axis=1)
    candidates = [Candidate(name=setting_name(s), setting=s,
                            scores={m: round(float(v) / n, 5) for m, v in zip(METRICS, totals[i])})
                  for i, s in enumerate(settings)]
    if per_query is not None:
        per_query.update({c.name: values[i] for i, c in enumerate(candidates)})
    return candidates


def document_run(ranked_docs: list[str]) -> dict[str, float]:
    """A query's run for pytrec_eval, its first 100 documents, from its chunks' documents in fused
    order: a document ranks where its best chunk does (as ``eval``'s ``to_run``), scored so that
    none tie."""
    return dict(zip(dict.fromkeys(ranked_docs), _RUN_SCORES))


_RUN_SCORES = [float(100 - rank) for rank in range(100)]  # Recall@100 needs no more


def _metrics(runs: list[dict[str, dict[str, float]]], relevant: list[set[int]]) -> np.ndarray:
    """nDCG@10, MRR@10 and Recall@100 (binary relevance) by pytrec_eval, as ``eval`` measures them:
    settings x queries x 3; a query that retrieved nothing scores 0."""
    qrels = {str(q): {str(d): 1 for d in rel} for q, rel in enumerate(relevant)}
    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"})
    first = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"})
    values = np.zeros((len(runs), len(relevant), 3))
    for i, run in enumerate(runs):
        top10 = {q: dict(itertools.islice(docs.items(), 10)) for q, docs in run.items()}  # ranked order
        measured, reciprocal = full.evaluate(run), first.evaluate(top10)
        for q in range(len(relevant)):
            m, r = measured.get(str(q)), reciprocal.get(str(q))
            values[i, q] = (m["ndcg_cut_10"] if m else 0.0, r["recip_rank"] if r else 0.0,
                            m["recall_100"] if m else 0.0)
    return values


def summary(report: TuneReport, shown: int = 12) -> str:
    """The run summary: the best candidates, the single retrievers and the file's own setting with
    their pseudo-query figures, what was chosen and why, the time and the overlay."""
    metric = report.metric
    strategies = ", ".join(f"{n} {s}" for s, n in report.strategies.items())
    lines = [f"tuned on {report.pairs} pseudo-queries ({strategies}) over {report.chunks} chunks in "
             f"{report.seconds:.1f} s; {len(report.candidates)} candidates, by {metric}"
             + (" (time budget spent: not every BM25 variant was tried)" if report.budget_exhausted else ""),
             "",
             f"  {'rank':>4}  {'nDCG@10':>7}  {'MRR@10':>6}  {'R@100':>6}  candidate"]
    ranked = {c.name: i for i, c in enumerate(report.candidates, start=1)}
    singles = [c for c in report.candidates if c.setting.get("dense_weight") in (0.0, 1.0)]
    best_single = {("dense" if c.setting["dense_weight"] == 1.0 else "bm25"): c for c in reversed(singles)}
    extra = [c for c in (report.baseline, best_single.get("dense"), best_single.get("bm25"), report.chosen)
             if c is not None and ranked.get(c.name, 0) > shown]
    for c in report.candidates[:shown] + list({c.name: c for c in extra}.values()):
        marks = []
        if report.chosen and c.name == report.chosen.name:
            marks.append("chosen")
        if report.baseline and c.name == report.baseline.name:
            marks.append("pipelines.yaml")
        s = c.scores
        lines.append(f"  {ranked.get(c.name, 0):>4}  {s['ndcg@10']:7.4f}  {s['mrr@10']:6.4f}  {s['recall@100']:6.4f}  "
                     f"{c.name}" + (f"  <- {', '.join(marks)}" if marks else ""))
    lines.append("")
    if report.chosen is not None:
        lines.append(f"chosen: {report.chosen.name} ({report.reason})")
        lines.append(f"decided by: {report.rule}")
    for strategy, entry in report.by_strategy.items():
        figures = ", ".join(f"{label} {entry[label][metric]:.4f}" for label in ("chosen", "best single", "pipelines.yaml")
                            if label in entry)
        own = entry.get("own best")
        lines.append(f"  {strategy} ({entry['pairs']} pairs): {figures}"
                     + (f"; its own best: {own['name']} {own[metric]:.4f}" if own else ""))
    if report.gate_floor is not None:
        lines.append(f"answerability gate: refuses questions with no reference above {report.gate_floor:.3f} "
                     f"similarity (what the pseudo-queries' own sources clear)")
    if report.gate_llm is not None:
        lines.append(f"answerability gate, LLM check ({report.gate_llm.pairs} pseudo-queries): {report.gate_llm.reason}")
    for stage, entry in report.expansions.items():
        lines.append(f"{stage} ({', '.join(entry['steps'])}): {entry['reason']}")
        if entry.get("by_strategy"):
            lines.append("  gain per strategy: " + ", ".join(f"{s} {g:+.4f}" for s, g in entry["by_strategy"].items()))
    lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()))
    lines.append(f"overlay: {report.overlay}" + ("" if report.written else " (not written: dry run)"))
    if report.written:
        lines.append("search and ask use it from now on; `ragline validate` shows it, --no-tuned ignores it")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- query expansion on or off
EXPANSION_STAGES = ("expand_prf", "expand_terms")
QUERY2DOC = "query2doc"  # the decision's name for rewrite steps in mode hyde with keyword: true


@dataclass(frozen=True)
class Expansion:
    """An expansion step whose query feeds a tuned pipeline's BM25 retriever: the tuner turns it on
    (with its settings) or off (``enabled``)."""

    pipeline: str
    step: str
    stage: str
    params: Any  # the file's own
    source: str | None = None  # expand_prf: the step its feedback passages come from
    problem: str | None = None  # why the tuner cannot replay it (then it is left as the file has it)


def find_expansions(project: Any, targets: list[Target]) -> list[Expansion]:
    """The expand_prf / expand_terms steps on the query path of each target's BM25 retriever."""
    found = []
    for t in targets:
        pipeline = project.pipeline(t.pipeline)
        upstream = pipeline.step(t.sparse).wiring.get("query", [])
        while upstream:
            step = pipeline.step(upstream[0])
            if step.stage.name in EXPANSION_STAGES:
                source = (step.wiring.get("passages") or [None])[0] if step.stage.name == "expand_prf" else None
                found.append(Expansion(t.pipeline, step.id, step.stage.name, step.params, source,
                                       replay_problem(pipeline, step, source, t)))
            elif is_query2doc(step):
                found.append(Expansion(t.pipeline, step.id, QUERY2DOC, step.params, None,
                                       query2doc_problem(pipeline, step, t)))
            upstream = step.wiring.get("query", [])
    return found


def is_query2doc(step: Any) -> bool:
    """A rewrite step that appends its HyDE pseudo-document to the BM25 query (query2doc)."""
    return step.stage.name == "rewrite" and step.params.mode == "hyde" and step.params.keyword


def query2doc_problem(pipeline: Any, step: Any, target: Target) -> str | None:
    """Why the tuner cannot replay a query2doc step (None: it can): only its BM25 side is replayed."""
    upstream = pipeline.step(target.dense).wiring.get("query", [])
    while upstream:
        if upstream[0] == step.id:
            return "its pseudo-document also feeds dense retrieval (HyDE), which the tuner does not replay"
        upstream = pipeline.step(upstream[0]).wiring.get("query", [])
    return None


def replay_problem(pipeline: Any, step: Any, source: str | None, target: Target) -> str | None:
    """Why the tuner cannot replay this step on its pseudo-queries (None: it can)."""
    if getattr(step.params, "mode", "corpus") != "corpus":
        return "mode llm asks the LLM for every query"
    if step.params.dense:
        return "dense: true also changes dense retrieval, which the tuner does not replay"
    if step.stage.name == "expand_prf":
        feeding = pipeline.step(source)
        names = [pipeline.step(s).stage.name for s in feeding.wiring.get("rankings", [])] \
            if feeding.stage.name == "fuse" else [feeding.stage.name]
        if not names or any(n not in ("retrieve_dense", "retrieve_sparse") for n in names) or len(names) > 2 \
                or names.count("retrieve_sparse") > 1 or names.count("retrieve_dense") > 1:
            return f"its feedback comes from step '{source}', not from this index's dense and BM25 retrievers"
    return None


class MemoryBM25:
    """The tuner's stand-in for the published BM25 index, over the chunks as the tuner scores them
    (sources without their cut) with the chosen BM25 setting: what ``expand_prf`` and
    ``expand_terms`` read (terms, document frequencies, searches), so they run unchanged on it."""

    def __init__(self, spec: Any, ids: list[str], texts: list[str], tokens: list[list[str]]):
        self.spec = spec
        meta = [{"text": t} for t in texts]
        self.version = LegacyVersion("tuning", in_memory(tokens, spec), ids, meta, None)

    def terms(self, texts: list[str]) -> list[list[str]]:
        return tokenize(texts, self.spec.stemmer, self.spec.stopwords)

    def search(self, texts: list[str], k: int, where: Any = None) -> list[list[tuple[str, float, dict[str, Any]]]]:
        out = []
        for terms in self.terms(texts):
            scores = self.version.scores(terms) if terms else None
            out.append([] if scores is None else self.version.hits(scores, k))
        return out

    def search_weighted(self, queries: list[dict[str, float]], k: int,
                        where: Any = None) -> list[list[tuple[str, float, dict[str, Any]]]]:
        out = []
        for weights in queries:
            known = [(t, w) for t, w in sorted(weights.items()) if w > 0 and self.version.has(t)]
            scores = np.zeros(self.version.size)
            for term, weight in known:
                scores += weight * self.version.term_scores(term)
            out.append(self.version.hits(scores, k) if known else [])
        return out

    def document_frequencies(self, terms: Any) -> tuple[dict[str, int], int]:
        return {t: self.version.df(t) for t in terms if self.version.has(t)}, self.version.live_count


def expansion_grid(stage: str, base: Any, params: Params) -> list[Any]:
    """The stage's parameters to try: the file's own, with the grid's values set."""
    if stage == "expand_prf":
        values = [{"docs": d, "terms": t, "query_weight": w}
                  for d, t, w in itertools.product(params.prf_docs, params.prf_terms, params.prf_query_weight)]
    else:
        values = [{"terms": t, "weight": w} for t, w in itertools.product(params.related_terms, params.related_weight)]
    return [base.model_copy(update={**v, "enabled": True}) for v in values]


def expansion_name(stage: str, p: Any) -> str:
    if stage == "expand_prf":
        return f"expand_prf docs={p.docs} terms={p.terms} query_weight={p.query_weight:g}"
    return f"expand_terms terms={p.terms} weight={p.weight:g}"


def expansion_fields(stage: str, p: Any) -> dict[str, Any]:
    """What the overlay sets on a step the tuner turns on."""
    keys = ("docs", "terms", "query_weight") if stage == "expand_prf" else ("terms", "weight")
    return {"enabled": True, **{k: getattr(p, k) for k in keys}}


def expanded_rankings(stage: str, grid_params: list[Any], expansion: Expansion, project: Any, queries: list[str],
                      corpus: Corpus, cache: Rankings, setting: dict[str, Any], spec: Any,
                      depth: int) -> list[list[list[tuple[int, float]]]]:
    """Per candidate parameters, BM25's ranking of every query expanded as the stage expands it,
    on the tuner's index (the sources without their cut) with the chosen BM25 setting."""
    vspec = spec.model_copy(update=setting["bm25"])
    if vspec.stemmer not in cache.tokens:
        cache.tokens[vspec.stemmer] = tokenize(cache.texts, vspec.stemmer, spec.stopwords)
    index = MemoryBM25(vspec, corpus.ids, cache.texts, cache.tokens[vspec.stemmer])
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    feedback = feedback_rankings(expansion, project, cache, setting) if stage == "expand_prf" else None
    out: list[list[list[tuple[int, float]]]] = [[] for _ in grid_params]
    for q, text in enumerate(queries):
        query = Query(text=text)
        own_terms = index.terms([text])[0]
        related = None
        if stage == "expand_terms":  # the top terms of the widest setting; narrower ones take a prefix
            widest = max(grid_params, key=lambda p: p.terms)
            related, _ = corpus_terms(query, set(own_terms), widest, index)
        for i, p in enumerate(grid_params):
            if stage == "expand_prf":
                passages = [Passage(chunk_id=corpus.ids[c], source_id="", text=cache.texts[c], score=score)
                            for c, score in feedback[q]]
                expanded = with_feedback(query, passages, p, index)
            else:
                top = dict(itertools.islice(related.items(), p.terms))
                expanded = with_terms(query, top, {}, p) if top else query
            if expanded.feedback is None or not expanded.feedback.terms:
                out[i].append(cache.sparse[variant_name(setting["bm25"])][q][:depth])
                continue
            hits = index.search_weighted([expanded.feedback.weighted(own_terms)], depth)[0]
            out[i].append([(position[cid], score) for cid, score, _ in hits])
    return out


def feedback_rankings(expansion: Expansion, project: Any, cache: Rankings,
                      setting: dict[str, Any]) -> list[list[tuple[int, float]]]:
    """Per query, the passages ``expand_prf`` gets as feedback (chunk index, score), as its source
    step ranks them: a BM25 or dense retriever at its depth, or a fuse step over them with its own
    method, constant, weights and top_k (BM25 with the chosen setting)."""
    pipeline = project.pipeline(expansion.pipeline)
    source = pipeline.step(expansion.source)
    feeders = [pipeline.step(s) for s in source.wiring.get("rankings", [])] if source.stage.name == "fuse" \
        else [source]
    variant = variant_name(setting["bm25"])
    rankings = [(cache.dense if f.stage.name == "retrieve_dense" else cache.sparse[variant], f.params.k)
                for f in feeders]
    if source.stage.name != "fuse":
        ranking, k = rankings[0]
        return [r[:k] for r in ranking]
    fuse_params = source.params
    weights = np.array([[fuse_params.weights.get(f.id, 1.0) for f in feeders]])
    ks, is_rrf = np.array([[fuse_params.k]], dtype=np.float64), np.array([[fuse_params.method == "rrf"]])
    out = []
    for q in range(len(cache.dense)):
        fused = fused_scores([r[q][:k] for r, k in rankings], weights, ks, is_rrf)
        if fused is None:
            out.append([])
            continue
        keys, scores, kept = fused
        out.append([(keys[i], float(scores[0, i])) for i in fused_order(scores[0], kept[0], fuse_params.top_k)])
    return out


def decide_expansions(expansions: list[Expansion], project: Any, pairs: list[PseudoQuery], corpus: Corpus,
                      cache: Rankings, chosen: Candidate, fused: Candidate | None, spec: Any,
                      relevant: list[set[int]], top_k: int, params: Params,
                      per_query: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per expansion stage found: on (with the best settings) only if some setting beats off (the
    chosen ranking without it) significantly on the pseudo-queries (paired bootstrap, as fusion is
    decided), with the recall guard; off otherwise. Expanded are the chosen setting (when it runs
    BM25) and ``fused``, the best fused candidate with the chosen BM25 setting: an expanded BM25 may
    make a hybrid beat the single retriever chosen without it (then the expansion's pipelines get
    that fusion, the others keep the chosen one). Also the gain per pseudo-query strategy."""
    decisions: dict[str, dict[str, Any]] = {}
    depth = max(chosen.setting["depth_sparse"], *params.depths)
    for stage in EXPANSION_STAGES:
        steps = [e for e in expansions if e.stage == stage]
        if not steps:
            continue
        entry: dict[str, Any] = {"steps": [f"{e.pipeline}.{e.step}" for e in steps], "enabled": None}
        decisions[stage] = entry
        replayable = [e for e in steps if e.problem is None]
        if not replayable:
            entry["reason"] = "not decided: " + "; ".join(f"{e.pipeline}.{e.step}: {e.problem}" for e in steps)
            continue
        bases = [c for c in (chosen, fused) if c is not None and c.setting["dense_weight"] < 1.0]
        if not bases:
            entry.update(enabled=False, reason="off: the chosen ranking is dense alone and no fused one was tried")
            continue
        first = replayable[0]
        options = expansion_grid(stage, first.params, params)
        settings, option_of = [], []
        for base in list({b.name: b for b in bases}.values()):
            rankings = expanded_rankings(stage, options, first, project, [p.text for p in pairs], corpus, cache,
                                         base.setting, spec, depth)
            for p, ranking in zip(options, rankings):
                name = expansion_name(stage, p)
                setting = {**base.setting, "expansion": {"stage": stage, "name": name, **expansion_fields(stage, p)}}
                cache.sparse[sparse_key(setting)] = ranking
                settings.append(setting)
                option_of.append(p)
        candidates = score_settings(settings, cache, relevant, top_k, per_query)
        metric = params.metric
        verdict = switch_verdict(candidates, chosen, per_query, params)
        best, top, shown, low, high = verdict.best, verdict.top, verdict.shown, verdict.low, verdict.high
        entry.update(enabled=best is not chosen, off=chosen.scores, best={"name": shown.name, **shown.scores},
                     interval=[round(low, 5), round(high, 5)], interval_family=verdict.family,
                     candidates=[{"name": c.name, **c.scores, "fields": c.setting["expansion"]}
                                 for c in sorted(candidates, key=lambda c: -c.scores[metric])],
                     by_strategy=strategy_gains(pairs, per_query, shown, chosen, metric),
                     skipped=[f"{e.pipeline}.{e.step}: {e.problem}" for e in steps if e.problem])
        gain = verdict.gain
        if best is not chosen:
            changed = {k: v for k, v in best.setting.items() if k != "expansion"} != chosen.setting
            entry.update(fields=expansion_fields(stage, option_of[candidates.index(best)]), setting=best.setting,
                         fusion_changed=changed)
            entry["reason"] = (f"on: {best.name} gains {gain:+.4f} {metric} over {chosen.name} without it "
                               f"({interval_words(params, verdict.family)} {low:+.4f} to {high:+.4f})"
                               + ("; its pipelines get that fusion, the others keep the chosen one" if changed else ""))
        else:
            entry["reason"] = (f"off: no setting beats {chosen.name} without it significantly (best: {top.name}, "
                               f"{gain:+.4f} {metric}, {interval_words(params, verdict.family)} {low:+.4f} to {high:+.4f})")
    return decisions


def strategy_gains(pairs: list[PseudoQuery], per_query: dict[str, np.ndarray], candidate: Candidate,
                   off: Candidate, metric: str) -> dict[str, float]:
    """The candidate's mean gain over off on each strategy's pseudo-queries alone."""
    column = METRICS.index(metric)
    gains = per_query[candidate.name][:, column] - per_query[off.name][:, column]
    return {s: round(float(np.mean([g for g, p in zip(gains, pairs) if p.strategy == s])), 5)
            for s in sorted({p.strategy for p in pairs})}


# ----------------------------------------------------------------------------- query2doc on or off
def sample(n_pairs: int, n: int) -> list[int]:
    """``n`` pair indexes spread evenly over ``n_pairs`` (all when n >= n_pairs): a fixed, bounded sample."""
    if n >= n_pairs:
        return list(range(n_pairs))
    return sorted({int(round(i * (n_pairs - 1) / max(1, n - 1))) for i in range(n)})


def pseudo_documents(llm: LLMClient, project: Any, expansion: Expansion, queries: list[str],
                     samples: int | None = None) -> list[list[str]]:
    """The step's own pseudo-documents for each query: its prompt, its clipping, its reply length and its
    sampling (one call each; ``samples``: that many instead of the step's, at its temperature or 0.7)."""
    step = project.pipeline(expansion.pipeline).step(expansion.step)
    p = step.params
    n = p.samples if samples is None else samples
    prompts = [project.prompts.render(step.prompt, question=clip(q, p.max_request_chars), n=p.n) for q in queries]
    if n == 1:
        return llm.map(lambda text: [llm.chat(text, max_tokens=p.max_tokens, temperature=p.temperature).text.strip()],
                       prompts)
    temperature = SAMPLE_TEMPERATURE if p.temperature is None else p.temperature
    return llm.map(lambda text: [c.text.strip() for c in llm.samples(text, n, max_tokens=p.max_tokens,
                                                                     temperature=temperature)], prompts)


def query2doc_options(project: Any, expansion: Expansion, params: Params) -> list[int]:
    """The sample counts tried: the step's own, and ``query2doc_samples`` where the step has one sample
    (and a temperature that can sample)."""
    p = project.pipeline(expansion.pipeline).step(expansion.step).params
    extra = params.query2doc_samples > 1 and p.samples == 1 and p.temperature != 0
    return [p.samples] + ([params.query2doc_samples] if extra else [])


def query2doc_texts(query: str, documents: list[str], samples: int, repeats: int, agreement: float | None,
                    vspec: Any) -> str:
    """The BM25 text the rewrite step would search: the request and its one pseudo-document, or the
    terms ``agreement`` of its ``samples`` share (counted with the tuned BM25 variant's tokenizer)."""
    kept = [d for d in documents if d]
    if not kept:
        return query
    if agreement is None:
        return query2doc(query, kept[0], repeats)

    def terms(texts: list[str]) -> list[list[str]]:
        return tokenize(texts, vspec.stemmer, vspec.stopwords)

    words = agreed_terms(kept, terms, agreement, set(terms([query])[0]), samples)
    return query2doc(query, " ".join(words), repeats) if words else query


def decide_query2doc(expansions: list[Expansion], project: Any, pairs: list[PseudoQuery], corpus: Corpus,
                     cache: Rankings, chosen: Candidate, fused: Candidate | None, spec: Any,
                     relevant: list[set[int]], top_k: int, params: Params,
                     llm: LLMClient | None) -> dict[str, Any]:
    """Query2doc on (with the best ``query_repeats``) only if its BM25 query beats the chosen ranking
    without it significantly (paired bootstrap, recall guard), as the expansions are decided, on a
    bounded sample of ``query2doc_pairs`` pseudo-queries (one LLM call each). The pseudo-documents are
    the step's own (its prompt and reply length) and are searched on the tuner's index (each source
    without its cut). Only the BM25 side is replayed: a step whose text also feeds dense retrieval is
    left as the file has it."""
    steps = [e for e in expansions if e.stage == QUERY2DOC]
    entry: dict[str, Any] = {"steps": [f"{e.pipeline}.{e.step}" for e in steps], "enabled": None,
                             "skipped": [f"{e.pipeline}.{e.step}: {e.problem}" for e in steps if e.problem]}
    replayable = [e for e in steps if e.problem is None]
    if not replayable:
        entry["reason"] = "not decided: " + "; ".join(entry["skipped"])
        return entry
    if params.query2doc_pairs == 0:
        entry["reason"] = "not decided: query2doc_pairs is 0"
        return entry
    if llm is None:
        entry["reason"] = "not decided: the tuner has no openai_compatible resource (llm) to write pseudo-documents"
        return entry
    bases = [c for c in (chosen, fused) if c is not None and c.setting["dense_weight"] < 1.0]
    if not bases:
        entry.update(enabled=False, reason="off: the chosen ranking is dense alone and no fused one was tried")
        return entry
    rows = sample(len(pairs), params.query2doc_pairs)
    clock = time.perf_counter()
    counts = query2doc_options(project, replayable[0], params)
    written = {n: pseudo_documents(llm, project, replayable[0], [pairs[i].text for i in rows], n) for n in counts}
    entry.update(llm_calls=len(rows) * len(counts), llm_seconds=round(time.perf_counter() - clock, 2),
                 empty=sum(not any(d) for d in written[counts[0]]))
    depth = max(chosen.setting["depth_sparse"], *params.depths)
    sub = Rankings(docs=cache.docs, dense=[cache.dense[i] for i in rows], texts=cache.texts, tokens=cache.tokens)
    sub_relevant = [relevant[i] for i in rows]
    settings, option_of = [], []
    for base in list({b.name: b for b in bases}.values()):
        variant = variant_name(base.setting["bm25"])
        sub.sparse[variant] = [cache.sparse[variant][i] for i in rows]
        vspec = spec.model_copy(update=base.setting["bm25"])
        if vspec.stemmer not in cache.tokens:
            cache.tokens[vspec.stemmer] = tokenize(cache.texts, vspec.stemmer, spec.stopwords)
        for n, repeats in itertools.product(counts, params.query2doc_repeats):
            for agreement in (params.query2doc_agreement if n > 1 else [None]):
                texts = [query2doc_texts(pairs[i].text, d, n, repeats, agreement, vspec)
                         for i, d in zip(rows, written[n])]
                fields = {"query_repeats": repeats}
                if n > 1:
                    fields.update(samples=n, min_agreement=agreement)
                name = "query2doc " + " ".join(f"{k}={v}" for k, v in fields.items())
                setting = {**base.setting, "expansion": {"stage": QUERY2DOC, "name": name, "enabled": True, **fields}}
                sub.sparse[sparse_key(setting)] = sparse_rankings(texts, depth, cache.tokens[vspec.stemmer], vspec)
                settings.append(setting)
                option_of.append(fields)
    local: dict[str, np.ndarray] = {}
    [off] = score_settings([chosen.setting], sub, sub_relevant, top_k, local)
    candidates = score_settings(settings, sub, sub_relevant, top_k, local)
    metric = params.metric
    verdict = switch_verdict(candidates, off, local, params)
    best, top, shown, low, high, gain = (verdict.best, verdict.top, verdict.shown, verdict.low, verdict.high,
                                         verdict.gain)
    sampled = [pairs[i] for i in rows]
    entry.update(enabled=best is not off, off=off.scores, best={"name": shown.name, **shown.scores},
                 interval=[round(low, 5), round(high, 5)], interval_family=verdict.family, pairs=len(rows),
                 candidates=[{"name": c.name, **c.scores, "fields": c.setting["expansion"]}
                             for c in sorted(candidates, key=lambda c: -c.scores[metric])],
                 by_strategy=strategy_gains(sampled, local, shown, off, metric))
    where = f"on {len(rows)} pseudo-queries, {entry['llm_calls']} LLM calls"
    if best is not off:
        changed = {k: v for k, v in best.setting.items() if k != "expansion"} != chosen.setting
        entry.update(fields={"enabled": True, **option_of[candidates.index(best)]},
                     setting=best.setting, fusion_changed=changed)
        entry["reason"] = (f"on: {best.name} gains {gain:+.4f} {metric} over {chosen.name} without it "
                           f"({interval_words(params, verdict.family)} {low:+.4f} to {high:+.4f}; {where})"
                           + ("; its pipelines get that fusion, the others keep the chosen one" if changed else ""))
    else:
        entry["reason"] = (f"off: no setting beats {chosen.name} without it significantly (best: {top.name}, "
                           f"{gain:+.4f} {metric}, {interval_words(params, verdict.family)} {low:+.4f} to {high:+.4f}; "
                           f"{where})")
    return entry


# ----------------------------------------------------------------------------- context-expansion size
@dataclass(frozen=True)
class ContextStep:
    pipeline: str
    step: str
    top_k: int  # hits the step expands


def find_contexts(project: Any, targets: list[Target]) -> list[ContextStep]:
    """The expand_context steps of the tuned pipelines."""
    return [ContextStep(t.pipeline, s.id, s.params.top_k) for t in targets
            for s in project.pipeline(t.pipeline).steps if s.stage.name == "expand_context"]


def decide_context(contexts: list[ContextStep], pairs: list[PseudoQuery], corpus: Corpus, cache: Rankings,
                   chosen: Candidate, top_k: int, params: Params, state: IndexState,
                   embedder: Embedder) -> dict[str, Any]:
    """The context window (neighbours, max_tokens) by a label-free criterion. Context expansion
    changes the text of hits, not their ranking, so nDCG cannot choose it. A pseudo-query cut from
    a chunk (inverse cloze, title) is searched as the tuner ranks it (its source without the cut);
    its top hits grow as ``expand_context`` grows them (its own ``grow``, on the index state's
    neighbours and the embedder's token counts), and the query is *held* when one of its expanded
    top passages contains the chunk it was cut from. Per window: the hold rate and the tokens shown
    per query; the choice is the window with the fewest tokens whose hold rate is within
    ``context_margin`` of the best window's (neighbours 0: no expansion, when that is within it)."""
    entry: dict[str, Any] = {"steps": [f"{c.pipeline}.{c.step}" for c in contexts], "enabled": None}
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    cut = [i for i, p in enumerate(pairs) if p.cut and p.chunk_id in position]
    rows = [cut[i] for i in sample(len(cut), params.context_pairs)]
    if len(rows) < 20:
        entry["reason"] = f"not decided: {len(rows)} pseudo-queries cut from a chunk (20 or more decide it)"
        return entry
    hits_k = max(c.top_k for c in contexts)
    setting = chosen.setting
    variant = variant_name(setting["bm25"])
    weights = np.array([[setting["dense_weight"], 1 - setting["dense_weight"]]])
    ks, is_rrf = np.array([[setting["k"]]], dtype=np.float64), np.array([[setting["method"] == "rrf"]])
    tops: list[list[str]] = []
    for q in rows:
        fused = fused_scores([cache.dense[q][:setting["depth_dense"]], cache.sparse[variant][q][:setting["depth_sparse"]]],
                             weights, ks, is_rrf)
        order = [] if fused is None else [fused[0][i] for i in fused_order(fused[1][0], fused[2][0], top_k)]
        tops.append([corpus.ids[c] for c in order[:hits_k]])
    radius = max(params.context_neighbours)
    around = state.neighbourhoods(sorted({cid for top in tops for cid in top}), radius)
    texts = {cid: text for found in around.values() for cid, _, text in found}
    tokens = dict(zip(texts, token_counts(embedder, list(texts.values()))))
    options = []
    for neighbours, budget in itertools.product(sorted(set(params.context_neighbours)),
                                                sorted(set(params.context_tokens))):
        if neighbours == 0 and budget != min(params.context_tokens):
            continue  # no neighbours: every budget shows the hits alone
        held, spent = 0, 0
        for q, top in zip(rows, tops):
            shown: set[str] = set()
            inside = False
            for hit in top:
                if hit in shown:
                    continue
                found = around.get(hit) or [(hit, 0, "")]
                ordinal = next(o for cid, o, _ in found if cid == hit)
                near = [r for r in found if abs(r[1] - ordinal) <= neighbours]
                window = [near[i][0] for i in grow(near, hit, tokens, shown, budget)]
                shown.update(window)
                spent += sum(tokens.get(cid, 0) for cid in window)
                inside = inside or pairs[q].chunk_id in window
            held += inside
        options.append({"neighbours": neighbours, "max_tokens": budget, "hold": round(held / len(rows), 4),
                        "tokens": round(spent / len(rows), 1)})
    best = max(o["hold"] for o in options)
    pick = min((o for o in options if o["hold"] >= best - params.context_margin),
               key=lambda o: (o["tokens"], o["neighbours"], o["max_tokens"]))
    entry.update(enabled=pick["neighbours"] > 0, options=options, chosen=pick, pairs=len(rows),
                 fields={"neighbours": pick["neighbours"], "max_tokens": pick["max_tokens"]})
    plain = next((o for o in options if o["neighbours"] == 0), None)
    versus = (f"; no expansion holds {plain['hold']:.1%} with {plain['tokens']:.0f}" if plain and plain is not pick
              else "")
    entry["reason"] = (f"neighbours {pick['neighbours']}, max_tokens {pick['max_tokens']}: its top {hits_k} passages "
                       f"hold the source chunk of {pick['hold']:.1%} of {len(rows)} pseudo-queries with "
                       f"{pick['tokens']:.0f} tokens per query, the fewest within {params.context_margin:g} of the "
                       f"best window ({best:.1%}){versus}")
    return entry
