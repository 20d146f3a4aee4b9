"""Query expansion with related terms: words that mean or go with the request's words, added to the
keyword (BM25) query with a weight, so passages that say the same thing in other words are found.

``mode: corpus`` takes the terms from the corpus's own co-occurrence statistics, as local context
analysis does (Xu & Croft, 1996): among the passages BM25 ranks highest for the request, a term
scores by how often it occurs together with *each* of the request's terms, scaled by its rarity in
the whole index, so a term that goes with all of them beats one frequent in the top passages (what
RM3 feedback, ``expand_prf``, takes). ``mode: llm`` asks the LLM for synonyms and related terms
(``prompts/expand_terms.j2``). Either way the terms become the query's ``feedback``, which
``retrieve_sparse`` scores as a weighted query (``weight`` for the terms, the rest for the request's
own); with ``dense`` the request followed by the terms is also a second dense query. Terms are the
BM25 index's own (its stemmer and stop words); the index is only read.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Feedback, Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, strip_markup
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.flows.spec.registry import stage
from ragline.tasks.rewrite.expand_prf import surface_forms
from ragline.tasks.retrieve.dense import combined_filter

DELTA = 0.1  # LCA's floor, so a term that never meets one query term is not zeroed by it
_LIST_ITEM = re.compile(r"^\s*(?:[-*•]|\d+[.)])?\s*(.*?)\s*$")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: the query passes unchanged (a step `ragline tune` turns on, "
                                            "with its terms and weight, where it helps on the corpus)")
    mode: Literal["corpus", "llm"] = Field("corpus", description="corpus: terms co-occurring with the request's "
                                                                 "terms in its top BM25 passages; llm: synonyms and "
                                                                 "related terms the LLM proposes")
    # defaults: the best of `ragline tune`'s grid on SciFact's pseudo-queries, no labels (bench/expansion_tuning.py;
    # no setting beat off significantly there: where a corpus needs more, the tuner sets it)
    terms: int = Field(30, ge=1, le=50, description="related terms added")
    weight: float = Field(0.1, gt=0, lt=1, description="share of the added terms in the keyword query (the "
                                                       "request's own terms keep the rest)")
    docs: int = Field(10, ge=2, le=200, description="corpus: top passages the co-occurrences are counted in")
    dense: bool = Field(False, description="also give dense retrieval the request followed by the terms")
    max_tokens: int = Field(48, ge=8, le=512, description="llm: length of the reply")
    max_request_chars: int = Field(1000, ge=100, description="llm: longer requests are clipped in the prompt")


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM only in mode llm, when the step is on (``--set`` or the tuned overlay
    that turns it on binds it then, or says the file has none)."""
    if params.enabled and params.mode == "llm":
        return {"llm": ("mode", "mode 'llm' asks the LLM for related terms")}
    return {}


@stage("expand_terms", params=Params, produces="query", kind="query",
       uses={"sparse": ("bm25", "milvus"), "llm": ("openai_compatible",)}, reads_roles=reads_roles,
       prompt=lambda p: "expand_terms" if p is not None and p.mode == "llm" else None,
       prompt_variables=("question", "n"))
def expand_terms(query: Query, params: Params, ctx: StepContext, sparse: SparseIndex,
                 llm: LLMClient | None = None) -> Query:
    """Add related terms (from the corpus's co-occurrences or the LLM) to the keyword query."""
    if not params.enabled:
        return query
    own = set(sparse.terms([query.text])[0])
    if params.mode == "llm":
        if llm is None:
            raise MissingResource("mode 'llm' needs an openai_compatible resource: add one and name it in `uses`")
        related, written = llm_terms(query, own, params, ctx, llm, sparse)
    else:
        related, written = corpus_terms(query, own, params, sparse)
    if not related:
        ctx.logger.info("no related terms found: the query is searched as it is")
        return query
    ctx.logger.info("expanded with %s", ", ".join(written.get(t, t) for t in related))
    return with_terms(query, related, written, params)


def with_terms(query: Query, related: dict[str, float], written: dict[str, str], params: Params) -> Query:
    """The query with ``related`` terms as its keyword feedback (the tuner replays it on its own index)."""
    mass = sum(related.values())
    text = " ".join([query.text, *(written.get(t, t) for t in related)]) if params.dense else ""
    return query.model_copy(update={"feedback": merged(query.feedback, Feedback(
        terms={t: w / mass for t, w in related.items()}, query_weight=1 - params.weight, text=text))})


def corpus_terms(query: Query, own: set[str], params: Params,
                 sparse: SparseIndex) -> tuple[dict[str, float], dict[str, str]]:
    """LCA: f(t) = prod over query terms q of (DELTA + co_degree(t, q)) ** idf(q), where
    co_degree(t, q) = log10(co(t, q) + 1) * idf(t) / log10(n) and co(t, q) = sum over the top n
    passages of tf(t) * tf(q): terms that meet every query term in the top passages, and are rare."""
    where = combined_filter(None, query.filters, query.access)  # counted only in passages the query may read
    [hits] = sparse.search([query.text], params.docs, where=where)
    texts = [str(meta.get("text", "")) for _, score, meta in hits if score > 0]
    if len(texts) < 2 or not own:
        return {}, {}
    counts = [Counter(terms) for terms in sparse.terms(texts)]
    candidates = {t for c in counts for t in c if t not in own and len(t) > 2 and not t.isdigit()}
    frequencies, total = sparse.document_frequencies(candidates | own)
    idf = {t: min(1.0, math.log10(total / df) / 5) for t, df in frequencies.items()}
    query_terms = [q for q in own if idf.get(q, 0) > 0]
    if not query_terms:
        return {}, {}
    scale = math.log10(len(texts))
    meeting = {q: [(c, c[q]) for c in counts if c[q]] for q in query_terms}  # the passages holding q
    scores = {}
    for term in candidates:
        if idf.get(term, 0) <= 0:
            continue
        score = 1.0
        for q in query_terms:
            co = sum(c[term] * tf for c, tf in meeting[q])
            score *= (DELTA + math.log10(co + 1) * idf[term] / scale) ** idf[q]
        scores[term] = score
    floor = DELTA ** sum(idf[q] for q in query_terms)  # what a term meeting no query term scores
    top = sorted(((t, s) for t, s in scores.items() if s > floor), key=lambda item: (-item[1], item[0]))
    related = dict(top[: params.terms])
    return related, surface_forms(texts, sparse) if params.dense else {}


def llm_terms(query: Query, own: set[str], params: Params, ctx: StepContext, llm: LLMClient,
              sparse: SparseIndex) -> tuple[dict[str, float], dict[str, str]]:
    """The LLM's synonyms and related terms, one per line or comma-separated, as index terms: each
    proposal weighs the same, shared by its terms; terms the index lacks or the request has are left out."""
    prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), n=params.terms)
    reply = strip_markup(llm.chat(prompt, max_tokens=params.max_tokens).text)
    proposals = [m.group(1) for part in re.split(r"[,;\n]", reply) if (m := _LIST_ITEM.match(part)) and m.group(1)]
    proposals = list(dict.fromkeys(p.strip(" .\"'") for p in proposals))
    stems = sparse.terms(proposals) if proposals else []
    known, _ = sparse.document_frequencies({t for terms in stems for t in terms})
    related: dict[str, float] = {}
    written: dict[str, str] = {}
    for proposal, terms in zip(proposals, stems):
        fresh = [t for t in dict.fromkeys(terms) if t in known and t not in own and t not in related]
        for term in fresh:
            related[term] = 1 / len(fresh)
            written[term] = proposal if len(fresh) == 1 else term
        if len({written[t] for t in related}) >= params.terms:
            break
    return related, written


def merged(earlier: Feedback | None, added: Feedback) -> Feedback:
    """The added terms beside feedback an earlier step made (``expand_prf``): the two term models
    averaged, the request's own share the smaller of the two."""
    if earlier is None or not earlier.terms:
        return added
    terms = {t: (earlier.terms.get(t, 0) + added.terms.get(t, 0)) / 2 for t in {*earlier.terms, *added.terms}}
    return Feedback(terms=terms, query_weight=min(earlier.query_weight, added.query_weight),
                    text=earlier.text or added.text)
