"""Self-tuning retrieval on SciFact without labels: BM25, dense, untuned and tuned hybrid.

Usage: .venv/bin/python bench/tuning.py [--strategies inverse_cloze+keywords,inverse_cloze,keywords] [--pairs 300]
                                        [--no-readme] [--table-only] [--no-rgb]

1. Indexes the SciFact corpus once in the private evaluation workspace `ragline eval` uses (reused).
2. Runs the shipped `tune` pipeline there (pseudo-queries from the index, then the tuner): its wall
   time, and the overlay it writes in that workspace (never beside the repository's pipelines.yaml).
   The tuner sees no queries and no qrels: `tests/tasks/jobs/test_tune_retrieval.py` proves it.
3. Scores BM25, dense, the untuned hybrid (pipelines.yaml) and the tuned hybrid (pipelines.yaml +
   overlay) on the test queries (300) by running the real pipelines, and on the train queries (809,
   the dev split) from cached rankings fused exactly as `fuse` does.
4. Method check, on the dev split only: every candidate the tuner tried is also scored on the train
   qrels; agreement = rank correlation (Kendall tau, Spearman) between the candidates' pseudo-query
   and train scores, and the train/test score of the candidate each ranking picks.
   Other pseudo-query strategies (`--strategies`) are compared the same way.
5. Paired 95 % intervals (bootstrap over queries, seeded) of the tuned hybrid minus the better
   single retriever, nDCG@10 and Recall@100, on test (the real pipelines) and train (cached).
SciFact train is the development split the generators and the decision rule were designed on;
test is for reporting only. No other BEIR collection can be fetched here (no internet but the
package registries): the second collection is RGB's, built at run time.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from common import DATA, OUT, REPO, SCIFACT, publish, save

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.evaluation.retrieval import eval_workspace, load_beir, score, to_run
from ragline.flows.run.progress import IngestProgress

STRATEGIES = {  # name -> pseudo_queries parameters
    "inverse_cloze": {"strategies": ["inverse_cloze"]},
    "keywords": {"strategies": ["keywords"]},
    "inverse_cloze+keywords": {"strategies": ["inverse_cloze", "keywords"]},
    "inverse_cloze_unmasked": {"strategies": ["inverse_cloze"], "mask": False},
    "title": {"strategies": ["title"]},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="inverse_cloze+keywords,inverse_cloze,keywords",
                        help="pseudo-query strategies to compare (the first one is the shipped default, tuned for real)")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    parser.add_argument("--no-rgb", action="store_true", help="SciFact only (skip the RGB collection)")
    args = parser.parse_args()
    if args.table_only:
        result = json.loads((OUT / "tuning.json").read_text())
    else:
        result = run(args.strategies.split(","), args.pairs, rgb=not args.no_rgb)
        save("tuning", result)
    publish("tuning", table(result), readme=not args.no_readme)


def run(strategies: list[str], pairs: int, rgb: bool = True) -> dict:
    plain = load_project(REPO / "pipelines.yaml", tuned=False)
    test, train = load_beir(SCIFACT, "test"), load_beir(SCIFACT, "train")
    workspace = eval_workspace(plain, test, "index")
    plain = plain.relocated(workspace)
    progress = IngestProgress("indexing scifact")
    started = time.perf_counter()
    report = engine.run(plain.pipeline("index").with_overrides({"load": {"paths": [str(test.corpus.resolve())]}}),
                        orchestrate=False, progress=progress)
    progress.close()
    index_seconds = round(time.perf_counter() - started, 1)
    print(f"index: {report.summary()} in {index_seconds} s", flush=True)

    from ragline.tasks.jobs import tune_retrieval as tr

    corpus = tr.Corpus.from_state(plain.resource("state"))
    by_doc_id = {sid.rsplit("#", 1)[-1]: i for sid, i in corpus.doc_index.items()}
    splits = {"train": train, "test": test}
    relevant = {name: [{by_doc_id[d] for d, g in ds.qrels[q].items() if g > 0 and d in by_doc_id}
                       for q in ds.queries] for name, ds in splits.items()}

    runs, tuned_project = {}, None
    for i, strategy in enumerate(strategies):
        overlay = workspace / f"tuned-{strategy}.yaml"
        pipeline = plain.pipeline("tune").with_overrides({"pairs": {"n": pairs, **STRATEGIES[strategy]},
                                                          "tune": {"overlay": str(overlay)}})
        started = time.perf_counter()
        tuning = engine.run(pipeline, orchestrate=False)
        wall = time.perf_counter() - started
        print(f"tune ({strategy}): {tuning.chosen.name} in {wall:.1f} s ({tuning.timings})", flush=True)
        runs[strategy] = {"wall_seconds": round(wall, 1), "report": tuning}
        if i == 0:  # the shipped strategy: its overlay becomes the workspace's own, as `ragline tune` writes it
            default = workspace / "pipelines.tuned.yaml"
            default.write_text(overlay.read_text())
            tuned_project = load_project(REPO / "pipelines.yaml", tuned=True).relocated(workspace)

    # every candidate of every strategy, scored on the real queries from cached rankings
    settings = {c.name: c.setting for r in runs.values() for c in r["report"].candidates}
    base_setting = next(iter(runs.values()))["report"].baseline.setting
    variants = list({tr.variant_name(s["bm25"]): s["bm25"] for s in settings.values()}.values())
    store, embedder = plain.resource("store"), plain.resource("embedder")
    bm25_spec = plain.spec.resources["sparse"]
    real: dict[str, dict[str, dict[str, float]]] = {}
    cached_per_query: dict[str, dict[str, object]] = {}
    for name, ds in splits.items():
        started = time.perf_counter()
        cache, _ = tr.rank_queries(list(ds.queries.values()), corpus, store, embedder, bm25_spec, variants, 100)
        cached_per_query[name] = {}
        scored = tr.score_settings(list(settings.values()), cache, relevant[name], top_k=100,
                                   per_query=cached_per_query[name])
        real[name] = {c.name: c.scores for c in scored}
        print(f"{name}: {len(settings)} candidates scored from cached rankings in "
              f"{time.perf_counter() - started:.1f} s", flush=True)

    agreement = {s: _agreement(r["report"], real) for s, r in runs.items()}
    for s, a in agreement.items():
        print(f"agreement ({s}): {a}", flush=True)

    # headline: the real pipelines on the test queries (train: the same settings from cached rankings)
    first = runs[strategies[0]]["report"]
    rows = headline(plain, tuned_project, test)
    for row, setting in zip(rows, (None, None, base_setting, first.chosen.setting)):
        if setting is not None:
            row["train"] = real["train"][tr.setting_name(setting)]
            row["test_cached"] = real["test"][tr.setting_name(setting)]
    gate = gate_figures(tuned_project, first.gate_floor, test)
    print(f"gate: {gate}", flush=True)
    singles = {"BM25": tr.setting_name({**base_setting, "dense_weight": 0.0}),
               "dense": tr.setting_name({**base_setting, "dense_weight": 1.0})}
    for row in rows:
        if row["label"] in singles:
            row["train"] = real["train"].get(singles[row["label"]])
    train_pq = cached_per_query["train"]
    versus = {"test": versus_single(rows),
              "train": paired({label: train_pq[name] for label, name in singles.items()},
                              train_pq[first.chosen.name], column=lambda a, m: a[:, tr.METRICS.index(m)])}
    print(f"tuned minus the better single retriever: {versus}", flush=True)
    second = second_corpus(pairs) if rgb else None
    return {"machine": platform.processor() or platform.machine(), "pairs": pairs, "rows": _public(rows),
            "rgb": second, "versus_single": versus, "index_seconds": index_seconds,
            "tuning": {s: {"wall_seconds": r["wall_seconds"], "timings": r["report"].timings,
                           "chosen": r["report"].chosen.name, "reason": r["report"].reason,
                           "rule": r["report"].rule, "gain_interval": r["report"].gain_interval,
                           "by_strategy": r["report"].by_strategy,
                           "candidates": len(r["report"].candidates),
                           "pseudo": r["report"].chosen.scores,
                           "train": real["train"][r["report"].chosen.name],
                           "test": real["test"][r["report"].chosen.name]} for s, r in runs.items()},
            "agreement": agreement, "gate": gate,
            "best_on_train": _best(real["train"]), "best_on_test": _best(real["test"])}


def headline(plain, tuned_project, dataset) -> list[dict]:
    """BM25, dense, the untuned and the tuned hybrid, run as the real pipelines on ``dataset``."""
    rows = []
    for label, project, pipeline in (
            ("BM25", plain, "search_bm25"), ("dense", plain, "search_dense"),
            ("hybrid, untuned (pipelines.yaml)", plain, "search"),
            ("hybrid, tuned (pipelines.yaml + overlay)", tuned_project, "search")):
        project.resource("sparse").sync(project.resource("state"))  # BM25 as this project sets it (a tune
        # run published its own choice; the plain rows must not search that one)
        started = time.perf_counter()
        queries = list(dataset.queries.items())
        run_ = {q: to_run(engine.run(project.pipeline(pipeline), {"query": text}, orchestrate=False))
                for q, text in queries}
        figures = score(run_, dataset.qrels)
        rows.append({"label": label, "pipeline": pipeline, "test": figures, "per_query": per_query(run_, dataset.qrels),
                     "query_ms": round(1000 * (time.perf_counter() - started) / len(queries), 1)})
        print(f"{label:45} test nDCG@10 {figures['ndcg@10']:.4f} R@100 {figures['recall@100']:.4f}", flush=True)
    return rows


def per_query(run_: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> dict[str, list[float]]:
    """nDCG@10 and Recall@100 of every judged query (0 for one that retrieved nothing), in qrels order."""
    import pytrec_eval

    evaluated = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run_)
    return {"ndcg@10": [evaluated.get(q, {}).get("ndcg_cut_10", 0.0) for q in qrels],
            "recall@100": [evaluated.get(q, {}).get("recall_100", 0.0) for q in qrels]}


def interval(gains, resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean of paired per-query gains and its 95 % bootstrap interval (seeded)."""
    import numpy as np

    gains = np.asarray(gains, dtype=float)
    rng = np.random.default_rng(seed)
    means = gains[rng.integers(0, len(gains), (resamples, len(gains)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": round(float(gains.mean()), 4), "low": round(float(low), 4), "high": round(float(high), 4)}


def paired(singles: dict[str, object], tuned, column) -> dict:
    """Tuned minus the single retriever with the higher mean nDCG@10, per metric, with intervals."""
    import numpy as np

    better = max(singles, key=lambda label: float(np.mean(column(singles[label], "ndcg@10"))))
    return {"better_single": better, **{m: interval(np.asarray(column(tuned, m)) - np.asarray(column(singles[better], m)))
                                        for m in ("ndcg@10", "recall@100")}}


def versus_single(rows: list[dict]) -> dict:
    """The headline rows' tuned hybrid minus the better of BM25 and dense, per query."""
    by_label = {r["label"]: r["per_query"] for r in rows}
    singles = {label: by_label[label] for label in ("BM25", "dense")}
    return paired(singles, rows[-1]["per_query"], column=lambda figures, m: figures[m])


def _public(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "per_query"} for r in rows]


def rgb_as_beir(folder: Path) -> Path:
    """A second collection, in BEIR layout, from RGB en_fact: every passage of its 100 items (news
    and web snippets; duplicates once) is the corpus, each question a query whose relevant
    passages are its item's positives. Written under bench/out at run time, never into the repo."""
    items = [json.loads(line) for line in (DATA / "rgb" / "en_fact.json").read_text().splitlines() if line.strip()]
    ids: dict[str, str] = {}
    for item in items:
        for kind in ("positive", "negative"):
            for text in item[kind]:
                if text.strip():
                    ids.setdefault(text, f"p{len(ids)}")
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n"
                                                 for t, i in ids.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{n}", "text": item["query"]}) + "\n"
                                                  for n, item in enumerate(items)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{n}\t{ids[t]}\t1\n" for n, item in enumerate(items) for t in dict.fromkeys(item["positive"]) if t.strip()))
    return folder


def second_corpus(pairs: int) -> dict:
    """The same comparison on the RGB collection: index it, tune on its own pseudo-queries, run."""
    dataset = load_beir(rgb_as_beir(OUT / "rgb-beir"), "test")
    plain = load_project(REPO / "pipelines.yaml", tuned=False)
    workspace = eval_workspace(plain, dataset, "index")
    plain = plain.relocated(workspace)
    engine.run(plain.pipeline("index").with_overrides({"load": {"paths": [str(dataset.corpus.resolve())]}}),
               orchestrate=False)
    started = time.perf_counter()
    report = engine.run(plain.pipeline("tune").with_overrides({"pairs": {"n": pairs}}), orchestrate=False)
    wall = time.perf_counter() - started
    print(f"tune (rgb): {report.chosen.name} in {wall:.1f} s", flush=True)
    tuned = load_project(REPO / "pipelines.yaml", tuned=True).relocated(workspace)
    documents = sum(1 for line in dataset.corpus.read_text().splitlines() if line.strip())
    rows = headline(plain, tuned, dataset)
    return {"documents": documents, "queries": len(dataset.queries),
            "pairs": report.pairs, "wall_seconds": round(wall, 1), "chosen": report.chosen.name,
            "reason": report.reason, "rule": report.rule, "versus_single": versus_single(rows),
            "rows": _public(rows)}


def gate_figures(project, floor: float | None, test) -> dict:
    """What the tuned answerability floor does: the share of SciFact test questions it would refuse
    (they all have an answer in the corpus) and of RGB's 100 questions asked of SciFact, which are
    about something else entirely (news, sport, companies). The gate sees the top five passages."""
    from ragline.tasks.generate.answerable import similarity

    if floor is None:
        return {}
    rgb = [json.loads(line)["query"] for line in (DATA / "rgb" / "en_fact.json").read_text().splitlines() if line]
    embedder, search = project.resource("embedder"), project.pipeline("search")
    figures = {"floor": floor}
    for name, questions in (("scifact_test", list(test.queries.values())), ("off_topic_rgb", rgb)):
        refused = 0
        for text in questions:
            passages = engine.run(search, {"query": text}, orchestrate=False)[:5]
            refused += bool(passages) and similarity(embedder, text, [p.text for p in passages]) < floor
        figures[name] = {"questions": len(questions), "refused": round(refused / len(questions), 3)}
    return figures


def _best(scores: dict[str, dict[str, float]]) -> dict:
    name = max(scores, key=lambda n: scores[n]["ndcg@10"])
    return {"name": name, **scores[name]}


def _agreement(report, real: dict[str, dict[str, dict[str, float]]]) -> dict:
    """Rank agreement between the candidates' pseudo-query nDCG@10 and their train nDCG@10."""
    from scipy.stats import kendalltau, spearmanr

    names = [c.name for c in report.candidates]
    pseudo = [c.scores["ndcg@10"] for c in report.candidates]
    train = [real["train"][n]["ndcg@10"] for n in names]
    tau, _ = kendalltau(pseudo, train)
    rho, _ = spearmanr(pseudo, train)
    best_train = max(train)
    chosen = report.chosen.name
    return {"candidates": len(names), "kendall_tau": round(float(tau), 3), "spearman": round(float(rho), 3),
            "chosen_train_ndcg": real["train"][chosen]["ndcg@10"], "best_train_ndcg": best_train,
            "chosen_train_percentile": round(100 * sum(t <= real["train"][chosen]["ndcg@10"] for t in train)
                                             / len(train), 1)}


def _versus(v: dict | None) -> str:
    if not v:
        return ""
    ci = lambda m: f"{v[m]['mean']:+.3f} [{v[m]['low']:+.3f}, {v[m]['high']:+.3f}]"  # noqa: E731
    if "test" in v:
        return (f"Tuned minus the better single retriever (paired, 95 % bootstrap interval): test "
                f"({v['test']['better_single']}) nDCG@10 {ci_of(v['test'], 'ndcg@10')}, Recall@100 "
                f"{ci_of(v['test'], 'recall@100')}; train ({v['train']['better_single']}) nDCG@10 "
                f"{ci_of(v['train'], 'ndcg@10')}, Recall@100 {ci_of(v['train'], 'recall@100')}.")
    return (f"Tuned minus the better single retriever ({v['better_single']}; paired, 95 % bootstrap interval): "
            f"nDCG@10 {ci('ndcg@10')}, Recall@100 {ci('recall@100')}.")


def ci_of(v: dict, metric: str) -> str:
    return f"{v[metric]['mean']:+.3f} [{v[metric]['low']:+.3f}, {v[metric]['high']:+.3f}]"


def table(result: dict) -> list[str]:
    lines = ["| retrieval | test nDCG@10 | test Recall@100 | train (dev) nDCG@10 | train Recall@100 |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        train = r.get("train") or {}
        lines.append(f"| {r['label']} | **{r['test']['ndcg@10']:.3f}** | {r['test']['recall@100']:.3f} | "
                     f"{train.get('ndcg@10', float('nan')):.3f} | {train.get('recall@100', float('nan')):.3f} |")
    first = next(iter(result["tuning"]))
    t = result["tuning"][first]
    lines += ["", _versus(result.get("versus_single")),
              "", f"Tuned on {result['pairs']} pseudo-queries ({first}) in **{t['wall_seconds']} s** "
                  f"({', '.join(f'{k} {v} s' for k, v in t['timings'].items())}); chosen: `{t['chosen']}`, "
                  f"decided by the rule *{t.get('rule', '?')}* ({t['reason']}). Indexing the corpus took "
                  f"{result.get('index_seconds', '?')} s (reused when already indexed).", "",
              "| pseudo-queries | candidates | Kendall tau (pseudo vs train) | Spearman | chosen: pseudo nDCG@10 | "
              "chosen: train nDCG@10 (percentile) | chosen: test nDCG@10 | wall time |",
              "|---|---|---|---|---|---|---|---|"]
    for s, t in result["tuning"].items():
        a = result["agreement"][s]
        lines.append(f"| {s} | {a['candidates']} | {a['kendall_tau']:.2f} | {a['spearman']:.2f} | "
                     f"{t['pseudo']['ndcg@10']:.3f} | {t['train']['ndcg@10']:.3f} ({a['chosen_train_percentile']:.0f}th) | "
                     f"{t['test']['ndcg@10']:.3f} | {t['wall_seconds']} s |")
    rgb = result.get("rgb")
    if rgb:
        lines += ["", f"A second collection, built from RGB en_fact at run time ({rgb['documents']} news and web "
                      f"passages, its {rgb['queries']} questions as queries, each item's positive passages as the "
                      f"relevant ones); tuned on {rgb['pairs']} pseudo-queries of its own in {rgb['wall_seconds']} s, "
                      f"chosen: `{rgb['chosen']}`:", "",
                  "| retrieval | nDCG@10 | Recall@100 |", "|---|---|---|"]
        lines += [f"| {r['label']} | **{r['test']['ndcg@10']:.3f}** | {r['test']['recall@100']:.3f} |"
                  for r in rgb["rows"]]
        lines += ["", f"Decided by *{rgb.get('rule', '?')}* ({rgb['reason']}). " + _versus(rgb.get("versus_single"))]
    gate = result.get("gate") or {}
    if gate:
        lines += ["", f"Answerability gate: the tuner's similarity floor **{gate['floor']:.3f}** (what 98 % of the "
                      f"pseudo-queries clear with their own source) refuses "
                      f"{100 * gate['off_topic_rgb']['refused']:.0f} % of {gate['off_topic_rgb']['questions']} "
                      f"off-topic questions (RGB's, asked of SciFact) and {100 * gate['scifact_test']['refused']:.1f} % "
                      f"of the {gate['scifact_test']['questions']} SciFact test questions, before any generation."]
    lines += ["", "Per generator, on the shipped run's pseudo-queries (nDCG@10 of the chosen setting, the best single "
                  "retriever and pipelines.yaml's; the candidate each generator alone ranks first):", "",
              "| run | generator | pairs | chosen | best single | pipelines.yaml | its own best |", "|---|---|---|---|---|---|---|"]
    for s, t in result["tuning"].items():
        for g, e in (t.get("by_strategy") or {}).items():
            cell = lambda label: f"{e[label]['ndcg@10']:.3f}" if label in e else "–"  # noqa: E731
            own = e.get("own best") or {}
            lines.append(f"| {s} | {g} | {e['pairs']} | {cell('chosen')} | {cell('best single')} | "
                         f"{cell('pipelines.yaml')} | `{own.get('name', '–')}` |")
    bt, bs = result["best_on_train"], result["best_on_test"]
    lines += ["", f"Best candidate with labels (not used by the tuner): train `{bt['name']}` {bt['ndcg@10']:.3f}; "
                  f"test `{bs['name']}` {bs['ndcg@10']:.3f}."]
    return lines


if __name__ == "__main__":
    main()
