"""The milvus engine (embedded milvus-lite, Milvus's own engine) as the sparse index every stage reads:
BM25 ranks and scores as the bm25 index does (analyzer ``ragline``: ragline's terms, Milvus's BM25), the
term statistics expansion reads (terms, document frequencies, weighted searches, filtered counts) agree,
and self_query, expand_terms, expand_prf, FLARE, adapt's hard negatives and tune run on it. A
collection made with other BM25 settings is refused for writing and rebuilt from its own rows."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from ragline.flows import cli  # noqa: E402
from ragline.flows.context import StepContext  # noqa: E402
from ragline.flows.contracts import Chunk, Context, ContextDocument, Document, Passage, PseudoQuery, Query  # noqa: E402
from ragline.flows.errors import InputError  # noqa: E402
from ragline.flows.resources import clear_cache  # noqa: E402
from ragline.flows.resources.stores.bm25 import BM25Index, BM25Spec  # noqa: E402
from ragline.flows.resources.models.llm import LLMClient, LLMSpec  # noqa: E402
from ragline.flows.resources.stores.milvus import MilvusSpec, MilvusStore  # noqa: E402
from ragline.flows.resources.stores.state import IndexState, StateSpec  # noqa: E402
from ragline.flows.run import engine  # noqa: E402
from ragline.flows.spec.compile import load_project  # noqa: E402
from ragline.flows.spec.prompts import PromptLibrary  # noqa: E402
from ragline.tasks.jobs import adapt_embedder as ae  # noqa: E402
from ragline.tasks.rewrite.expand_prf import Params as PrfParams  # noqa: E402
from ragline.tasks.rewrite.expand_prf import expand_prf  # noqa: E402
from ragline.tasks.rewrite.expand_terms import Params as TermsParams  # noqa: E402
from ragline.tasks.rewrite.expand_terms import expand_terms  # noqa: E402
from ragline.tasks.generate.flare import Params as FlareParams  # noqa: E402
from ragline.tasks.generate.flare import generate_flare  # noqa: E402
from ragline.tasks.retrieve.dense import Params as RetrieveParams  # noqa: E402
from ragline.tasks.retrieve.sparse import retrieve_sparse  # noqa: E402
from ragline.tasks.rewrite.self_query import Params as SelfQueryParams  # noqa: E402
from ragline.tasks.rewrite.self_query import self_query  # noqa: E402
from ragline.tasks.jobs.tune_retrieval import Corpus  # noqa: E402
from tests.helpers.data import scifact_records, write_jsonl  # noqa: E402
from tests.helpers.llm_stages import REPO_PROMPTS  # noqa: E402
from tests.scripted_llm import ScriptedLLM  # noqa: E402
from tests.helpers.tuning import TUNE_YAML, judged  # noqa: E402

pytestmark = pytest.mark.integration

CLAIMS = ["Vitamin D deficiency increases the risk of tuberculosis.",
          "Stem cells maintain telomerase activity",
          "il_6 levels in blood",  # an underscore: a LIKE wildcard unless escaped (il26 must not match)
          "the of and"]  # stop words only: no terms, no hits
CTX = StepContext(pipeline="p", step_id="s")


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, minilm):
    """150 SciFact abstracts (one chunk each, a year in their metadata) in a milvus collection and, from
    an index state holding the same chunks, in a bm25 index."""
    folder = tmp_path_factory.mktemp("milvus-stages")
    records = scifact_records(150)
    texts = [f"{r['title']}\n{r['text']}" for r in records]
    texts += ["Interleukin il_6 in serum.", "Serum il26 was measured."]
    vectors = np.random.default_rng(0).normal(size=(len(texts), minilm.dimension)).astype(np.float32)  # BM25's test
    chunks = [Chunk(chunk_id=hashlib.sha256(t.encode()).hexdigest()[:32], source_id=f"doc{i}", ordinal=0, text=t,
                    title=t.split("\n")[0][:60], metadata={"year": 2000 + i % 10}, embedding=v.tolist())
              for i, (t, v) in enumerate(zip(texts, vectors))]
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=folder)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    bm25 = BM25Index(BM25Spec(type="bm25", path="bm25"), base_dir=folder)
    bm25.sync(state)
    milvus = MilvusStore(MilvusSpec(type="milvus", uri="m.db", collection="sci"), folder)
    milvus.upsert(chunks)
    milvus.sync(state)
    yield milvus, bm25, state
    milvus.close()
    state.close()


def test_bm25_ranks_and_scores_as_the_bm25_index(indexes):
    milvus, bm25, _ = indexes
    for where in (None, {"year": {"$gte": 2005}}):
        got, expected = milvus.search(CLAIMS, 20, where=where), bm25.search(CLAIMS, 20, where=where)
        for hits, want in zip(got, expected):
            assert [h[0] for h in hits] == [h[0] for h in want]
            assert [h[1] for h in hits] == pytest.approx([h[1] for h in want], rel=1e-4)  # the same function
            assert all(h[2]["text"] == w[2]["text"] and h[2]["year"] == w[2]["year"] for h, w in zip(hits, want))
    assert milvus.search([CLAIMS[3]], 5) == [[]] and milvus.search(CLAIMS[2:3], 5)[0]


def test_terms_frequencies_counts_and_weighted_search_as_the_bm25_index(indexes):
    milvus, bm25, _ = indexes
    assert milvus.terms(CLAIMS) == bm25.terms(CLAIMS)
    terms = {t for ts in bm25.terms(CLAIMS) for t in ts} | {"zzzunknown", "il26", "il_6"}
    assert milvus.document_frequencies(terms) == bm25.document_frequencies(terms)
    assert milvus.document_frequencies(["il_6"]) == ({"il_6": 1}, 152)  # `_` escaped: il26 does not match
    for where in (None, {"year": 2003}, {"year": {"$in": []}}):
        assert milvus.count(where) == bm25.count(where)
    weighted = [{"vitamin": 0.5, "tuberculosi": 0.3, "deficiency": 0.2}, {"telomeras": 1.0, "nothere": 2.0}, {}]
    for where in (None, {"year": {"$lt": 2004}}):
        got, expected = milvus.search_weighted(weighted, 10, where), bm25.search_weighted(weighted, 10, where)
        for hits, want in zip(got, expected):
            assert [h[0] for h in hits] == [h[0] for h in want]
            assert [h[1] for h in hits] == pytest.approx([h[1] for h in want], rel=1e-4)


def test_self_query_counts_its_filter_on_milvus(indexes):
    milvus, bm25, _ = indexes
    params = SelfQueryParams(fields={"year": {"type": "int", "min": 1900, "max": 2100}}, fallback="unfiltered")
    for sparse in (milvus, bm25):
        kept = self_query.fn(query=Query(text="studies from 2003 on vitamin D"), params=params, ctx=CTX, sparse=sparse)
        assert kept.filters == {"year": {"$eq": 2003}}
        dropped = self_query.fn(query=Query(text="studies from 1950 on vitamin D"), params=params, ctx=CTX,
                                sparse=sparse)
        assert dropped.filters is None  # no chunk of 1950: searched without it


def test_expand_terms_and_prf_expand_on_milvus_as_on_bm25(indexes):
    milvus, bm25, state = indexes
    query = Query(text=CLAIMS[0])
    terms = [expand_terms.fn(query=query, params=TermsParams(terms=10), ctx=CTX, sparse=s) for s in (milvus, bm25)]
    assert terms[0].feedback is not None
    assert terms[0].feedback.terms == pytest.approx(terms[1].feedback.terms, rel=1e-4)

    def expanded(sparse):
        [first] = retrieve_sparse.fn(query=query, params=RetrieveParams(k=10), ctx=CTX, sparse=sparse, state=state)
        out = expand_prf.fn(query=query, passages=first.passages, params=PrfParams(docs=5, terms=8), sparse=sparse)
        [second] = retrieve_sparse.fn(query=out, params=RetrieveParams(k=10), ctx=CTX, sparse=sparse, state=state)
        return out.feedback, [p.chunk_id for p in second.passages]

    (on_milvus, ranked), (on_bm25, ranked_bm25) = expanded(milvus), expanded(bm25)
    assert on_milvus.terms == pytest.approx(on_bm25.terms, rel=1e-4) and on_milvus.text == on_bm25.text
    assert ranked == ranked_bm25 and ranked


def test_flare_retrieves_from_milvus(indexes, minilm):
    milvus, _, _ = indexes
    context = Context(documents=[ContextDocument(number=1, passage=Passage(chunk_id="x", source_id="x", text="x"))])
    with ScriptedLLM(lambda p: "Vitamin D deficiency raises tuberculosis risk [2].", logprob=math.log(0.5)) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="t", step_id="flare", prompt_name="flare_continue",
                          render_prompt=PromptLibrary(REPO_PROMPTS).render)
        answer = generate_flare.fn(query=Query(text=CLAIMS[0]), context=context,
                                   params=FlareParams(threshold=0.9, k=2, max_sentences=1), ctx=ctx, llm=llm,
                                   store=milvus, embedder=minilm)
    assert answer.retrievals == 1
    assert {d.chunk_id for d in answer.sources} & milvus.all_ids()  # passages the engine returned


def test_adapt_mines_the_same_hard_negatives_from_a_milvus_spec(indexes):
    milvus, bm25, state = indexes
    corpus = Corpus.from_state(state)
    pairs = [PseudoQuery(text=CLAIMS[i], source_id=str(meta["source_id"]), chunk_id=cid, strategy="keywords")
             for i, (cid, _, meta) in enumerate(state.chunk_rows()[:3])]
    got, expected = (ae.training_rows(pairs, corpus, s.spec, 3, 0, 0) for s in (milvus, bm25))
    assert got.anchors and vars(got) == vars(expected)


def test_other_bm25_settings_are_refused_for_writing_then_rebuilt_from_the_rows(tmp_path):
    """A collection made by Milvus's own english analyzer (before analyzer `ragline`): queries and writes
    refuse it naming both settings; sync (ingestion's integrity repair, a tuned overlay's publication)
    makes it again with the configured analyzer, the vectors kept."""
    chunks = [Chunk(chunk_id=f"c{i}", source_id=f"s{i}", ordinal=0, text=t, metadata={"n": i},
                    embedding=[1.0, float(i), 0.5])
              for i, t in enumerate(["Running cells divide.", "A cell runs.", "x y z"])]
    old = MilvusStore(MilvusSpec(type="milvus", uri="r.db", collection="r", analyzer="english"), tmp_path)
    old.upsert(chunks)
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), base_dir=tmp_path)
    state.record("index", "fp", [Document(source_id=c.source_id, text=c.text, content_hash=c.chunk_id)
                                 for c in chunks], chunks)
    old.sync(state)
    vectors = old.vectors(["c0", "c1", "c2"])
    old.close()
    new = MilvusStore(MilvusSpec(type="milvus", uri="r.db", collection="r"), tmp_path)
    assert "english" in new.problem() and "ragline" in new.problem()
    with pytest.raises(InputError, match="created with"):
        new.search(["cell"], 5)
    with pytest.raises(InputError, match="mix two analyzers"):
        new.upsert(chunks[:1])
    assert new.sync(state)
    assert new.problem() is None and json.loads(new.published_version()["settings"])["analyzer"] == "ragline"
    assert {cid: v.tolist() for cid, v in new.vectors(["c0", "c1", "c2"]).items()} == \
        {cid: v.tolist() for cid, v in vectors.items()}
    assert {h[0] for h in new.search(["running cell"], 5)[0]} == {"c0", "c1"}  # stemmed: runs, running
    assert not new._connect().has_collection("r_rebuild")
    new.close()
    state.close()


def test_tune_on_milvus_writes_an_overlay_and_rebuilds_bm25_with_it(tmp_path, monkeypatch):
    """`ragline tune` over a milvus resource in both roles: the tuned BM25 settings are published by
    rebuilding the collection, and search on the tuned project runs (no settings mismatch)."""
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    chroma = "  store:    {type: chroma, path: idx/chroma, collection: test}\n  sparse:   {type: bm25, path: idx/bm25}\n"
    assert chroma in TUNE_YAML
    text = TUNE_YAML.replace(chroma, "  store:    &m {type: milvus, uri: idx/milvus.db, collection: test}\n"
                                     "  sparse:   *m\n")
    text = text.replace("bm25_k1: [1.2, 1.5]", "bm25_k1: [1.5]").replace("bm25_stemmer: [english, none]",
                                                                         "bm25_stemmer: [none]")
    (tmp_path / "pipelines.yaml").write_text(text)
    (tmp_path / "prompts").symlink_to(REPO_PROMPTS)
    write_jsonl(tmp_path / "dataset" / "corpus.jsonl", scifact_records(30))
    judged(tmp_path / "dataset")
    assert engine.run(load_project(tmp_path / "pipelines.yaml").pipeline("index"), orchestrate=False).added == 30
    clear_cache()
    out = tmp_path / "report.json"
    saved = sys.stdout
    with open(out, "w") as handle:
        sys.stdout = handle
        try:
            assert cli.main(["tune", "-f", str(tmp_path / "pipelines.yaml"), "--no-prefect", "--json"]) == 0
        finally:
            sys.stdout = saved
    report = json.loads(out.read_text())
    assert report["written"] and report["pairs"] == 30
    clear_cache()
    tuned = load_project(tmp_path / "pipelines.yaml")
    store = tuned.resource("store")
    assert store.problem() is None  # the collection was rebuilt with the tuned settings (or they did not change)
    assert tuned.spec.resources["store"].model_dump(include={"k1", "b", "stemmer"}) == \
        report["overrides"]["resources"]["sparse"]
    assert engine.run(tuned.pipeline("search"), {"query": "cerebral white matter"}, orchestrate=False)
    clear_cache()
    shutil.rmtree(tmp_path / "idx", ignore_errors=True)
