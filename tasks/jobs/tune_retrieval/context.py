"""The ``expand_context`` window, chosen by how often the expanded passages hold a pseudo-query's cut
chunk per token shown."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragline.flows.contracts import Candidate, PseudoQuery
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.state import IndexState
from ragline.tasks.refine.expand_context import grow, token_counts
from ragline.tasks.retrieve.fuse import fused_order, fused_scores
from ragline.tasks.jobs.tune_retrieval.params import Params
from ragline.tasks.jobs.tune_retrieval.query2doc import sample
from ragline.tasks.jobs.tune_retrieval.rankings import Corpus, Rankings, variant_name
from ragline.tasks.jobs.tune_retrieval.targets import Target


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
