"""The fusion candidates, each scored on the cached rankings exactly as ``fuse`` and ``eval`` rank."""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytrec_eval

from ragline.flows.contracts import Candidate
from ragline.tasks.retrieve.fuse import fused_order, fused_scores
from ragline.tasks.jobs.tune_retrieval.params import METRICS, Params
from ragline.tasks.jobs.tune_retrieval.rankings import Rankings, bm25_variants, variant_name


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
