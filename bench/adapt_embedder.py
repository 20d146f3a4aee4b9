"""Domain adaptation of the embedder on SciFact, without labels: dense and hybrid, base vs adapted.

Usage: .venv/bin/python bench/adapt_embedder.py [--pairs 300] [--epochs 1] [--batch-size 32]
                                                [--hard-negatives 1] [--docs 0] [--table-only]

1. Indexes the SciFact corpus in the private evaluation workspace `ragline eval` uses (reused when
   it is there: `bench/tuning.py` builds the same one).
2. Makes pseudo-query pairs from that index (the `pseudo_queries` stage: inverse cloze, no labels)
   and fine-tunes the embedder on them (the `adapt_embedder` stage: BM25 hard negatives,
   MultipleNegativesRankingLoss); neither sees a query or a judgement.
3. Re-embeds the corpus with the adapted model in a workspace of its own (the adapted embedder has
   another settings fingerprint, so another evaluation workspace; the base index is untouched).
4. Scores dense (`search_dense`) and hybrid (`search`, RRF as pipelines.yaml has it) for the base and
   the adapted model: the test split (300 queries) by running the real pipelines, the train split
   (809 queries, the dev split) from cached rankings fused exactly as `fuse` does.

``--docs N`` (N > 0) indexes a subset instead of the whole corpus, for a busy machine: every
document judged in either split plus random others up to N (seed 0). Its figures are higher than
the full corpus's and only comparable with each other (base vs adapted).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import time
from pathlib import Path

from common import OUT, REPO, SCIFACT, save

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.flows.evaluation.retrieval import BeirDataset, eval_workspace, load_beir, score, to_run
from ragline.flows.run.progress import IngestProgress
from ragline.flows.resources.stores.state import IndexBusy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=300, help="pseudo-query pairs to train on")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--hard-negatives", type=int, default=1)
    parser.add_argument("--max-seq-length", type=int, default=None, help="training length (default: the model's)")
    parser.add_argument("--docs", type=int, default=0, help="0: the whole corpus; N: judged documents + random "
                                                            "others up to N (a busy machine)")
    parser.add_argument("--table-only", action="store_true", help="print the table of the last run")
    args = parser.parse_args()
    if args.table_only:
        result = json.loads((OUT / "adapt_embedder.json").read_text())
    else:
        result = run(args)
        save("adapt_embedder", result)
    print("\n".join(table(result)))


def run(args) -> dict:
    from ragline.tasks.jobs import adapt_embedder as ae
    from ragline.tasks.jobs import tune_retrieval as tr
    from ragline.tasks.ingest.pseudo_queries import Params as PairParams
    from ragline.tasks.ingest.pseudo_queries import pseudo_queries

    load_before = os.getloadavg()
    plain = load_project(REPO / "pipelines.yaml", tuned=False)
    test, train = load_beir(SCIFACT, "test"), load_beir(SCIFACT, "train")
    corpus_file = SCIFACT / "corpus.jsonl" if args.docs <= 0 else subset(args.docs, [test, train], plain.base_dir)
    test, train = (dataclasses.replace(ds, corpus=corpus_file) for ds in (test, train))

    base = plain.relocated(eval_workspace(plain, test, "index"))
    seconds: dict[str, float] = {}
    index(base, corpus_file, "indexing scifact (base model)", seconds, "index_base")

    # pairs and training: the index only (its chunks and BM25 settings), never queries or qrels
    started = time.perf_counter()
    pairs = pseudo_queries.fn(params=PairParams(n=args.pairs, seed=0, max_seconds=None),
                              ctx=StepContext(pipeline="adapt", step_id="pairs", project=base),
                              state=base.resource("state"))
    seconds["pairs"] = time.perf_counter() - started
    params = ae.Params(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                       hard_negatives=args.hard_negatives, max_seq_length=args.max_seq_length, max_seconds=None,
                       write=False)  # the evaluation workspace's overlay stays bench/tuning.py's
    started = time.perf_counter()
    report = ae.adapt_embedder.fn(pairs=pairs, params=params,
                                  ctx=StepContext(pipeline="adapt", step_id="adapt", project=base),
                                  embedder=base.resource("embedder"), sparse=base.resource("sparse"),
                                  state=base.resource("state"))
    seconds["adapt"] = time.perf_counter() - started
    print(f"adapt: {report.pairs} pairs, {report.steps} steps, loss {report.loss}, {report.timings}"
          f"{' (reused)' if report.reused else ''} -> {report.model_path}", flush=True)

    adapted_plain = plain.with_resource("embedder", **report.overlay["resources"]["embedder"])
    adapted = adapted_plain.relocated(eval_workspace(adapted_plain, test, "index"))
    index(adapted, corpus_file, "re-embedding scifact (adapted model)", seconds, "index_adapted")

    bm25_spec = plain.spec.resources["sparse"]
    setting = tr.current_setting(plain, tr.Target("search", "fuse", "dense", "sparse", "sparse"), bm25_spec)
    dense_setting = {**setting, "dense_weight": 1.0}
    rows = []
    for label, project in (("base", base), ("adapted", adapted)):
        corpus = tr.Corpus.from_state(project.resource("state"))
        by_doc_id = {sid.rsplit("#", 1)[-1]: i for sid, i in corpus.doc_index.items()}
        relevant = [{by_doc_id[d] for d, g in train.qrels[q].items() if g > 0 and d in by_doc_id}
                    for q in train.queries]
        started = time.perf_counter()
        cache, _ = tr.rank_queries(list(train.queries.values()), corpus, project.resource("store"),
                                   project.resource("embedder"), bm25_spec, [setting["bm25"]], 100)
        cached = {c.setting["dense_weight"]: c.scores
                  for c in tr.score_settings([dense_setting, setting], cache, relevant, top_k=100)}
        print(f"{label}: train split scored from cached rankings in {time.perf_counter() - started:.1f} s", flush=True)
        kinds = (("dense", "search_dense", 1.0), ("hybrid (RRF)", "search", setting["dense_weight"]))
        for kind, pipeline, weight in kinds:
            started = time.perf_counter()
            run_ = {q: to_run(engine.run(project.pipeline(pipeline), {"query": text}, orchestrate=False))
                    for q, text in test.queries.items()}
            figures = score(run_, test.qrels)
            rows.append({"retrieval": kind, "model": label, "pipeline": pipeline, "test": figures,
                         "train": cached[weight],
                         "query_ms": round(1000 * (time.perf_counter() - started) / len(test.queries), 1)})
            print(f"{kind:13} {label:8} test nDCG@10 {figures['ndcg@10']:.4f} R@100 {figures['recall@100']:.4f}  "
                  f"train nDCG@10 {cached[weight]['ndcg@10']:.4f} R@100 {cached[weight]['recall@100']:.4f}",
                  flush=True)
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "corpus": str(corpus_file), "docs": args.docs or "all", "chunks": report.chunks,
            "pairs": report.pairs, "strategies": report.strategies, "params": params.model_dump(mode="json"),
            "adaptation": report.model_dump(mode="json"),
            "minutes": {k: round(v / 60, 2) for k, v in seconds.items()},
            "fine_tuning_minutes": round(report.timings.get("training", 0.0) / 60, 2),
            "reembedding_minutes": round(seconds["index_adapted"] / 60, 2), "rows": rows}


def index(project, corpus: Path, label: str, seconds: dict, key: str) -> None:
    """Index (incrementally) with the project's embedder; waits while another run holds the index."""
    pipeline = project.pipeline("index").with_overrides({"load": {"paths": [str(corpus.resolve())]}})
    started = time.perf_counter()
    while True:
        try:
            progress = IngestProgress(label)
            try:
                report = engine.run(pipeline, orchestrate=False, progress=progress)
            finally:
                progress.close()
            break
        except IndexBusy as exc:
            print(f"{label}: {exc}; waiting", flush=True)
            time.sleep(60)
            started = time.perf_counter()
    seconds[key] = time.perf_counter() - started
    print(f"{label}: {report.summary()} in {seconds[key]:.1f} s", flush=True)


def subset(n: int, splits: list[BeirDataset], base_dir: Path) -> Path:
    """Every judged document of ``splits`` plus random others (seed 0) up to ``n``, as a JSONL file in
    the private evaluation folder (one file per n, so its workspace is reused)."""
    judged = {d for ds in splits for docs in ds.qrels.values() for d in docs}
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        lines = handle.readlines()
    ids = [json.loads(line)["_id"] for line in lines]
    others = [i for i, d in enumerate(ids) if d not in judged]
    random.Random(0).shuffle(others)
    keep = {i for i, d in enumerate(ids) if d in judged} | set(others[:max(0, n - len(judged))])
    target = base_dir / ".ragline" / "eval" / f"scifact-subset-{n}" / "corpus.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(lines[i] for i in sorted(keep))
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
    return target


def table(result: dict) -> list[str]:
    lines = ["| retrieval | embedder | test nDCG@10 | test Recall@100 | train (dev) nDCG@10 | train Recall@100 |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['retrieval']} | {r['model']} | **{r['test']['ndcg@10']:.3f}** | "
                     f"{r['test']['recall@100']:.3f} | {r['train']['ndcg@10']:.3f} | {r['train']['recall@100']:.3f} |")
    a, p = result["adaptation"], result["params"]
    corpus = "the whole corpus" if result["docs"] == "all" else \
        f"a {result['docs']}-document subset (every judged document plus random others)"
    strategies = ", ".join(f"{n} {s}" for s, n in result["strategies"].items())
    lines += ["", f"Fine-tuned on {result['pairs']} pseudo-queries ({strategies}; "
                  f"{p['epochs']:g} epoch, batch {p['batch_size']}, {p['hard_negatives']} BM25 hard negative(s), "
                  f"lr {p['learning_rate']:g}) in **{result['fine_tuning_minutes']} min** ({a['steps']} steps); "
                  f"re-embedding {result['chunks']} chunks of {corpus} took **{result['reembedding_minutes']} min** "
                  f"({result['cpus']} cores, load average {result['load_average_before'][0]} before, "
                  f"{result['load_average_after'][0]} after)."]
    return lines


if __name__ == "__main__":
    main()
