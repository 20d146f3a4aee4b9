"""Query2doc (a ``rewrite`` step in mode hyde on the BM25 side) decided on the step's own pseudo-documents."""
from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from ragline.flows.contracts import Candidate, PseudoQuery
from ragline.flows.resources.stores.bm25 import tokenize
from ragline.flows.resources.models.llm import LLMClient
from ragline.tasks.rewrite.rewrite import SAMPLE_TEMPERATURE, agreed_terms, query2doc
from ragline.flows.resources.models.llm_output import clip
from ragline.tasks.jobs.tune_retrieval.choice import interval_words, strategy_gains, switch_verdict
from ragline.tasks.jobs.tune_retrieval.expansion import Expansion, QUERY2DOC
from ragline.tasks.jobs.tune_retrieval.grid import score_settings, sparse_key
from ragline.tasks.jobs.tune_retrieval.params import Params
from ragline.tasks.jobs.tune_retrieval.rankings import Corpus, Rankings, sparse_rankings, variant_name


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
