"""The tuner decides query expansion (``expand_prf``, ``expand_terms``) without labels: on, with the
settings that win, only where expansion beats off significantly on the pseudo-queries, over real
BM25 (bm25s) indexes built here; the stages replay on the tuner's index exactly as on the published
one; the overlay turns an opt-in step on."""
from __future__ import annotations

import hashlib
import random

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document, PseudoQuery, Query, TuneReport
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec, tokenize
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.overlay import write_overlay
from ragline.tasks.jobs import tune_retrieval as tr
from ragline.tasks.rewrite.expand_prf import Params as PrfParams
from ragline.tasks.rewrite.expand_prf import expand_prf
from ragline.tasks.rewrite.expand_terms import Params as TermsParams
from ragline.tasks.rewrite.expand_terms import expand_terms
from ragline.tasks.retrieve.dense import Params as RetrieveParams
from ragline.tasks.retrieve.sparse import retrieve_sparse
from tests.helpers.data import REPO, SEARCH_TERMS, index_and_search_yaml

SPEC = BM25Spec(type="bm25", path="bm25")
BM25 = {"k1": SPEC.k1, "b": SPEC.b, "stemmer": SPEC.stemmer}

EXPANDED_YAML = index_and_search_yaml() + SEARCH_TERMS + """  search_prf:
    kind: query
    steps:
      - {id: first_dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: first_sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: top,    task: fuse, after: [first_dense, first_sparse], with: {top_k: 10}}
      - {id: prf,    task: expand_prf, with: {enabled: false, dense: false}}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [prf]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
  search_prf_dense:
    kind: query
    steps:
      - {id: first, task: retrieve_sparse, with: {k: 20}}
      - {id: top,   task: fuse, with: {top_k: 10}}
      - {id: prf,   task: expand_prf}
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: [prf]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "pipelines.yaml").write_text(EXPANDED_YAML)
    (tmp_path / "prompts").symlink_to(REPO / "prompts")
    return load_project(tmp_path / "pipelines.yaml", tuned=False)


def filler(rng: random.Random, n: int) -> str:
    return " ".join(f"filler{rng.randrange(400)}" for _ in range(n))


def bridged_corpus(bridges: int) -> tuple[list[tuple[str, str, dict]], list[PseudoQuery]]:
    """Per topic, a target document that says its topic in other words (``syn``) than the query
    (``word``); with ``bridges``, documents holding both words: the only way to the target is a term
    that goes with the query's words in its top passages. Without bridges, the target holds the
    query's own word and BM25 finds it first. Queries name their target as relevant."""
    rng = random.Random(7)
    rows, pairs = [], []
    for topic in range(24):
        word, syn = f"alpha{topic}", f"omega{topic}"
        target = f"doc{topic:02d}t"
        text = f"{syn} {syn} {filler(rng, 20)}" if bridges else f"{word} {word} {filler(rng, 20)}"
        rows.append((f"{target}#0", text, {"source_id": target}))
        for b in range(bridges):
            rows.append((f"doc{topic:02d}b{b}#0", f"{word} {syn} {filler(rng, 20)}", {"source_id": f"doc{topic:02d}b{b}"}))
        for d in range(3):  # the query's word once among other words
            rows.append((f"doc{topic:02d}d{d}#0", f"{word} {filler(rng, 30)}", {"source_id": f"doc{topic:02d}d{d}"}))
        pairs.append(PseudoQuery(text=f"{word} claim", source_id=target,
                                 chunk_id=f"{target}#0", strategy="keywords"))
    return rows, pairs


def decide(project, rows, pairs, chosen_alpha=0.0, **params):
    corpus = tr.Corpus.from_rows(rows)
    cache = tr.Rankings(docs=corpus.docs, dense=[[] for _ in pairs], texts=list(corpus.texts))
    cache.tokens[SPEC.stemmer] = tokenize(cache.texts, SPEC.stemmer, SPEC.stopwords)
    cache.sparse[tr.variant_name(BM25)] = tr.sparse_rankings([p.text for p in pairs], 20, cache.tokens[SPEC.stemmer],
                                                             SPEC)
    relevant = [{corpus.doc_index[p.source_id]} for p in pairs]
    per_query: dict = {}
    single = {"method": "rrf", "k": 60, "dense_weight": chosen_alpha, "depth_dense": 20, "depth_sparse": 20,
              "bm25": BM25}
    [chosen, fused] = tr.score_settings([single, {**single, "dense_weight": 0.5}], cache, relevant, 20, per_query)
    tuning = tr.Params(depths=[20], prf_docs=[3], prf_terms=[5, 10], prf_query_weight=[0.5],
                       related_terms=[5, 10], related_weight=[0.3, 0.5], bootstrap=500, **params)
    targets = tr.find_targets(project, ["search_terms", "search_prf", "search_prf_dense"], {
        "store": "store", "embedder": "embedder", "sparse": "sparse"})
    expansions = tr.find_expansions(project, targets)
    return chosen, tr.decide_expansions(expansions, project, pairs, corpus, cache, chosen, fused, SPEC, relevant, 20,
                                        tuning, per_query)


def overlay_of(project, targets, chosen, decisions):
    steps, own = tr.expansion_entries(tr.find_expansions(project, targets), decisions)
    return tr.overlay_entries(project, targets, chosen.setting, expansions=steps, own_settings=own)


def test_expansion_is_turned_on_where_it_finds_what_the_query_words_miss(project):
    rows, pairs = bridged_corpus(bridges=3)
    chosen, decisions = decide(project, rows, pairs)
    assert chosen.scores["recall@100"] == 0  # BM25 alone never reaches a target: it lacks the query's words
    for stage in ("expand_terms", "expand_prf"):
        decision = decisions[stage]
        assert decision["enabled"] is True, decision["reason"]
        assert decision["interval"][0] > 0 and decision["best"]["ndcg@10"] > chosen.scores["ndcg@10"]
        assert decision["fields"]["enabled"] is True
    assert set(decisions["expand_terms"]["fields"]) == {"enabled", "terms", "weight"}
    assert set(decisions["expand_prf"]["fields"]) == {"enabled", "docs", "terms", "query_weight"}
    assert decisions["expand_prf"]["steps"] == ["search_prf.prf", "search_prf_dense.prf"]
    assert "dense: true" in decisions["expand_prf"]["skipped"][0]  # replayed where it can be only


def test_expansion_stays_off_where_bm25_already_finds_the_source(project):
    rows, pairs = bridged_corpus(bridges=0)
    chosen, decisions = decide(project, rows, pairs)
    assert chosen.scores["ndcg@10"] == 1.0
    for stage in ("expand_terms", "expand_prf"):
        assert decisions[stage]["enabled"] is False and decisions[stage]["reason"].startswith("off:")
        assert "fields" not in decisions[stage]


def test_the_overlay_turns_an_opt_in_expansion_on_and_an_unreplayable_step_is_left_alone(project):
    rows, pairs = bridged_corpus(bridges=3)
    chosen, decisions = decide(project, rows, pairs)
    targets = tr.find_targets(project, ["search_terms", "search_prf", "search_prf_dense"], {
        "store": "store", "embedder": "embedder", "sparse": "sparse"})
    assert [(t.fuse, t.sparse) for t in targets] == [("fuse", "sparse")] * 3  # the last fuse: the pipeline's output
    entries = overlay_of(project, targets, chosen, decisions)
    assert "prf" not in entries["pipelines"]["search_prf_dense"]  # dense: true is not replayed: the file's stays
    report = TuneReport(metric="ndcg@10", pairs=len(pairs), chosen=chosen, baseline=chosen, overrides=entries,
                        expansions=decisions)
    write_overlay(project, project.base_dir / "pipelines.tuned.yaml", report)
    tuned = load_project(project.path, tuned=True)
    terms = tuned.pipeline("search_terms").step("terms").params
    assert terms.enabled and (terms.terms, terms.weight) == (decisions["expand_terms"]["fields"]["terms"],
                                                             decisions["expand_terms"]["fields"]["weight"])
    assert tuned.pipeline("search_prf").step("prf").params.enabled
    assert not load_project(project.path, tuned=False).pipeline("search_terms").step("terms").params.enabled
    assert any("search_terms, step terms: enabled False -> True" in c for c in tuned.overlay.changes)


def test_an_expansion_that_makes_a_hybrid_win_over_dense_alone_brings_its_fusion_to_its_pipelines_only(project):
    """Dense alone was chosen without expansion (BM25 alone finds nothing here); the expanded BM25
    fused with it wins: the expansion's pipelines get that fusion, the others keep dense alone."""
    rows, pairs = bridged_corpus(bridges=3)
    chosen, decisions = decide(project, rows, pairs, chosen_alpha=1.0)
    terms = decisions["expand_terms"]
    assert terms["enabled"] and terms["fusion_changed"] and terms["setting"]["dense_weight"] == 0.5
    targets = tr.find_targets(project, ["search_terms", "search_prf", "search_prf_dense"], {
        "store": "store", "embedder": "embedder", "sparse": "sparse"})
    entries = overlay_of(project, targets, chosen, decisions)
    pipelines = entries["pipelines"]
    assert pipelines["search_terms"]["fuse"]["weights"] == {"dense": 0.5, "sparse": 0.5}
    assert pipelines["search_terms"]["terms"]["enabled"] is True
    assert pipelines["search_prf_dense"]["fuse"]["weights"] == {"dense": 1.0, "sparse": 0.0}  # not replayed: chosen
    assert entries["resources"]["sparse"] == BM25  # one BM25 setting for every pipeline


def test_off_writes_enabled_false_and_a_disabled_step_passes_the_query_unchanged(project, tmp_path):
    rows, pairs = bridged_corpus(bridges=0)
    chosen, decisions = decide(project, rows, pairs)
    targets = tr.find_targets(project, ["search_terms"], {"store": "store", "embedder": "embedder", "sparse": "sparse"})
    entries = overlay_of(project, targets, chosen, decisions)
    assert entries["pipelines"]["search_terms"]["terms"] == {"enabled": False}
    query = Query(text="alpha1 omega1")
    ctx = StepContext(pipeline="p", step_id="x")
    assert expand_terms.fn(query=query, params=TermsParams(enabled=False), ctx=ctx, sparse=None) is query
    assert expand_prf.fn(query=query, passages=[], params=PrfParams(enabled=False), sparse=None) is query


def test_the_tuners_index_replays_the_stages_as_the_published_index_runs_them(tmp_path):
    """The same related terms, feedback and weighted ranking from ``MemoryBM25`` as from a published
    BM25 index of the same chunks."""
    rows, pairs = bridged_corpus(bridges=3)
    chunks = [Chunk(chunk_id=hashlib.sha256(cid.encode()).hexdigest()[:32], source_id=meta["source_id"], ordinal=0,
                    text=text) for cid, text, meta in rows]
    chunks.sort(key=lambda c: c.chunk_id)
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=tmp_path)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    published = BM25Index(SPEC, base_dir=tmp_path)
    published.sync(state)
    texts = [c.text for c in chunks]
    memory = tr.MemoryBM25(SPEC, [c.chunk_id for c in chunks], texts, tokenize(texts, SPEC.stemmer, SPEC.stopwords))
    ctx = StepContext(pipeline="p", step_id="terms")
    try:
        for pair in pairs[:6]:
            query = Query(text=pair.text)
            params = TermsParams(terms=5, weight=0.3)
            ours = expand_terms.fn(query=query, params=params, ctx=ctx, sparse=memory)
            theirs = expand_terms.fn(query=query, params=params, ctx=ctx, sparse=published)
            assert ours.feedback == theirs.feedback and ours.feedback is not None
            [ranking] = retrieve_sparse.fn(query=theirs, params=RetrieveParams(k=10), ctx=ctx, sparse=published,
                                           state=state)
            [replayed] = memory.search_weighted([ours.feedback.weighted(memory.terms([pair.text])[0])], 10)
            assert [p.chunk_id for p in ranking.passages] == [cid for cid, _, _ in replayed]
            assert [p.score for p in ranking.passages] == pytest.approx([s for _, s, _ in replayed], rel=1e-5)
            first = [p for p in ranking.passages]
            prf = PrfParams(docs=3, terms=5, dense=False)
            assert expand_prf.fn(query=query, passages=first, params=prf, sparse=memory).feedback == \
                expand_prf.fn(query=query, passages=first, params=prf, sparse=published).feedback
    finally:
        state.close()
