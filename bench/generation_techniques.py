"""Generation-side techniques on RGB en_fact, each a variant of the default `ask` pipeline, against
`ask` itself: same questions, same references (indexed once per corpus), same LLM server, one run.

Variants (each differs from `ask` in the steps named; all keep ask's retrieval, gate and check):
system prompt (tone), few-shot examples (`retrieve_examples`, RELP), chain-of-note (`refine_notes`),
abstractive compression (`refine_abstractive`), pairwise LLM reranking (`rerank_llm` pairwise,
PRP-sliding), one document at a time then combine (`generate_map_reduce`), FLARE-Direct and
FLARE-Instruct (`generate_flare`), and conversation memory (`recall_history`): every question asked
after the same long unrelated conversation, `ask` (the conversational rewrite reads the last turns,
the answer prompt sees none) against `ask` + `recall_history` (the answer prompt sees the chosen turns).

Questions: a fixed seeded subset of `--limit` items of the 100 (seed `--seed`); the few-shot
examples and the conversation turns come from the *other* RGB items only (never an evaluated one).
Per variant: on `positive` references (they contain the answer) accuracy (the answer string in the
response, RGB's measure), refusal rate, cited fraction, citation validity; on `negative` references
(they do not) the refusal rate (refusing is right); seconds per question, median and p90, over both.
Scoring is flows/evaluation/answers.py's, the one `bench/rgb_answers.py` and `ragline eval` use.

Usage: .venv/bin/python bench/generation_techniques.py [--limit 10] [--only ask,g_notes] [--no-readme]
       [--table-only]
Needs the LLM server of pipelines.yaml (deploy/vllm/serve.sh, or RAGLINE_LLM_BASE_URL). Results are
saved after every variant (bench/out/generation_techniques.json), so an interrupted run keeps what it had.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from common import DATA, OUT, REPO, percentile, publish, save

from ragline.flows.contracts import Answer
from ragline.flows.evaluation.answers import RgbItem, _answer_metrics, _index_corpus, load_rgb
from ragline.flows.run import engine
from ragline.flows.spec.compile import Project, load_project

WORK = OUT / "generation"
SYSTEM = ("You are a precise research assistant. Answer in one short, factual sentence, in a neutral tone, "
          "and cite the reference you used as [n].")
HEAD = """      - {id: rewrite, task: rewrite, with: {mode: conversational}}
      - {id: dense,   task: retrieve_dense,  with: {k: 50}}
      - {id: sparse,  task: retrieve_sparse, with: {k: 50}, after: [rewrite]}
      - {id: fuse,    task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: TOPK}}
"""
INSERT = "      - {id: insert,  task: insert, with: {order: lost_in_the_middle, max_tokens: 1000, max_documents: 5}}\n"
GATE = "      - {id: gate,    task: answerable}\n"
EVIDENCE = "      - {id: evidence, task: extract_answer}\n"  # as the shipped `ask`: evidence first
ANSWER = "      - {id: answer,  task: generate, with: {max_tokens: 128}}\n"
CHECK = "      - {id: check,   task: verify, with: {min_grounding: 0.6, fact_check: false}}\n"
# name: (label, the steps between fuse and insert, the answer step(s), fuse top_k, history?)
# Refining and reranking variants fuse to the 5 passages `insert` keeps anyway (max_documents 5): the
# same references as `ask`, each read once by the LLM instead of 20 times.
VARIANTS: dict[str, tuple[str, str, str, int, bool]] = {
    "ask": ("`ask` (the default)", "", ANSWER, 20, False),
    "g_system": ("system prompt (tone: one short neutral sentence)", "",
                 "      - {id: answer,  task: generate, with: {max_tokens: 128, system: " + json.dumps(SYSTEM) + "}}\n",
                 20, False),
    "g_examples": ("few-shot examples (`retrieve_examples`, k 3)", "",
                   "      - {id: examples, task: retrieve_examples, with: {path: examples.jsonl, k: 3}, after: [gate]}\n"
                   "      - {id: answer,  task: generate, with: {max_tokens: 128}, after: [examples]}\n", 20, False),
    "g_notes": ("chain-of-note (`refine_notes`)", "      - {id: notes,   task: refine_notes}\n", ANSWER, 5, False),
    "g_abstractive": ("abstractive compression (`refine_abstractive`)",
                      "      - {id: compress, task: refine_abstractive}\n", ANSWER, 5, False),
    "g_pairwise": ("pairwise LLM rerank (`rerank_llm` pairwise, sliding, 1 pass)",
                   "      - {id: rerank,  task: rerank_llm, with: {method: pairwise, pairing: sliding, passes: 1, "
                   "candidates: 5, top_k: 5}}\n", ANSWER, 5, False),
    "g_map_reduce": ("map-reduce (`generate_map_reduce`)", "",
                     "      - {id: answer,  task: generate_map_reduce, with: {max_tokens: 128}}\n", 5, False),
    "g_flare_direct": ("FLARE-Direct (`generate_flare` direct)", "",
                       "      - {id: answer,  task: generate_flare, with: {mode: direct, threshold: 0.4, "
                       "max_retrievals: 2}}\n", 20, False),
    "g_flare_instruct": ("FLARE-Instruct (`generate_flare` instruct)", "",
                         "      - {id: answer,  task: generate_flare, with: {mode: instruct, max_retrievals: 2}}\n",
                         20, False),
    "ask_history": ("`ask` after a 10-exchange unrelated conversation", "", ANSWER, 20, True),
    "g_memory": ("`ask` + `recall_history`, same conversation", "", ANSWER, 20, True),
}
MEMORY = "      - {id: memory,  task: recall_history, with: {recent_turns: 2, k: 3, max_tokens: 800}}\n"


def pipeline_yaml(name: str) -> str:
    _, refine, answer, top_k, _ = VARIANTS[name]
    head = (MEMORY if name == "g_memory" else "") + HEAD.replace("TOPK", str(top_k))
    return f"  {name}:\n    kind: query\n    steps:\n{head}{refine}{INSERT}{GATE}{EVIDENCE}{answer}{CHECK}"


def workspace(held_back: list[RgbItem], timeout: float | None = None, workers: int = 1) -> Path:
    """bench/out/generation: the shipped pipelines plus the variants, the prompts, the examples file;
    the LLM's timeout and concurrency raised when asked (the shipped lines, replaced)."""
    WORK.mkdir(parents=True, exist_ok=True)
    variants = "".join(pipeline_yaml(n) for n in VARIANTS if n != "ask")
    text = (REPO / "pipelines.yaml").read_text().replace("\npipelines:\n", "\npipelines:\n" + variants, 1)
    for line, value in (("timeout_seconds: 120", timeout), ("max_concurrency: 4", 4 * workers if workers > 1 else None)):
        if value is not None:
            assert line in text, f"pipelines.yaml's llm resource no longer says {line!r}"
            text = text.replace(line, f"{line.split(':')[0]}: {int(value)}", 1)
    (WORK / "pipelines.yaml").write_text(text)
    if not (WORK / "prompts").exists():
        (WORK / "prompts").symlink_to(REPO / "prompts")
    with open(WORK / "examples.jsonl", "w", encoding="utf-8") as out:
        for item in held_back:
            out.write(json.dumps({"request": item.query, "answer": f"{item.answers[0]} [1]."}) + "\n")
    return WORK / "pipelines.yaml"


def conversation_of(held_back: list[RgbItem], turns: int, seed: int) -> list[dict[str, str]]:
    """``turns`` exchanges about other RGB items: each a question and the gold answer."""
    chosen = random.Random(seed + 1).sample(held_back, turns)
    return [m for item in chosen for m in ({"role": "user", "content": item.query},
                                           {"role": "assistant", "content": f"{item.answers[0]}."})]


def ask(project: Project, pipeline: str, item: RgbItem, history: list[dict[str, str]]) -> tuple[Answer, float]:
    query = {"text": item.query, "filters": {"rgb_id": item.id}, "history": history}
    started = time.perf_counter()
    answer = engine.run(project.pipeline(pipeline), {"query": query}, orchestrate=False)
    return answer, time.perf_counter() - started


def measure(indexed: dict[str, Project], names: list[str], items: list[RgbItem], history: list[dict[str, str]],
            workers: int, done) -> dict[str, dict]:
    """Every (variant, corpus, question), on ``workers`` threads (the API's driver threads run pipelines
    the same way); ``done(name, row)`` is called as each variant completes."""
    jobs = [(name, corpus, item) for name in names for corpus in indexed for item in items]
    outcome: dict[tuple[str, str, str], tuple[Answer, float] | str] = {}

    def one(name: str, corpus: str, item: RgbItem) -> tuple[Answer, float] | str:
        try:
            return ask(indexed[corpus], name, item, history if VARIANTS[name][4] else [])
        except Exception as exc:  # a technique that errors is a result: counted, reported, not hidden
            return f"{corpus}/{item.id}: {type(exc).__name__}: {str(exc)[:300]}"

    rows: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(one, *job): job for job in jobs}
        for future in as_completed(futures):
            name, corpus, item = futures[future]
            outcome[(name, corpus, item.id)] = future.result()
            if sum(key[0] == name for key in outcome) == len(indexed) * len(items):
                rows[name] = _row(outcome, name, list(indexed), items)
                done(name, rows[name])
    return rows


def _row(outcome: dict, name: str, corpora: list[str], items: list[RgbItem]) -> dict:
    row: dict = {}
    seconds: list[float] = []
    failures: list[str] = []
    for corpus in corpora:
        answers, scored = [], []
        for item in items:
            got = outcome[(name, corpus, item.id)]
            if isinstance(got, str):
                failures.append(got)
                continue
            answers.append(got[0])
            scored.append(item)
            seconds.append(got[1])
        row[corpus] = _answer_metrics(answers, scored, lambda i: i.answers)
        row[corpus]["answered"] = len(answers)
    row["median_s"] = round(percentile(seconds, 50), 2) if seconds else None
    row["p90_s"] = round(percentile(seconds, 90), 2) if seconds else None
    row["failures"] = failures
    return row


def table(result: dict) -> list[str]:
    workers = result.get("workers", 1)
    lines = [f"RGB en_fact, a seeded subset of {result['questions']} of the 100 questions (seed {result['seed']}), "
             f"model {result['model']} (SmolLM2-135M-Instruct, fp32, vLLM CPU, 2 shared cores), one run. With "
             f"{result['questions']} questions one answer moves a rate by {1 / result['questions']:.2f}. "
             + (f"{workers} questions in flight at once (every variant interleaved on one server): the seconds are "
                f"under that load (and its changes during the run), not the techniques' own." if workers > 1 else ""), "",
             "| variant | accuracy (answer in refs) | refusal (answer in refs) | cited | citations valid | "
             "refusal (answer not in refs) | s / question median | p90 | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (label, *_) in VARIANTS.items():
        row = result["variants"].get(name)
        if row is None:
            continue
        p, n = row["positive"], row["negative"]
        lines.append(f"| {label} | {p['accuracy']:.2f} | {p['refusal_rate']:.2f} | {p['citation_rate']:.2f} | "
                     f"{p['citation_validity']:.2f} | {n['refusal_rate']:.2f} | {row['median_s']} | {row['p90_s']} | "
                     f"{len(row['failures'])} |")
    missing = [label for name, (label, *_) in VARIANTS.items() if name not in result["variants"]]
    if missing:
        lines += ["", "Not measured in this run (it was stopped first): " + "; ".join(missing) + "."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="questions (a seeded subset of the 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turns", type=int, default=10, help="exchanges in the conversation variants' history")
    parser.add_argument("--workers", type=int, default=1, help="questions in flight at once (1: latency as a "
                                                                   "user sees it; more: throughput on a busy server)")
    parser.add_argument("--llm-timeout", type=float, help="the LLM resource's timeout_seconds (a saturated CPU "
                                                          "server needs more than the shipped 120)")
    parser.add_argument("--only", help="comma-separated variants (default: all); merged into the saved result")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite the docs table from the last run")
    args = parser.parse_args()
    saved = OUT / "generation_techniques.json"
    if args.table_only:
        publish("generation", table(json.loads(saved.read_text())), readme=not args.no_readme)
        return
    items = load_rgb(DATA / "rgb" / "en_fact.json")
    picked = set(random.Random(args.seed).sample(range(len(items)), args.limit))
    evaluated = [item for i, item in enumerate(items) if i in picked]
    held_back = [item for i, item in enumerate(items) if i not in picked]
    project = load_project(workspace(held_back, args.llm_timeout, args.workers), tuned=False)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    previous = json.loads(saved.read_text()) if args.only and saved.exists() else {}
    same = previous.get("questions") == args.limit and previous.get("seed") == args.seed
    result = {"questions": len(evaluated), "seed": args.seed, "turns": args.turns, "workers": args.workers,
              "model": project.spec.resources["llm"].model, "ids": [i.id for i in evaluated],
              "variants": previous.get("variants", {}) if same else {}}
    indexed = {corpus: _index_corpus(project, evaluated, corpus, WORK / "eval", orchestrate=False)
               for corpus in ("positive", "negative")}
    history = conversation_of(held_back, args.turns, args.seed)
    ask(indexed["positive"], "ask", evaluated[0], [])  # loads the models and warms the server; not timed
    started = time.perf_counter()

    def done(name: str, row: dict) -> None:
        result["variants"][name] = row
        print(f"{name} (at {time.perf_counter() - started:.0f} s): {json.dumps(row)[:800]}", flush=True)
        save("generation_techniques", result)

    measure(indexed, names, evaluated, history, args.workers, done)
    publish("generation", table(result), readme=not args.no_readme)


if __name__ == "__main__":
    main()
