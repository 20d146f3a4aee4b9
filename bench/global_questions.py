"""Corpus-level questions: `ask` against `ask_global` (the community summary index), on a collection
whose themes are known, with the packaged model (SmolLM2-135M on the CPU vLLM).

The collection: SciFact abstracts whose titles name one of four diseases (cancer, HIV, diabetes,
malaria) and RGB news passages of three kinds (tennis, video games, films), a few documents each,
so every document has a known theme. Nothing is tuned on it: the shipped `summarize` and
`ask_global` settings run as they are (the summary budgets lowered for CPU time, printed below).

Figures (all measured in this run):
- clustering: for how many themes a fine community has that theme as its majority (model-free);
- summaries: how many themes' keywords the fine summaries' text names (depends on the LLM's summaries);
- contexts: the themes of the documents `ask` would insert (its search's top 5) against the themes
  named by the summaries `ask_global` inserts;
- answers: the share of themes whose keywords the final answer names (a crude score, said so), the
  refusals, and the seconds per question;
- build: the summarize job's seconds and LLM calls, from scratch and after one document changed.

Needs the LLM server (RAGLINE_LLM_BASE_URL), or starts the packaged one (deploy/vllm/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import DATA, REPO, SCIFACT, publish, save

THEMES = {  # theme -> keywords whose presence in a text counts as naming it
    "cancer": ["cancer", "tumor", "tumour", "oncolog", "carcinoma"],
    "hiv": ["hiv", "aids", "antiretroviral"],
    "diabetes": ["diabetes", "diabetic", "insulin", "glucose"],
    "malaria": ["malaria", "plasmodium"],
    "tennis": ["tennis", "wimbledon", "grand slam", "singles"],
    "video games": ["video game", "game", "nintendo", "playstation", "xbox", "console"],
    "films": ["film", "movie", "director", "cinema", "actor", "actress"],
}
SCIFACT_TITLES = {"cancer": ["cancer"], "hiv": ["hiv"], "diabetes": ["diabetes"], "malaria": ["malaria"]}
RGB_QUERIES = {"tennis": ["wimbledon", "u.s. open", "tennis"],
               "video games": ["released", "release date"],
               "films": ["director", "directed", "movie"]}
QUESTIONS = ["What are the main themes of these documents?",
             "Which topics does this collection of documents cover?",
             "Give an overview of the subjects these documents discuss."]
PIPELINES = """
  bench_search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 50}}
      - {id: sparse, task: retrieve_sparse, with: {k: 50}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60, top_k: 5}}
  bench_summaries:
    kind: query
    steps:
      - {id: summaries, task: retrieve_summaries, with: {level: fine, top_k: TOP_K}}
"""


def names(text: str) -> set[str]:
    low = text.lower()
    return {t for t, words in THEMES.items() if any(re.search(rf"\b{re.escape(w)}", low) for w in words)}


def corpus(per_theme: int) -> list[dict]:
    """Documents with a known theme (``theme`` in their metadata)."""
    docs: list[dict] = []
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    for theme, words in SCIFACT_TITLES.items():
        hits = [r for r in rows if any(w in r["title"].lower() for w in words)
                and not (names(r["title"]) - {theme})][:per_theme]
        docs += [{"_id": f"scifact-{r['_id']}", "title": r["title"], "text": r["text"][:1200],
                  "metadata": {"theme": theme}} for r in hits]
    with open(DATA / "rgb" / "en_fact.json", encoding="utf-8") as handle:
        items = [json.loads(line) for line in handle]
    for theme, words in RGB_QUERIES.items():
        taken = 0
        for item in items:
            if taken >= per_theme or not any(w in item["query"].lower() for w in words):
                continue
            if (theme != "video games" and "released" in item["query"].lower()) or "gpt" in item["query"].lower():
                continue
            docs.append({"_id": f"rgb-{item['id']}", "title": item["query"], "text": item["positive"][0][:1200],
                         "metadata": {"theme": theme}})
            taken += 1
    return docs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-theme", type=int, default=6)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--small", action="store_true", help="CPU budgets for a loaded machine: 3 central chunks "
                        "of 700 characters per summary, 48-token summaries, 4 summaries of 48-token notes per answer")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--clusters-only", action="store_true", help="model-free figures only: the summaries are "
                        "written by a stand-in server (tests/scripted_llm.py), so only the communities' themes and "
                        "ask's retrieved themes mean anything; no table is written")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints where a long run is
    from ragline.flows.ops.llm_server import start_vllm
    from ragline.flows.resources.stores import summaries
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    server = None
    if args.clusters_only:
        sys.path.insert(0, str(REPO))
        from tests.scripted_llm import ScriptedLLM

        server = ScriptedLLM(lambda prompt: "A summary. Score: 50").__enter__()
        server.stop = lambda: server.__exit__(None, None, None)
        os.environ["RAGLINE_LLM_BASE_URL"] = server.base_url
        args.no_readme = True
    elif not os.environ.get("RAGLINE_LLM_BASE_URL"):
        server = start_vllm()
        os.environ["RAGLINE_LLM_BASE_URL"] = server.base_url
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            docs = corpus(args.per_theme)
            theme_of = {d["_id"]: d["metadata"]["theme"] for d in docs}
            (work / "corpus").mkdir()
            (work / "corpus" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
            shown = PIPELINES.replace("TOP_K", "4" if args.small else "8")
            text = (REPO / "pipelines.yaml").read_text().replace("\npipelines:\n", "\npipelines:\n" + shown, 1)
            text = text.replace("[samples/docs]", "[corpus]")
            (work / "pipelines.yaml").write_text(text)
            (work / "prompts").symlink_to(REPO / "prompts")
            project = load_project(work / "pipelines.yaml")
            engine.run(project.pipeline("index"), orchestrate=False)
            print(f"indexed {len(docs)} documents; summarising", flush=True)
            build_params = {"summary_tokens": 96}
            global_params: dict = {}
            ask_params: dict = {}
            if args.small:
                build_params = {"summary_tokens": 48, "member_chunks": 3, "max_chunk_chars": 700}
                global_params = {"summaries": {"top_k": 4}, "answer": {"map_tokens": 48, "max_tokens": 96}}
                ask_params = {"answer": {"max_tokens": 64}}
            started = time.perf_counter()
            built = engine.run(project.pipeline("summarize").with_overrides({"summarize": build_params}),
                               orchestrate=False)
            build_s = time.perf_counter() - started
            fine = [c for c in built.communities if c.level == 1]

            def source_theme(source_id: str) -> str:
                return theme_of[source_id.rsplit("#", 1)[-1]]

            majority = {Counter(source_theme(d) for d in c.documents).most_common(1)[0][0] for c in fine}
            summary_themes = set().union(*(names(c.summary) for c in fine))
            top_themes = set().union(*(names(c.summary) for c in built.communities if c.level == 0))
            rows = []
            if args.clusters_only:
                ctx = [{source_theme(p.source_id) for p in engine.run(project.pipeline("bench_search"),
                                                                       {"query": {"text": q}}, orchestrate=False)}
                       for q in QUESTIONS]
                print(json.dumps({"documents": len(docs), "chunks": built.chunks, "fine": len(fine),
                                  "majority_themes": sorted(majority), "fine_communities": [
                                      dict(Counter(source_theme(d) for d in c.documents)) for c in fine],
                                  "ask_top5_themes": [sorted(c) for c in ctx]}, indent=1))
                return
            for question in QUESTIONS[: args.questions]:
                found = engine.run(project.pipeline("bench_search"), {"query": {"text": question}}, orchestrate=False)
                ask_ctx = {source_theme(p.source_id) for p in found}
                t0 = time.perf_counter()
                ask = engine.run(project.pipeline("ask").with_overrides(ask_params), {"query": {"text": question}}, orchestrate=False)
                t1 = time.perf_counter()
                glob = engine.run(project.pipeline("ask_global").with_overrides(global_params), {"query": {"text": question}}, orchestrate=False)
                t2 = time.perf_counter()
                got = engine.run(project.pipeline("bench_summaries"), {"query": {"text": question}},
                                 orchestrate=False)
                glob_ctx = set().union(*(names(p.text) for p in got)) if got else set()
                rows.append({"question": question, "ask_context": sorted(ask_ctx), "global_context": sorted(glob_ctx),
                             "ask": {"text": ask.text, "refused": ask.refused, "themes": sorted(names(ask.text)),
                                     "seconds": t1 - t0},
                             "ask_global": {"text": glob.text, "refused": glob.refused,
                                            "themes": sorted(names(glob.text)), "seconds": t2 - t1,
                                            "cited_documents": sum(len(s.documents) for s in glob.sources)}})
                print(json.dumps(rows[-1], indent=1), flush=True)
            # incremental: one document changed, the job re-run
            changed = docs[0]["_id"]
            docs[0] = {**docs[0], "text": docs[0]["text"] + " A follow-up study confirmed these findings."}
            (work / "corpus" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
            engine.run(project.pipeline("index"), orchestrate=False)
            started = time.perf_counter()
            again = engine.run(project.pipeline("summarize").with_overrides({"summarize": build_params}),
                               orchestrate=False)
            again_s = time.perf_counter() - started
            path = summaries.summaries_path(project.resource("state").path)
    finally:
        if server is not None:
            server.stop()
    n = len(THEMES)

    def share(key: str, pipeline: str | None = None) -> float:
        vals = [len(r[pipeline]["themes"]) if pipeline else len(r[key]) for r in rows]
        return statistics.mean(vals) / n

    result = {
        "documents": len(docs), "themes": n, "chunks": built.chunks, "fine": len(fine),
        "top": len(built.communities) - len(fine), "build_seconds": build_s, "build_calls": built.llm_calls,
        "majority_themes": sorted(majority), "summary_themes": sorted(summary_themes), "top_themes": sorted(top_themes),
        "incremental": {"changed": changed, "summarised": again.summarised, "reused": len(again.reused),
                        "calls": again.llm_calls, "seconds": again_s, "reclustered": again.reclustered},
        "questions": rows, "file": str(path.name), "build_params": build_params, "global_params": global_params,
        "ask_params": ask_params,
    }
    save("global_questions", result)
    lines = [
        f"{len(docs)} documents of {n} known themes (SciFact: cancer, HIV, diabetes, malaria; RGB news: tennis, "
        f"video games, films), {built.chunks} chunks; `summarize` (shipped settings but {json.dumps(build_params)}) made "
        f"{len(fine)} fine and {len(built.communities) - len(fine)} top communities; SmolLM2-135M on the CPU vLLM, "
        f"{len(rows)} corpus-level question(s) (`bench/global_questions.py{' --small' if args.small else ''}`; "
        f"ask_global overrides {json.dumps(global_params) or 'none'}, ask overrides {json.dumps(ask_params) or 'none'}).",
        "",
        "| measure | `ask` | `ask_global` |",
        "|---|---|---|",
        f"| themes in the inserted context (ask: themes of its top-5 documents; global: themes the retrieved "
        f"summaries name), mean share | {share('ask_context'):.2f} | {share('global_context'):.2f} |",
        f"| themes the answer names (keywords), mean share | {share('', 'ask'):.2f} | {share('', 'ask_global'):.2f} |",
        f"| refused | {sum(r['ask']['refused'] for r in rows)}/{len(rows)} | "
        f"{sum(r['ask_global']['refused'] for r in rows)}/{len(rows)} |",
        f"| seconds per question, median | {statistics.median(r['ask']['seconds'] for r in rows):.1f} | "
        f"{statistics.median(r['ask_global']['seconds'] for r in rows):.1f} |",
        "",
        f"Model-independent: the fine communities recover {len(majority)}/{n} themes as a majority "
        f"({', '.join(sorted(majority))}). The fine summaries name {len(summary_themes)}/{n} themes, the top "
        f"summaries {len(top_themes)}/{n}. Build: {build_s:.0f} s, {built.llm_calls} LLM calls from scratch; after one "
        f"document changed, {again.llm_calls} calls ({', '.join(again.summarised) or 'none'} re-summarised, "
        f"{len(again.reused)} kept), {again_s:.0f} s.",
    ]
    publish("global_questions", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
