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

The stage (this module) reads one published state and runs its parts in turn: ``targets`` (the
pipelines it serves, their overlay entries), ``rankings``, ``grid`` and ``choice`` (the fusion
setting), ``gate``, ``expansion``, ``query2doc`` and ``context``; ``params`` says what it tries.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ragline.flows.context import StepContext
from ragline.flows.contracts import PseudoQuery, TuneReport
from ragline.flows.errors import MissingResource
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.stores.state import IndexState
from ragline.tasks.generate.answerable import kept_floor
from ragline.tasks.retrieve.sparse import LEASE_STALE_SECONDS
from ragline.flows.resources.stores.protocols import DenseStore, SparseIndex
from ragline.tasks.jobs.tune_retrieval.choice import (
    by_strategy, choose, gain_intervals, is_single, simultaneous_intervals, summary, switch_verdict,
)
from ragline.tasks.jobs.tune_retrieval.context import decide_context, find_contexts
from ragline.tasks.jobs.tune_retrieval.expansion import (
    MemoryBM25, QUERY2DOC, decide_expansions, expansion_entries, find_expansions,
)
from ragline.tasks.jobs.tune_retrieval.gate import (
    auc, calibrate_gate, closest_of_other_documents, gate_probabilities, gate_similarities,
)
from ragline.tasks.jobs.tune_retrieval.grid import grid, score_settings, setting_name
from ragline.tasks.jobs.tune_retrieval.params import GATE_DOCUMENTS, METRICS, Params
from ragline.tasks.jobs.tune_retrieval.query2doc import decide_query2doc
from ragline.tasks.jobs.tune_retrieval.rankings import (
    Corpus, Rankings, rank_pairs, rank_queries, sparse_rankings, variant_name,
)
from ragline.tasks.jobs.tune_retrieval.targets import Target, current_setting, find_targets, overlay_entries

# the tuner's parts, as the tests and benches use them
__all__ = [
    "Corpus", "GATE_DOCUMENTS", "METRICS", "MemoryBM25", "Params", "Rankings", "Target", "auc", "choose",
    "closest_of_other_documents", "consistent_read", "current_setting", "decide_context", "decide_expansions",
    "decide_query2doc", "expansion_entries", "find_contexts", "find_expansions", "find_targets",
    "gain_intervals", "gate_similarities", "overlay_entries", "rank_queries", "reads_roles", "score_settings",
    "setting_name", "simultaneous_intervals", "sparse_rankings", "summary", "switch_verdict", "tune_retrieval",
    "variant_name",
]


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
            raise MissingResource("gate_llm_pairs needs an openai_compatible resource (llm) in the file, or set it to 0")
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
