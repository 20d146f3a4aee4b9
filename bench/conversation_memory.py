"""Conversation memory (tasks/rewrite/recall_history.py): how often the turn a question refers back to is in
the conversation the LLM is shown, `recall_history` against the last N turns, at the same token budget.

Synthetic long conversations built at run time from RGB en_fact (RAGLINE_DATA_DIR, never copied):
each has `--turns` exchanges, one RGB question per exchange (the user asks it, the assistant answers
with the gold answer and the first positive passage), and a current question that refers back to
one exchange placed anywhere but the last three. Two kinds of reference: by topic ("Going back to
<the RGB question>: are you sure?") and by what was answered ("You mentioned <answer> earlier. Tell
me more about it.": the words are in the assistant's reply only). Tokens are the packaged embedder's
(the stage's count without an LLM). No LLM is called: this measures selection, not answers.

Usage: RAGLINE_DATA_DIR=../shared/data .venv/bin/python bench/conversation_memory.py [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from common import DATA, publish, save

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.rewrite import recall_history as memory
from ragline.tasks.rewrite.recall_history import Params, recall_history

REFERENCES = {"topic": "Going back to {query}: are you sure about that?",
              "answer": "You mentioned {answer} earlier. Tell me more about it."}
METHODS = {  # name: params (the budget is added per row)
    "last N turns": {"recent_turns": 100, "k": 0},
    "recall_history (2 recent + 3 recalled), embeddings only": {"recent_turns": 2, "k": 3, "lexical_weight": 0},
    "recall_history, BM25 blend 0.3 (the default)": {"recent_turns": 2, "k": 3, "lexical_weight": 0.3},
}


def items() -> list[dict]:
    with open(DATA / "rgb" / "en_fact.json", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def exchange(item: dict) -> list[dict[str, str]]:
    answer = item["answer"] if isinstance(item["answer"], str) else item["answer"][0]
    return [{"role": "user", "content": f"{item['query']}?"},
            {"role": "assistant", "content": f"{answer}. {item['positive'][0]}"}]


def conversations(data: list[dict], turns: int, seed: int) -> list[tuple[list[dict[str, str]], str, int, str]]:
    """(history, question, index of the needed turn's first message, kind), one per RGB item and kind."""
    rng = random.Random(seed)
    out = []
    for needed in data:
        others = rng.sample([d for d in data if d is not needed], turns - 1)
        at = rng.randrange(0, turns - 3)  # never among the last three turns
        chosen = others[:at] + [needed] + others[at:]
        history = [m for item in chosen for m in exchange(item)]
        answer = needed["answer"] if isinstance(needed["answer"], str) else needed["answer"][0]
        for kind, template in REFERENCES.items():
            out.append((history, template.format(query=needed["query"], answer=answer), 2 * at, kind))
    return out


def recalled(embedder: Embedder, history, question: str, params: Params, needed: int) -> tuple[bool, int]:
    query = recall_history.fn(query=Query(text=question, history=history), params=params,
                              ctx=StepContext(pipeline="bench", step_id="memory"), embedder=embedder)
    return history[needed] in query.conversation, len(query.conversation) // 2


def latency(embedder: Embedder, history, question: str, runs: int = 5) -> tuple[float, float]:
    """Milliseconds of one call with nothing memoised, and of the next request of the same conversation."""
    params = Params(recent_turns=2, k=3, max_tokens=512)
    cold = []
    for _ in range(runs):
        memory._MEMOS.clear()
        start = time.perf_counter()
        recall_history.fn(query=Query(text=question, history=history[:-2]), params=params,
                          ctx=StepContext(pipeline="bench", step_id="memory"), embedder=embedder)
        cold.append(time.perf_counter() - start)
    warm = []
    for _ in range(runs):
        start = time.perf_counter()
        recall_history.fn(query=Query(text=question, history=history), params=params,
                          ctx=StepContext(pipeline="bench", step_id="memory"), embedder=embedder)
        warm.append(time.perf_counter() - start)
    return 1000 * statistics.median(cold), 1000 * statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=16, help="exchanges per conversation")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-readme", action="store_true", help="print only, do not update docs/results.md")
    args = parser.parse_args()
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    cases = conversations(items(), args.turns, args.seed)
    sizes = memory.token_counts(embedder, [c[0][i]["content"] for c in cases[:20] for i in range(len(c[0]))])
    results: dict[str, dict] = {}
    for budget in args.budgets:
        for name, settings in METHODS.items():
            params = Params(max_tokens=budget, **settings)
            found: dict[str, list[bool]] = {kind: [] for kind in REFERENCES}
            shown = []
            for history, question, needed, kind in cases:
                hit, turns = recalled(embedder, history, question, params, needed)
                found[kind].append(hit)
                shown.append(turns)
            results[f"{budget}/{name}"] = {"budget": budget, "method": name, "turns_shown": statistics.mean(shown),
                                           **{kind: statistics.mean(hits) for kind, hits in found.items()}}
    cold_ms, warm_ms = latency(embedder, cases[0][0], cases[0][1])
    save("conversation_memory", {"results": results, "cold_ms": cold_ms, "warm_ms": warm_ms, "turns": args.turns,
                                 "conversations": len(cases) // len(REFERENCES)})
    lines = [f"{len(cases) // len(REFERENCES)} synthetic conversations of {args.turns} exchanges from RGB en_fact "
             f"(a message is {statistics.mean(sizes):.0f} embedder tokens on average); the question refers back to "
             f"one exchange before the last three. Recall: the share of questions whose needed exchange is in the "
             f"conversation shown.",
             "",
             "| budget (tokens) | selection | turns shown | recall, reference by topic | recall, by answer |",
             "|---|---|---|---|---|"]
    for row in results.values():
        lines.append(f"| {row['budget']} | {row['method']} | {row['turns_shown']:.1f} | {row['topic']:.2f} | "
                     f"{row['answer']:.2f} |")
    lines += ["", f"Latency of `recall_history` ({args.turns - 1} exchanges, 512 tokens, all-MiniLM-L6-v2 on CPU): "
                  f"{cold_ms:.0f} ms with every turn embedded, {warm_ms:.0f} ms for the conversation's next "
                  f"request (earlier turns memoised)."]
    publish("conversation_memory", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
