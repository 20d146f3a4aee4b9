"""Query2doc and HyDE with the packaged model (SmolLM2-135M-Instruct on the CPU vLLM), and what
`ragline tune` decides without labels about query2doc and the context-expansion window.

Usage: .venv/bin/python bench/query2doc.py [--limit 25] [--others 100] [--pairs 15] [--no-rgb] [--no-scifact]
                                           [--no-readme] [--table-only] [--self-consistency]

Per collection (SciFact test over the sub-corpus of bench/techniques.py: every judged abstract plus
the first ``--others``; the RGB-built collection of bench/tuning.py), on one index in a private
workspace, the first ``--limit`` queries through:
1. the default hybrid `search`; HyDE (its pseudo-document a second dense query, BM25 on the request);
   query2doc on the BM25 side only (`rewrite` mode hyde, `keyword: true`; dense on the request); both.
   Each query's pseudo-document is written once by the real model (temperature 0, the stage's own
   prompt, a 64-token reply, 4 requests in flight) and the three pipelines read that same reply;
   their ms/query is their own retrieval time plus the mean seconds one pseudo-document took.
2. the `tune` job (300 pseudo-queries: inverse cloze + keywords; BM25 kept at the file's k1, b and
   stemmer to save time: fusion is still tuned) over `search`, a query2doc pipeline
   whose step is `enabled: false` and `search` + `expand_context`: query2doc is decided on ``--pairs``
   pseudo-queries (one real LLM call each), the window by its hold rate against tokens.
3. the labelled check of that window: for every window the tuner tried, how much of each relevant
   document its best top-10 passage holds (bench/techniques.py's coverage) and the words shown; the
   same rule (fewest words within 2 points of the best coverage) gives the labelled choice.
Every row: nDCG@10, Recall@100 and the paired 95 % bootstrap interval of its difference to `search`.

The self-consistent row (``SAMPLES`` pseudo-documents of one call at temperature ``TEMPERATURE``,
the BM25 query the request 5 times and the terms at least ``AGREEMENT`` of them share; dense on the
request) runs beside query2doc's single greedy one. ``--self-consistency`` runs only those rows and
the default (no tuner, no context windows), into their own table (``query2doc-sc``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from common import OUT, REPO, publish, save
from expansion_tuning import run_rows
from techniques import sentences, sub_corpus
from tuning import interval, rgb_as_beir

from ragline.flows.evaluation.retrieval import BeirDataset, document_id, eval_workspace, load_beir
from ragline.flows.ops.llm_server import answers
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project

WORK = OUT / "query2doc"
TOKENS = 64  # pseudo-document length (the stage's default is 128; the shared CPU writes ~2-4 tokens/s)
SAMPLES, TEMPERATURE, AGREEMENT = 5, 0.7, 0.6  # query2doc with self-consistency
EXTRA = """
  q_hyde:
    kind: query
    steps:
      - {id: hyde,   task: rewrite, with: {mode: hyde, max_tokens: TOKENS}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  q_q2d:
    kind: query
    steps:
      - {id: q2d,    task: rewrite, with: {mode: hyde, keyword: true, enabled: ENABLED, max_tokens: TOKENS}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [q2d]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  q_sc:
    kind: query
    steps:
      - {id: q2d,    task: rewrite, with: {mode: hyde, keyword: true, max_tokens: TOKENS, samples: SAMPLES,
                                           temperature: TEMPERATURE, min_agreement: AGREEMENT}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}, after: []}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [q2d]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  q_both:
    kind: query
    steps:
      - {id: q2d,    task: rewrite, with: {mode: hyde, keyword: true, max_tokens: TOKENS}}
      - {id: dense,  task: retrieve_dense,  with: {k: 100}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: [q2d]}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
  q_context:
    kind: query
    steps:
      - {id: dense,   task: retrieve_dense,  with: {k: 100}}
      - {id: sparse,  task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: fuse,    task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 100}}
      - {id: context, task: expand_context, with: {neighbours: 1, max_tokens: 512, top_k: 10}}
  q_tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries, with: {n: 300, seed: 0, strategies: [inverse_cloze, keywords]}}
      - {id: tune,  task: tune_retrieval, with: {pipelines: [search, q_q2d, q_context], query2doc_pairs: PAIRS,
                                                 bm25_k1: [1.2], bm25_b: [0.75], bm25_stemmer: [english],
                                                 write: false}}
"""


class Memo:
    """The LLM client's ``chat`` and ``samples`` answering a request they have seen (the same prompt,
    ``n`` and sampling) with the reply it got (seeded: the same reply), and recording how long each
    real call took."""

    def __init__(self, llm):
        self.llm, self.seen, self.seconds, self.lock = llm, {}, {}, threading.Lock()
        self.real_chat, self.real_samples = llm.chat, llm.samples
        llm.chat, llm.samples = self.chat, self.samples

    def chat(self, prompt, **kwargs):
        return self._memo(("chat", str(prompt), json.dumps(kwargs, sort_keys=True, default=str)),
                          lambda: self.real_chat(prompt, **kwargs))

    def samples(self, prompt, n, **kwargs):
        return self._memo(("samples", str(prompt), n, json.dumps(kwargs, sort_keys=True, default=str)),
                          lambda: self.real_samples(prompt, n, **kwargs))

    def _memo(self, key, call):
        with self.lock:
            if key in self.seen:
                return self.seen[key]
        started = time.perf_counter()
        reply = call()
        with self.lock:
            self.seen[key], self.seconds[key] = reply, time.perf_counter() - started
        return reply


def project_file(name: str, pairs: int, enabled: bool):
    folder = WORK / name
    folder.mkdir(parents=True, exist_ok=True)
    extra = EXTRA.replace("PAIRS", str(pairs)).replace("TOKENS", str(TOKENS)).replace("SAMPLES", str(SAMPLES))
    extra = extra.replace("TEMPERATURE", str(TEMPERATURE)).replace("AGREEMENT", str(AGREEMENT))
    extra = extra.replace("ENABLED", "true" if enabled else "false")
    shipped = (REPO / "pipelines.yaml").read_text().replace("timeout_seconds: 120", "timeout_seconds: 1800")
    assert "timeout_seconds: 1800" in shipped  # a loaded CPU writes a pseudo-document in minutes
    (folder / "pipelines.yaml").write_text(shipped.replace("\npipelines:\n", "\npipelines:\n" + extra, 1))
    if not (folder / "prompts").exists():
        (folder / "prompts").symlink_to(REPO / "prompts")
    return folder / "pipelines.yaml"


def pseudo_documents(project, memo: Memo, queries: list[str]) -> dict:
    """Every query's pseudo-document from the real model, as the rewrite stage asks for it, 4 at a time;
    then its ``SAMPLES`` self-consistent ones (one call each), as the q_sc step asks for them."""
    step = project.pipeline("q_both").step("q2d")
    prompts = [project.prompts.render(step.prompt, question=clip(q, step.params.max_request_chars), n=step.params.n)
               for q in queries]
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: memo.chat(p, max_tokens=step.params.max_tokens, temperature=None).text,
                                prompts))
    wall = time.perf_counter() - started
    calls = list(memo.seconds.values())
    single = {"calls": len(calls), "seconds_mean": round(statistics.mean(calls), 2), "wall_seconds": round(wall, 1),
              "empty": sum(not r.strip() for r in replies), "words_mean": round(statistics.mean(len(r.split())
                                                                                           for r in replies), 1),
              "example": {"query": queries[0], "document": replies[0]}}
    sc = project.pipeline("q_sc").step("q2d").params
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        samples = list(pool.map(lambda p: memo.samples(p, sc.samples, max_tokens=sc.max_tokens,
                                                       temperature=sc.temperature), prompts))
    wall = time.perf_counter() - started
    seconds = [v for k, v in memo.seconds.items() if k[0] == "samples"]
    texts = [[c.text.strip() for c in s] for s in samples]
    single["self_consistent"] = {
        "calls": len(seconds), "seconds_mean": round(statistics.mean(seconds), 2), "wall_seconds": round(wall, 1),
        "samples": sc.samples, "temperature": sc.temperature, "min_agreement": sc.min_agreement,
        "distinct_mean": round(statistics.mean(len(set(t)) for t in texts), 2),
        "example": {"query": queries[0], "documents": texts[0]}}
    return single


def coverage(project, dataset, limit: int, windows: list[dict]) -> list[dict]:
    """Per window: the share of a relevant document's sentences its best top-10 passage holds (no
    expansion: the hits as `search` returns them) and the words per top-10 passage."""
    docs = {}
    with open(dataset.corpus, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            docs[str(record["_id"])] = sentences(record["text"])
    out = []
    queries = list(dataset.queries.items())[:limit]
    for window in windows:
        pipeline = project.pipeline("q_context").with_overrides({"context": {**window, "top_k": 10}})
        shares, words = [], []
        for qid, text in queries:
            passages = engine.run(pipeline, {"query": text}, orchestrate=False)[:10]
            words.extend(len(p.text.split()) for p in passages)
            for doc in dataset.qrels[qid]:
                best = next((p for p in passages if document_id(p) == doc), None)
                if best is not None and docs.get(doc):
                    shares.append(sum(s in best.text for s in docs[doc]) / len(docs[doc]))
        out.append({**window, "coverage": round(statistics.mean(shares), 4) if shares else 0.0,
                    "words": round(statistics.mean(words), 1), "hits": len(shares)})
    return out


def labelled_choice(options: list[dict], margin: float = 0.02) -> dict:
    best = max(o["coverage"] for o in options)
    return min((o for o in options if o["coverage"] >= best - margin),
               key=lambda o: (o["words"], o["neighbours"], o["max_tokens"]))


def measure(name: str, dataset, limit: int, pairs: int, only_sc: bool = False) -> dict:
    file = project_file(name, pairs, enabled=True)
    plain = load_project(file, tuned=False)
    workspace = eval_workspace(plain, dataset, "index")
    plain = plain.relocated(workspace)
    queries = dict(list(dataset.queries.items())[:limit])
    dataset = BeirDataset(dataset.name, dataset.corpus, queries, {q: dataset.qrels[q] for q in queries})
    llm = plain.resource("llm")
    waited = time.monotonic()
    while not answers(llm.spec.base_url, llm.spec.model):  # a server started beside the bench may still load
        if time.monotonic() - waited > 900:
            raise RuntimeError(f"no LLM answers at {llm.spec.base_url}")
        time.sleep(10)
    memo = Memo(llm)
    writer = ThreadPoolExecutor(1)  # the pseudo-documents need the questions only: written while indexing runs
    writing = writer.submit(pseudo_documents, plain, memo, list(dataset.queries.values()))
    started = time.perf_counter()
    report = engine.run(plain.pipeline("index").with_overrides({"load": {"paths": [str(dataset.corpus.resolve())]}}),
                        orchestrate=False)
    print(f"{name}: index {report.summary()} in {time.perf_counter() - started:.0f} s", flush=True)
    (workspace / "pipelines.tuned.yaml").unlink(missing_ok=True)
    generation = writing.result()
    writer.shutdown()
    print(f"{name}: {generation['calls']} pseudo-documents, {generation['seconds_mean']} s each "
          f"({generation['wall_seconds']} s wall)", flush=True)
    sc_label = (f"query2doc, self-consistent: the terms of >= {AGREEMENT:.0%} of {SAMPLES} samples at temperature "
                f"{TEMPERATURE:g} (repeats 5)")
    chosen = [("hybrid RRF (default `search`)", "search", {}),
              ("HyDE: pseudo-document as a second dense query", "q_hyde", {}),
              ("query2doc: pseudo-document appended to the BM25 query (repeats 5)", "q_q2d", {}),
              (sc_label, "q_sc", {}),
              ("HyDE + query2doc", "q_both", {})]
    if only_sc:
        chosen = [chosen[0], chosen[2], chosen[3]]
    rows = run_rows(plain, dataset, chosen)
    for row in rows[1:]:
        seconds = generation["self_consistent"]["seconds_mean"] if row["pipeline"] == "q_sc" \
            else generation["seconds_mean"]
        row["query_ms"] = round(row["query_ms"] + 1000 * seconds, 1)
    base = rows[0]["per_query"]
    for row in rows:
        row["versus_default"] = {m: interval([a - b for a, b in zip(row["per_query"][m], base[m])])
                                 for m in ("ndcg@10", "recall@100")}
        del row["per_query"]
    documents = sum(1 for line in open(dataset.corpus, encoding="utf-8") if line.strip())
    if only_sc:
        return {"documents": documents, "queries": len(dataset.queries), "rows": rows, "generation": generation}
    tune_project = load_project(project_file(name, pairs, enabled=False), tuned=False).relocated(workspace)
    calls_before = len(memo.seconds)
    tune_memo = Memo(tune_project.resource("llm"))
    started = time.perf_counter()
    tuning = engine.run(tune_project.pipeline("q_tune"), orchestrate=False)
    wall = time.perf_counter() - started
    q2d, context = tuning.expansions.get("query2doc", {}), tuning.expansions.get("expand_context", {})
    print(f"{name}: tune {wall:.0f} s ({len(tune_memo.seconds)} LLM calls): query2doc {q2d.get('reason')}; "
          f"context {context.get('reason')}", flush=True)
    windows = [{"neighbours": o["neighbours"], "max_tokens": o["max_tokens"]} for o in context.get("options", [])]
    labelled = coverage(plain, dataset, limit, windows) if windows else []
    choice = labelled_choice(labelled) if labelled else None
    return {"documents": documents, "queries": len(dataset.queries), "rows": rows, "generation": generation,
            "llm_calls_rows": calls_before, "tune_seconds": round(wall, 1), "tune_llm_calls": len(tune_memo.seconds),
            "chosen": tuning.chosen.name, "query2doc": {k: v for k, v in q2d.items() if k != "setting"},
            "context": context, "context_labelled": labelled,
            "context_labelled_choice": choice, "tune_timings": tuning.timings}


def merged(result: dict, name: str, figures: dict, saved: str = "query2doc") -> dict:
    """The saved results with this collection's (a run per collection may go on beside another)."""
    path = OUT / f"{saved}.json"
    result = {**result, **(json.loads(path.read_text()) if path.exists() else {}), name: figures}
    save(saved, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=25, help="queries per collection (each costs an LLM call)")
    parser.add_argument("--others", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=15, help="pseudo-queries the tuner asks the LLM about")
    parser.add_argument("--no-rgb", action="store_true")
    parser.add_argument("--no-scifact", action="store_true")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--self-consistency", action="store_true",
                        help="only the default, query2doc and its self-consistent row: no tuner, no context windows")
    args = parser.parse_args()
    saved = "query2doc_sc" if args.self_consistency else "query2doc"
    if args.table_only:
        result = json.loads((OUT / f"{saved}.json").read_text())
    else:
        result = json.loads((OUT / f"{saved}.json").read_text()) if (OUT / f"{saved}.json").exists() else {}
        from ragline.flows.ops.llm_server import start_vllm

        server = None
        if not os.environ.get("RAGLINE_LLM_BASE_URL"):
            server = start_vllm(say=lambda m: print(m, flush=True))
            os.environ["RAGLINE_LLM_BASE_URL"] = server.base_url
        try:
            result["machine"] = platform.processor() or platform.machine()
            if not args.no_scifact:
                result = merged(result, "scifact", measure("scifact", sub_corpus(args.others), args.limit, args.pairs,
                                                           args.self_consistency), saved)
            if not args.no_rgb:
                result = merged(result, "rgb", measure("rgb", load_beir(rgb_as_beir(OUT / "rgb-beir"), "test"),
                                                       args.limit, args.pairs, args.self_consistency), saved)
        finally:
            if server is not None:
                server.stop()
    publish("query2doc-sc" if args.self_consistency else "query2doc", table(result), readme=not args.no_readme)


def table(result: dict) -> list[str]:
    lines = []
    for name, title in (("scifact", "SciFact test"), ("rgb", "RGB-built collection")):
        r = result.get(name)
        if r is None:
            continue
        g = r["generation"]
        sc = g.get("self_consistent")
        sampled = "" if sc is None else (f"; {sc['samples']} samples at temperature {sc['temperature']:g} in one call: "
                                         f"{sc['seconds_mean']:.1f} s, {sc['distinct_mean']:.1f} distinct on average")
        lines += ["", f"{title}: the first {r['queries']} queries over {r['documents']:,} documents; SmolLM2-135M "
                      f"pseudo-documents ({g['words_mean']:.0f} words on average, {g['seconds_mean']:.1f} s each, 4 in flight per "
                      f"collection{sampled}); Δ: paired 95 % bootstrap interval against the default "
                      f"(* when it excludes 0):",
                  "", "| retrieval | nDCG@10 | Δ nDCG@10 | Recall@100 | Δ Recall@100 | ms/query |",
                  "|---|---|---|---|---|---|"]
        for row in r["rows"]:
            cells = []
            for m in ("ndcg@10", "recall@100"):
                v = row["versus_default"][m]
                star = "*" if v["low"] > 0 or v["high"] < 0 else ""
                cells.append(f"{row[m]:.3f} | {v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]{star}")
            lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {row['query_ms']:.0f} |")
        if "query2doc" not in r:  # --self-consistency: no tuner, no windows
            continue
        q = r["query2doc"]
        lines += ["", f"Tuner ({r['tune_seconds']:.0f} s, {r['tune_llm_calls']} LLM calls): query2doc "
                      f"{' '.join(q.get('reason', 'not decided').split())}."]
        c, choice = r["context"], r.get("context_labelled_choice")
        if c.get("chosen"):
            agree = choice is not None and (choice["neighbours"], choice["max_tokens"]) == \
                (c["chosen"]["neighbours"], c["chosen"]["max_tokens"])
            lines.append(f"Context window (tuner, no labels): {c['reason']}. With the labels (share of a relevant "
                         f"document's sentences in its best top-10 passage, fewest words within 2 points of the "
                         f"best): neighbours {choice['neighbours']}, max_tokens {choice['max_tokens']} "
                         f"(coverage {choice['coverage']:.0%}, {choice['words']:.0f} words per passage): "
                         + ("the same window." if agree else "a different window."))
            lines += ["", "| neighbours | max_tokens | tuner: hold rate | tuner: tokens/query | labelled: coverage "
                          "| labelled: words/passage |", "|---|---|---|---|---|---|"]
            labelled = {(o["neighbours"], o["max_tokens"]): o for o in r["context_labelled"]}
            for o in c["options"]:
                lab = labelled.get((o["neighbours"], o["max_tokens"]), {})
                lines.append(f"| {o['neighbours']} | {o['max_tokens']} | {o['hold']:.1%} | {o['tokens']:.0f} | "
                             f"{lab.get('coverage', 0):.1%} | {lab.get('words', 0):.0f} |")
    return lines[1:]


if __name__ == "__main__":
    main()
