"""Query expansion (``expand_prf``, ``expand_terms``) replayed on an in-memory BM25 index and turned on
only for a significant gain."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragline.flows.contracts import Candidate, PseudoQuery
from ragline.flows.resources.stores.bm25 import LegacyVersion, in_memory, tokenize
from ragline.tasks.rewrite.expand_prf import with_feedback
from ragline.tasks.rewrite.expand_terms import corpus_terms, with_terms
from ragline.tasks.retrieve.fuse import fused_order, fused_scores
from ragline.flows.contracts import Passage, Query
from ragline.tasks.jobs.tune_retrieval.choice import interval_words, strategy_gains, switch_verdict
from ragline.tasks.jobs.tune_retrieval.grid import score_settings, sparse_key
from ragline.tasks.jobs.tune_retrieval.params import Params
from ragline.tasks.jobs.tune_retrieval.rankings import Corpus, Rankings, variant_name
from ragline.tasks.jobs.tune_retrieval.targets import Target


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
