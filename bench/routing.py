"""Request classification (tasks/rewrite/classify.py): how often the embedding classifier labels a request
right, and the latency the `classify` step adds to a request.

Labelled set, read at run time from RAGLINE_DATA_DIR (nothing copied into the repository): SciFact
claims (`claim`, queries.jsonl), RGB questions (`question`, rgb/en_fact.json) and 60 chit-chat lines
written for this benchmark (`chitchat`, bench/chitchat.txt). Per class, `--train` examples (seeded
shuffle) are the step's labelled examples; the rest (claims capped at `--max-claims`) are held out and
classified. Reported: 3-class accuracy and the confusion matrix per method (knn, centroid), the
routing decision `ask_routed` makes (retrieve = claim or question, vs chit-chat), and the shipped
`ask_routed` classifier (its own examples from pipelines.yaml, none from this data) on every request.

Latency: the classify step alone (one query embedding with the packaged MiniLM plus a dot product),
median and p95 over the held-out requests, embedder warm.

LLM mode (`--llm`: this alone, into its own table; needs the LLM server of pipelines.yaml: deploy/vllm/serve.sh or RAGLINE_LLM_BASE_URL):
a seeded class-balanced subset of the held-out requests (`--llm-per-class`, 25 of each class)
classified by the packaged model (held to the labels by the JSON schema), twice: the three classes with a one-line description each, and the two-way routing decision
(retrieve vs chitchat, described as ask_routed would). No examples are shown to the LLM. Its latency is
the step's (prompt, HTTP round trip to the CPU vLLM, parsing), median and p95. Without `--llm`, LLM
mode is timed against the scripted OpenAI-compatible server only (the plumbing).

Usage: .venv/bin/python bench/routing.py [--train 20] [--max-claims 200] [--no-readme]
       .venv/bin/python bench/routing.py --llm [--llm-per-class 25] [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

from common import DATA, REPO, percentile, publish, save

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.rewrite.classify import Params, classify

CLASSES = ("claim", "question", "chitchat")
ROUTE = {"claim": "retrieve", "question": "retrieve", "chitchat": "chitchat"}


def labelled() -> dict[str, list[str]]:
    claims = [json.loads(line)["text"] for line in (DATA / "scifact" / "queries.jsonl").open(encoding="utf-8")]
    questions = [json.loads(line)["query"] for line in (DATA / "rgb" / "en_fact.json").open(encoding="utf-8")
                 if line.strip()]
    chitchat = [line.strip() for line in (REPO / "bench" / "chitchat.txt").open(encoding="utf-8") if line.strip()]
    return {"claim": claims, "question": questions, "chitchat": chitchat}


def split(data: dict[str, list[str]], train: int, max_claims: int, seed: int) -> tuple[dict, list[tuple[str, str]]]:
    rng = random.Random(seed)
    examples, held_out = {}, []
    for label, texts in data.items():
        texts = list(dict.fromkeys(texts))
        rng.shuffle(texts)
        examples[label] = texts[:train]
        rest = texts[train:]
        held_out += [(t, label) for t in (rest[:max_claims] if label == "claim" else rest)]
    return examples, held_out


def run(text: str, params: Params, embedder: Embedder, ctx: StepContext, step: str = "route") -> tuple[str, float]:
    started = time.perf_counter()
    query = classify.fn(query=Query(text=text), params=params, ctx=ctx, embedder=embedder)
    return query.labels[step].label, time.perf_counter() - started


def encoding(text: str, embedder: Embedder) -> float:
    """The query embedding alone: what the step costs at the least (the machine's load shows here too)."""
    started = time.perf_counter()
    embedder.encode_queries([text])
    return time.perf_counter() - started


def confusion(pairs: list[tuple[str, str]], classes: tuple[str, ...]) -> list[str]:
    counts = Counter(pairs)
    lines = ["| true \\ predicted | " + " | ".join(classes) + " | recall |", "|---" * (len(classes) + 2) + "|"]
    for truth in classes:
        row = [counts[(truth, p)] for p in classes]
        lines.append(f"| {truth} | " + " | ".join(map(str, row)) + f" | {row[classes.index(truth)] / max(1, sum(row)):.3f} |")
    return lines


def llm_latency(n: int) -> dict[str, float]:
    """LLM mode against the scripted server: the plumbing only (no model behind it)."""
    from ragline.flows.resources.models.llm import LLMClient, LLMSpec
    from tests.scripted_llm import ScriptedLLM

    params = Params(mode="llm", labels={"retrieve": {"description": "a question the documents answer"},
                                        "chitchat": {"description": "greetings, thanks, small talk"}})
    with ScriptedLLM(lambda prompt: '{"label": "chitchat"}') as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, model="m", max_retries=0))
        ctx = StepContext(pipeline="bench", step_id="route", prompt_name="classify",
                          render_prompt=PromptLibrary(REPO / "prompts").render)
        classify.fn(query=Query(text="warm up"), params=params, ctx=ctx, llm=llm)
        seconds = []
        for i in range(n):
            started = time.perf_counter()
            classify.fn(query=Query(text=f"hello number {i}"), params=params, ctx=ctx, llm=llm)
            seconds.append(time.perf_counter() - started)
    return {"median_ms": 1000 * percentile(seconds, 50), "p95_ms": 1000 * percentile(seconds, 95)}


LLM_LABELS = {
    "classes": ({"claim": "a scientific statement asserted as true or false, not a question",
                 "question": "a question asking for a fact: who, what, when, where, which",
                 "chitchat": "greetings, thanks, small talk or remarks about the conversation"}, "question"),
    "routing": ({"retrieve": "a question or claim that documents could answer or support",
                 "chitchat": "greetings, thanks, small talk or remarks about the conversation"}, "retrieve"),
}


def llm_sample(held_out: list[tuple[str, str]], per_class: int, seed: int) -> list[tuple[str, str]]:
    """A seeded, class-balanced subset of the held-out requests (``per_class`` of each; 0: all of them)."""
    if per_class <= 0:
        return held_out
    rng = random.Random(seed)
    return [pair for label in CLASSES for pair in rng.sample([p for p in held_out if p[1] == label],
                                                             min(per_class, sum(p[1] == label for p in held_out)))]


def llm_accuracy(held_out: list[tuple[str, str]], timeout: float | None = None) -> tuple[dict, list[str]]:
    """LLM mode with the packaged model on the held-out requests: 3 classes, then the routing decision."""
    from ragline.flows.resources.models.llm import LLMClient

    spec = load_project(REPO / "pipelines.yaml", tuned=False).spec.resources["llm"]
    llm = LLMClient(spec.model_copy(update={"timeout_seconds": timeout}) if timeout else spec)
    ctx = StepContext(pipeline="bench", step_id="route", prompt_name="classify",
                      render_prompt=PromptLibrary(REPO / "prompts").render)
    results, tables = {}, []
    for task, (described, fallback) in LLM_LABELS.items():
        params = Params(mode="llm", default=fallback, labels={k: {"description": d} for k, d in described.items()})
        truth_of = (lambda t: t) if task == "classes" else ROUTE.get
        classify.fn(query=Query(text="warm up"), params=params, ctx=ctx, llm=llm)
        pairs, seconds, defaulted = [], [], 0
        for text, truth in held_out:
            started = time.perf_counter()
            label = classify.fn(query=Query(text=text), params=params, ctx=ctx, llm=llm).labels["route"]
            seconds.append(time.perf_counter() - started)
            pairs.append((truth_of(truth), label.label))
            defaulted += label.mode == "default"
        accuracy = sum(t == p for t, p in pairs) / len(pairs)
        routed = sum(ROUTE.get(t, t) == ROUTE.get(p, p) for t, p in pairs) / len(pairs)
        latency = {"median_ms": 1000 * percentile(seconds, 50), "p95_ms": 1000 * percentile(seconds, 95)}
        results[task] = {"accuracy": accuracy, "routing_accuracy": routed, "latency": latency,
                         "unparsed_replies": defaulted,
                         "confusion": {f"{t}->{p}": n for (t, p), n in Counter(pairs).items()}}
        classes = tuple(described)
        what = (f"3-class accuracy {accuracy:.3f}, retrieve vs chit-chat {routed:.3f}" if task == "classes"
                else f"routing accuracy {accuracy:.3f}")
        tables += [f"**LLM mode, packaged SmolLM2-135M, {'3 classes' if task == 'classes' else 'retrieve vs chitchat'}** "
                   f"({len(held_out)} held-out requests; a one-line description per label, no examples; replies held "
                   f"to the labels by the JSON schema, "
                   f"{defaulted} unreadable): {what}; the step adds {latency['median_ms']:.0f} ms median, "
                   f"{latency['p95_ms']:.0f} ms p95 (CPU vLLM, shared 2 cores)", "", *confusion(pairs, classes), ""]
    return results, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=20, help="labelled examples per class")
    parser.add_argument("--max-claims", type=int, default=200, help="held-out SciFact claims")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llm", action="store_true", help="measure LLM mode (only) with the configured LLM server")
    parser.add_argument("--llm-per-class", type=int, default=25,
                        help="LLM mode: held-out requests per class (seeded; 0: all)")
    parser.add_argument("--llm-timeout", type=float, help="LLM mode: the LLM's timeout_seconds (a saturated CPU "
                                                          "server needs more than the shipped 120)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()

    examples, held_out = split(labelled(), args.train, args.max_claims, args.seed)
    if args.llm:  # its own table (bench:routing_llm); the embedding figures stay those of their last run
        results, tables = llm_accuracy(llm_sample(held_out, args.llm_per_class, args.seed), args.llm_timeout)
        save("routing_llm", {"train_per_class": args.train, "per_class": args.llm_per_class, **results})
        publish("routing_llm", tables, readme=not args.no_readme)
        return
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    ctx = StepContext(pipeline="bench", step_id="route")
    results: dict = {"train_per_class": args.train, "held_out": dict(Counter(label for _, label in held_out))}
    tables: list[str] = []
    for method in ("knn", "centroid"):
        params = Params(labels={c: {"examples": examples[c]} for c in CLASSES}, method=method, k=5)
        run(held_out[0][0], params, embedder, ctx)  # embeds the examples once; not timed
        predicted, seconds, encoded = zip(*((*run(text, params, embedder, ctx), encoding(text, embedder))
                                            for text, _ in held_out))  # interleaved: the same load on both
        pairs = [(truth, guess) for (_, truth), guess in zip(held_out, predicted)]
        accuracy = sum(t == p for t, p in pairs) / len(pairs)
        routed = sum(ROUTE[t] == ROUTE[p] for t, p in pairs) / len(pairs)
        latency = {"median_ms": 1000 * percentile(list(seconds), 50), "p95_ms": 1000 * percentile(list(seconds), 95),
                   "encode_median_ms": 1000 * percentile(list(encoded), 50)}
        results[method] = {"accuracy": accuracy, "routing_accuracy": routed, "latency": latency,
                           "confusion": {f"{t}->{p}": n for (t, p), n in Counter(pairs).items()}}
        tables += [f"**{method}** ({args.train} examples per class): 3-class accuracy {accuracy:.3f}, retrieve vs "
                   f"chit-chat {routed:.3f}; the step adds {latency['median_ms']:.1f} ms median, "
                   f"{latency['p95_ms']:.1f} ms p95 (the query embedding alone: {latency['encode_median_ms']:.1f} ms median)",
                   "", *confusion(pairs, CLASSES), ""]

    shipped = load_project(REPO / "pipelines.yaml", tuned=False).pipeline("ask_routed").step("route").params
    everything = [(t, label) for label, texts in examples.items() for t in texts] + held_out
    guesses = [(ROUTE[truth], run(text, shipped, embedder, ctx)[0]) for text, truth in everything]
    shipped_accuracy = sum(t == p for t, p in guesses) / len(guesses)
    results["shipped_ask_routed"] = {"accuracy": shipped_accuracy, "requests": len(guesses),
                                     "confusion": {f"{t}->{p}": n for (t, p), n in Counter(guesses).items()}}
    loose = shipped.model_copy(update={"min_similarity": None})
    unfloored = sum(t == run(text, loose, embedder, ctx)[0] for (text, _), (t, _) in zip(everything, guesses))
    results["shipped_ask_routed"]["accuracy_without_min_similarity"] = unfloored / len(guesses)
    tables += [f"**shipped `ask_routed`** (its {sum(len(s.examples) for s in shipped.labels.values())} examples in "
               f"pipelines.yaml, none from this data; min_similarity {shipped.min_similarity}), all {len(guesses)} "
               f"requests: routing accuracy {shipped_accuracy:.3f} (without min_similarity: "
               f"{unfloored / len(guesses):.3f})", "", *confusion(guesses, ("retrieve", "chitchat")), ""]

    results["llm_scripted_latency"] = llm_latency(50)
    tables.append(f"LLM mode, scripted server (the plumbing alone: prompt, HTTP round trip, parsing): "
                  f"{results['llm_scripted_latency']['median_ms']:.1f} ms median, "
                  f"{results['llm_scripted_latency']['p95_ms']:.1f} ms p95 per request")
    save("routing", results)
    publish("routing", tables, readme=not args.no_readme)


if __name__ == "__main__":
    main()
