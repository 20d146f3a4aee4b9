"""The tuner: candidates scored exactly as `fuse` and `eval` rank; the choice and its guard; end to
end on a small index, `ragline tune` writes an overlay that `search` then uses; and tuning reads
only the index, never the queries or judgements next to the corpus."""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from ragline.flows import cli
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.context import StepContext
from ragline.flows.contracts import Candidate, Passage, Ranking
from ragline.flows.evaluation.retrieval import load_beir, score, to_run
from ragline.flows.resources import clear_cache
from ragline.tasks.generate import answerable
from ragline.tasks.ingest.pseudo_queries import without
from ragline.tasks.jobs import tune_retrieval as tr
from ragline.tasks.retrieve.fuse import Params as FuseParams
from ragline.tasks.retrieve.fuse import fuse
from tests.helpers import reads_roles as roles
from tests.helpers.data import REPO, require_scifact, scifact_records, write_jsonl
from tests.helpers.tuning import TUNE_YAML, judged

BM25 = {"k1": 1.2, "b": 0.75, "stemmer": "english"}


def setting(method="rrf", k=60, alpha=0.5, depth=100, depth_sparse=None, bm25=None):
    return {"method": method, "k": k, "dense_weight": alpha, "depth_dense": depth,
            "depth_sparse": depth_sparse or depth, "bm25": bm25 or BM25}


def test_candidate_scores_are_what_fuse_and_eval_give():
    rng = random.Random(3)
    n_chunks, n_docs = 400, 150
    docs = np.array(sorted(rng.randrange(n_docs) for _ in range(n_chunks)))
    dense, sparse, qrels, relevant = [], [], {}, []
    for q in range(25):
        picks = rng.sample(range(n_chunks), 60)
        dense.append([(c, 1.0 - i / 100 + rng.random() / 1000) for i, c in enumerate(picks[:40])])
        sparse.append([(c, 30.0 - i / 2) for i, c in enumerate(picks[20:])])
        rel = {int(docs[c]) for c in rng.sample(picks, 2)} | {rng.randrange(n_docs)}
        relevant.append(rel)
        qrels[str(q)] = {f"d{d}": 1 for d in rel}
    cache = tr.Rankings(docs=docs, dense=dense, sparse={tr.variant_name(BM25): sparse})
    settings = [setting(), setting(k=5, alpha=0.8), setting(method="score", alpha=0.3), setting(alpha=0.0),
                setting(alpha=1.0, depth=20), setting(method="score", alpha=0.6, depth=25, depth_sparse=30)]
    ours = tr.score_settings(settings, cache, relevant, top_k=30)

    def passages(ranking, name):
        return Ranking(retriever=name, query="q", passages=[
            Passage(chunk_id=f"c{c:05d}", source_id=f"d{docs[c]}", text="", score=s, metadata={"doc_id": f"d{docs[c]}"})
            for c, s in ranking])

    for s, candidate in zip(settings, ours):
        params = FuseParams(method=s["method"], k=s["k"], top_k=30,
                            weights={"dense": s["dense_weight"], "sparse": 1 - s["dense_weight"]})
        run = {str(q): to_run(fuse.fn(rankings=[passages(dense[q][:s["depth_dense"]], "dense"),
                                                passages(sparse[q][:s["depth_sparse"]], "sparse")], params=params))
               for q in range(25)}
        truth = score(run, qrels)
        for metric in tr.METRICS:
            assert candidate.scores[metric] == pytest.approx(truth[metric], abs=2e-5), (candidate.name, metric)


def cand(name, alpha, ndcg, recall=1.0, depth=100, per_query=None, noise=0.0, seed=0, n=300):
    """A candidate with per-query figures around ``ndcg`` (``noise``: their spread) for the paired test."""
    rng = np.random.default_rng(seed)
    values = np.full(n, ndcg) + noise * rng.choice([-1.0, 1.0], n)
    values += ndcg - values.mean()
    if per_query is not None:
        per_query[name] = np.stack([values, values, np.full(n, recall)], axis=1)
    return Candidate(name=name, setting=setting(alpha=alpha, depth=depth),
                     scores={"ndcg@10": ndcg, "mrr@10": ndcg, "recall@100": recall})


def test_the_best_single_retriever_is_left_only_for_a_significant_gain():
    per_query: dict = {}
    dense = cand("dense alone", 1.0, 0.60, per_query=per_query)
    bm25 = cand("bm25 alone", 0.0, 0.55, per_query=per_query)
    base = cand("file", 0.5, 0.58, per_query=per_query)
    noisy = cand("fusion, noisy", 0.6, 0.61, per_query=per_query, noise=0.5)  # +0.01 on average, by chance
    params = tr.Params()
    decision = tr.choose([noisy, dense, base, bm25], base, params, per_query)
    assert decision.chosen is dense and decision.rule == "no significant gain" and decision.single is dense
    low, high = decision.interval
    assert low < 0 < high and "no fused candidate beats the best single retriever significantly" in decision.reason
    # a steady gain of 0.02 on every query: significant, fused
    steady = cand("fusion, steady", 0.6, 0.62, per_query=per_query)
    decision = tr.choose([steady, noisy, dense, base, bm25], base, params, per_query)
    assert decision.chosen is steady and decision.rule == "significant gain"
    assert decision.interval[0] > 0 and "+0.0200 ndcg@10 over the best single retriever (dense alone" in decision.reason
    # the same resamples every time (seeded)
    assert tr.choose([noisy, dense, base, bm25], base, params, per_query).interval == \
        tr.choose([noisy, dense, base, bm25], base, params, per_query).interval
    # min_gain: the file's own setting (when allowed) stays unless the choice beats it by more
    strong_base = cand("file", 0.5, 0.615, per_query=per_query)
    decision = tr.choose([steady, strong_base, dense, bm25], strong_base, tr.Params(min_gain=0.01), per_query)
    assert decision.chosen is strong_base and decision.rule == "min_gain"


def test_the_recall_guard_never_trades_recall_for_a_small_gain():
    per_query: dict = {}
    dense = cand("dense alone", 1.0, 0.60, per_query=per_query)
    deep = cand("fusion depth 100", 0.6, 0.65, recall=0.94, per_query=per_query)
    shallow = cand("fusion depth 50", 0.6, 0.654, recall=0.87, depth=50, per_query=per_query)  # +0.004, -0.07
    decision = tr.choose([shallow, deep, dense], dense, tr.Params(), per_query)
    assert decision.chosen is deep and decision.rule == "recall guard" and "Recall@100" in decision.reason
    much_better = cand("fusion depth 50", 0.6, 0.66, recall=0.87, depth=50, per_query=per_query)  # +0.01
    assert tr.choose([much_better, deep, dense], dense, tr.Params(), per_query).chosen is much_better
    # among single retrievers too: dense at depth 50 does not replace dense at 100 for +0.002
    dense50 = cand("dense alone 50", 1.0, 0.602, recall=0.80, depth=50, per_query=per_query)
    decision = tr.choose([dense50, dense], dense, tr.Params(), per_query)
    assert decision.single is dense and decision.chosen is dense


def test_overlay_entries_weight_each_pipelines_own_steps():
    targets = [tr.Target("search", "fuse", "dense", "sparse", "bm25"), tr.Target("ask", "merge", "vec", "kw", "bm25")]
    entries = tr.overlay_entries(None, targets, setting(method="score", alpha=0.7, depth=50,
                                                        bm25={"k1": 0.9, "b": 0.4, "stemmer": "none"}))
    assert entries["resources"] == {"bm25": {"k1": 0.9, "b": 0.4, "stemmer": "none"}}
    assert entries["pipelines"]["ask"] == {"merge": {"method": "score", "k": 60, "weights": {"vec": 0.7, "kw": 0.3}},
                                           "vec": {"k": 50}, "kw": {"k": 50}}


def test_the_gate_floor_is_a_low_quantile_of_the_sources_similarity_and_needs_enough_pairs():
    values = [i / 100 for i in range(100)] + [None] * 5  # a pair without a source has no similarity
    assert answerable.kept_floor(values, 0.98) == pytest.approx(0.0198)
    assert answerable.kept_floor(values, 0.9) == pytest.approx(0.099)
    assert answerable.kept_floor(values[:19], 0.98) is None and answerable.kept_floor(values, None) is None


def test_the_gate_floor_comes_from_pairs_worded_like_questions_not_keyword_queries():
    from ragline.flows.contracts import PseudoQuery

    pairs = [PseudoQuery(text="t", source_id="s", chunk_id="c", strategy=k) for k in ["inverse_cloze", "keywords"] * 30]
    similarity = [0.5 + i / 1000 if p.strategy == "inverse_cloze" else 0.05 for i, p in enumerate(pairs)]
    assert tr.gate_similarities(pairs, similarity) == similarity[::2]
    assert answerable.kept_floor(tr.gate_similarities(pairs, similarity), 0.98) > 0.5  # keyword pairs do not drag it down
    assert tr.gate_similarities(pairs[:20], similarity[:20]) == similarity[:20]  # too few worded ones: all


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A BEIR-layout folder (corpus, queries, qrels) inside a project that indexes its corpus."""
    require_scifact()
    root = tmp_path_factory.mktemp("tune")
    dataset = root / "dataset"
    write_jsonl(dataset / "corpus.jsonl", scifact_records(30))
    judged(dataset)
    (root / "pipelines.yaml").write_text(TUNE_YAML)
    (root / "prompts").symlink_to(REPO / "prompts")
    report = engine.run(load_project(root / "pipelines.yaml").pipeline("index"), orchestrate=False)
    assert report.added == 30
    return root


def tune(root: Path, *args: str) -> dict:
    out = root / "report.json"
    saved = sys.stdout
    with open(out, "w") as handle:
        sys.stdout = handle
        try:
            assert cli.main(["tune", "-f", str(root / "pipelines.yaml"), "--no-prefect", "--json", *args]) == 0
        finally:
            sys.stdout = saved
    return json.loads(out.read_text())


@pytest.mark.integration  # `ragline tune`/eval end to end on an index
def test_tune_writes_an_overlay_that_search_uses(indexed, capsys, monkeypatch):
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    file_before = (indexed / "pipelines.yaml").read_bytes()
    report = tune(indexed)
    overlay = indexed / "pipelines.tuned.yaml"
    try:
        assert report["written"] and Path(report["overlay"]) == overlay.resolve()
        assert (indexed / "pipelines.yaml").read_bytes() == file_before
        assert report["pairs"] == 30 and len(report["candidates"]) > 50
        chosen = report["chosen"]
        singles = [c["scores"]["ndcg@10"] for c in report["candidates"] if c["setting"]["dense_weight"] in (0, 1)]
        assert chosen["scores"]["ndcg@10"] >= max(singles) - 0.005  # never below the better single retriever
        assert report["single"]["scores"]["ndcg@10"] >= max(singles) - 0.005
        assert report["rule"] in ("significant gain", "no significant gain", "recall guard")
        if chosen["setting"]["dense_weight"] not in (0, 1):
            assert report["gain_interval"][0] > 0  # left the best single retriever: significantly better
        assert report["by_strategy"]["inverse_cloze"]["pairs"] == 30

        expected = report["overrides"]["pipelines"]["search"]
        tuned = load_project(indexed / "pipelines.yaml")
        fuse_params = tuned.pipeline("search").step("fuse").params
        assert fuse_params.model_dump(include={"method", "k", "weights"}) == expected["fuse"]
        assert tuned.pipeline("search").step("dense").params.k == expected["dense"]["k"]
        assert tuned.spec.resources["sparse"].model_dump(include={"k1", "b", "stemmer"}) == \
            report["overrides"]["resources"]["sparse"]
        # search runs with the chosen setting: the same passages as the file with the chosen values set by hand
        query = {"query": "cerebral white matter in newborns"}
        by_hand = load_project(indexed / "pipelines.yaml", tuned=False).with_resource(
            "sparse", **report["overrides"]["resources"]["sparse"]).pipeline("search").with_overrides(expected)
        assert [p.chunk_id for p in engine.run(tuned.pipeline("search"), query, orchestrate=False)] == \
            [p.chunk_id for p in engine.run(by_hand, query, orchestrate=False)]

        # the gate's similarity floor: what 98 % of the pseudo-queries clear with their own source
        floor = report["gate_floor"]
        assert 0.0 < floor < 1.0 and report["overrides"]["pipelines"]["gated"]["gate"] == {"min_similarity": floor}
        assert "gate" not in report["overrides"]["pipelines"]["search"]
        assert tuned.pipeline("gated").step("gate").params.min_similarity == floor
        assert load_project(indexed / "pipelines.yaml", tuned=False).pipeline("gated").step("gate").params \
            .min_similarity == "auto"  # the file's default: the floor set at ingestion

        # the opt-in expansion step: decided on the same pseudo-queries, on or off, as the overlay sets it
        terms = report["expansions"]["expand_terms"]
        assert terms["steps"] == ["search_terms.terms"] and terms["enabled"] in (True, False), terms
        assert report["overrides"]["pipelines"]["search_terms"]["terms"]["enabled"] is terms["enabled"]
        assert tuned.pipeline("search_terms").step("terms").params.enabled is terms["enabled"]
        assert terms["interval"][0] > 0 if terms["enabled"] else terms["reason"].startswith("off:")

        assert cli.main(["validate", str(indexed / "pipelines.yaml")]) == 0
        out = capsys.readouterr().out
        assert "tuned overlay" in out and f"chosen: {chosen['name']}" in out
        assert cli.main(["tune", "-f", str(indexed / "pipelines.yaml"), "--no-prefect", "--dry-run"]) == 0
        summary = capsys.readouterr().out
        assert "chosen:" in summary and "pipelines.yaml" in summary and "not written: dry run" in summary
    finally:
        overlay.unlink(missing_ok=True)


@pytest.mark.integration  # `ragline tune`/eval end to end on an index
def test_tuning_reads_the_index_only_never_queries_or_qrels(indexed, tmp_path, monkeypatch):
    """Every file the tuning run opens, lists or connects to is recorded (Python audit events): none is
    in the dataset folder, whose queries and qrels sit next to the corpus. Then the queries and qrels
    are replaced by different ones (and removed): the tuner's figures and choice do not move."""
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    dataset = (indexed / "dataset").resolve()
    assert load_beir(dataset).qrels  # they are there, readable, for anyone who would look
    touched: list[str] = []
    recording = [True]

    def audit(event: str, args: tuple) -> None:
        if recording[0] and event in ("open", "os.listdir", "os.scandir", "glob.glob", "sqlite3.connect",
                                      "os.walk", "shutil.copyfile", "os.rename", "os.remove"):
            for arg in args:
                if isinstance(arg, (str, bytes, Path)):
                    touched.append(str(arg if not isinstance(arg, bytes) else arg.decode(errors="replace")))

    clear_cache()  # as a new process: every file the run needs is opened while recording
    sys.addaudithook(audit)  # cannot be removed: switched off below
    try:
        first = tune(indexed, "--dry-run")
    finally:
        recording[0] = False
    assert touched, "the audit hook saw nothing"
    assert any("state.sqlite" in p for p in touched)  # the index is what it reads
    assert [p for p in touched if str(dataset) in str(Path(p).resolve()) or "qrels" in p] == []

    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n0\tnothing\t1\n")
    (dataset / "queries.jsonl").write_text('{"_id": "0", "text": "an unrelated question"}\n')
    second = tune(indexed, "--dry-run")
    shutil.rmtree(dataset / "qrels")
    (dataset / "queries.jsonl").unlink()
    third = tune(indexed, "--dry-run")
    figures = [[(c["name"], c["scores"]) for c in r["candidates"]] for r in (first, second, third)]
    assert figures[0] == figures[1] == figures[2]
    assert first["chosen"] == second["chosen"] == third["chosen"]


@pytest.mark.integration  # `ragline tune`/eval end to end on an index
def test_the_gates_llm_threshold_is_what_the_pseudo_queries_clear_with_their_own_source(indexed):
    """gate_llm_pairs asks the gate's own LLM check, as the gate asks it, about pseudo-queries with
    their source (without the cut) among the references and without it: min_probability is what 98 %
    of them clear with it, set only if it refuses enough of them without it."""
    from tests.scripted_llm import ScriptedLLM

    def tune_with(reply, n: int, **more):
        with ScriptedLLM(reply, logprob=-0.2) as llm:
            scripted.write_text(TUNE_YAML.replace("http://127.0.0.1:9/v1", llm.base_url))
            job = load_project(scripted, tuned=False).pipeline("tune")
            report = engine.run(job.with_overrides({"tune": {"gate_llm_pairs": n, "write": False, **more}}),
                                orchestrate=False)
            return report, [r["messages"][-1]["content"] for r in llm.requests]

    scripted = indexed / "scripted.yaml"
    cut_texts = {}

    def reads(prompt: str) -> str:  # a model that reads: yes when the source is among the references
        question = prompt.rsplit("Question:", 1)[1].split("\n")[0].strip()
        return "Yes" if cut_texts.get(question, "\0") in prompt else "No"

    from ragline.tasks.ingest.pseudo_queries import Params as PairParams
    from ragline.tasks.ingest.pseudo_queries import pseudo_queries

    state = load_project(indexed / "pipelines.yaml", tuned=False).resource("state")
    for pair in pseudo_queries.fn(params=PairParams(n=30), ctx=StepContext(pipeline="tune", step_id="pairs"),
                                  state=state):
        source = state.chunks_by_id([pair.chunk_id])[pair.chunk_id]["text"]
        cut_texts[pair.text] = " ".join(without(source, pair.cut).split()[:6])  # words of the source left
    report, prompts = tune_with(reads, 25)
    assert len(prompts) == 50 and report.gate_llm.pairs == 25
    assert all("Do the documents above contain the answer to this question?" in p for p in prompts)
    assert all(p.count("<document") == tr.GATE_DOCUMENTS for p in prompts)
    assert report.gate_llm.auc > 0.9 and report.gate_llm.enabled
    assert report.gate_llm.refused_unanswerable > 0.9 and report.gate_llm.refused_answerable <= 0.04
    assert 0.5 < report.gate_probability_floor <= 1.0
    assert report.overrides["pipelines"]["gated"]["gate"] == {"min_similarity": report.gate_floor,
                                                              "min_probability": report.gate_probability_floor}
    assert "LLM check" in tr.summary(report) and "set" in report.gate_llm.reason

    report, prompts = tune_with(lambda prompt: "Yes", 20)  # a model that says yes to everything: left off
    assert report.gate_llm.auc == 0.5 and not report.gate_llm.enabled and report.gate_probability_floor is None
    assert report.overrides["pipelines"]["gated"]["gate"] == {"min_similarity": report.gate_floor}
    assert "left off" in report.gate_llm.reason

    ungated = TUNE_YAML[:TUNE_YAML.index("  gated:")] + TUNE_YAML[TUNE_YAML.index("  tune:"):]
    scripted.write_text(ungated)
    job = load_project(scripted, tuned=False).pipeline("tune").with_overrides({"tune": {"gate_llm_pairs": 20}})
    assert engine.run(job.with_overrides({"tune": {"write": False}}), orchestrate=False).gate_llm \
        is None  # no gate, nothing to calibrate: the LLM (at a closed port) is never called
    scripted.unlink()


@pytest.mark.integration  # `ragline tune`/eval end to end on an index
def test_eval_measures_the_tuned_overlay_of_the_project_without_re_embedding(indexed, monkeypatch, capsys):
    """`ragline index; ragline tune; ragline eval`: eval applies the overlay tune wrote beside the
    user's data (not one of its private workspace), says so, and a retrieval-only difference (BM25's
    k1 and b, fusion) reuses the workspace's vectors instead of re-embedding the corpus."""
    from ragline.flows.evaluation.retrieval import eval_workspace, evaluate

    monkeypatch.setenv("RAGLINE_TUNED", "1")
    judged(indexed / "dataset")
    dataset = load_beir(indexed / "dataset")
    overlay = indexed / "pipelines.tuned.yaml"
    tune(indexed)
    try:
        plain = load_project(indexed / "pipelines.yaml", tuned=False)
        tuned = load_project(indexed / "pipelines.yaml")
        assert tuned.overlay is not None and tuned.overlay.changes
        retuned = plain.with_resource("sparse", k1=0.5, b=0.2, stemmer="none")
        workspace = eval_workspace(plain, dataset, "index")
        assert eval_workspace(tuned, dataset, "index") == eval_workspace(retuned, dataset, "index") == workspace

        untuned_figures = evaluate(plain, dataset)
        assert untuned_figures["overlay"] is None and "added 30" in untuned_figures["index_summary"]
        figures = evaluate(tuned, dataset)
        assert figures["overlay"] == str(overlay.resolve())
        assert figures["overlay_changes"] == tuned.overlay.changes
        assert figures["workspace"] == str(workspace)
        assert "added 0" in figures["index_summary"] and "updated 0" in figures["index_summary"]  # nothing re-embedded

        # the figures are those of the tuned search pipeline as the user runs it (on their own index)
        run = {q: to_run(engine.run(tuned.pipeline("search"), {"query": t}, orchestrate=False))
               for q, t in dataset.queries.items()}
        assert figures["ndcg@10"] == pytest.approx(score(run, dataset.qrels)["ndcg@10"], abs=1e-4)
        assert not (workspace / "pipelines.tuned.yaml").exists()

        # the README's order of commands: eval prints the tuned figure and names the overlay it applied
        capsys.readouterr()
        assert cli.main(["eval", "--dataset", str(indexed / "dataset"), "-f", str(indexed / "pipelines.yaml")]) == 0
        out = capsys.readouterr().out
        assert f"tuned overlay: {overlay.resolve()}" in out and f"{figures['ndcg@10']:.4f}" in out
        assert cli.main(["eval", "--no-tuned", "--dataset", str(indexed / "dataset"),
                         "-f", str(indexed / "pipelines.yaml")]) == 0
        assert "tuned overlay: none" in capsys.readouterr().out
    finally:
        overlay.unlink(missing_ok=True)


@pytest.mark.integration  # the engine end to end on a SciFact index
def test_a_retriever_weighed_zero_is_not_run(indexed, monkeypatch):
    """Dense alone or BM25 alone, as the tuner may choose them, runs one retriever: the other one is
    never called (no query embedding, no Chroma query), and the answer is that retriever's alone."""
    from ragline.flows.resources.models.embedder import Embedder

    project = load_project(indexed / "pipelines.yaml", tuned=False)
    encoded: list[list[str]] = []
    original = Embedder.encode_queries
    monkeypatch.setattr(Embedder, "encode_queries", lambda self, texts: encoded.append(texts) or original(self, texts))
    query = {"query": "cerebral white matter in newborns"}
    bm25_only = project.pipeline("search").with_overrides({"fuse": {"weights": {"dense": 0.0, "sparse": 1.0}},
                                                            "sparse": {"k": 20}})
    trace: list = []
    fused = engine.run(bm25_only, query, orchestrate=False, trace=trace)
    assert encoded == [] and [step for step, _ in trace] == ["sparse", "fuse"]
    alone = project.pipeline("search").with_overrides({"fuse": {"weights": {"dense": 0.0}}})
    sparse_ranking = engine.run(alone, query, orchestrate=False)
    assert [p.chunk_id for p in fused] == [p.chunk_id for p in sparse_ranking] and fused
    dense_only = project.pipeline("search").with_overrides({"fuse": {"weights": {"dense": 1.0, "sparse": 0.0}}})
    trace = []
    assert engine.run(dense_only, query, orchestrate=False, trace=trace) and encoded
    assert [step for step, _ in trace] == ["dense", "fuse"]


# ----------------------------------------------------------------------------- resources read (validate)
INDEX = "  store: {type: chroma, path: idx/chroma, collection: docs}\n" + roles.EMBEDDER + roles.BM25 + roles.STATE
TUNE_STEPS = """      - {id: pairs, task: pseudo_queries}
      - id: tune
        task: tune_retrieval
        with:
          gate_llm_pairs: 50
"""


def test_tune_with_gate_llm_pairs_and_no_llm_fails_validation_at_gate_llm_pairs(make_project):
    """The gates' LLM calibration validated without an LLM and failed only when the job ran; now
    `ragline validate` names the line and with.gate_llm_pairs."""
    error = roles.error_at(make_project(roles.pipelines_file(INDEX, TUNE_STEPS, kind="job")), "tune", "with.gate_llm_pairs")
    assert "gate_llm_pairs: 50 asks the LLM about that many pseudo-queries" in error.message


def test_tune_binds_an_llm_where_query2doc_may_use_one_and_none_where_nothing_reads_it(make_project):
    """query2doc's pseudo-documents read the file's LLM if it has one (none: those steps are left
    undecided); with neither query2doc nor the gate calibration, two LLMs need no name."""
    default = TUNE_STEPS.replace("gate_llm_pairs: 50", "metric: ndcg@10")
    alone = make_project(roles.pipelines_file(INDEX, default, kind="job"))
    assert validate_file(alone) == [] and "llm" not in load_project(alone).pipeline("p").step("tune").resources
    one = load_project(make_project(roles.pipelines_file(INDEX + roles.LLM, default, kind="job"), name="one.yaml"))
    assert one.pipeline("p").step("tune").resources["llm"] == "llm"
    none = TUNE_STEPS.replace("gate_llm_pairs: 50", "query2doc_pairs: 0")
    two = make_project(roles.pipelines_file(INDEX + roles.TWO_LLMS, none, kind="job"), name="two.yaml")
    assert validate_file(two) == [] and "llm" not in load_project(two).pipeline("p").step("tune").resources
