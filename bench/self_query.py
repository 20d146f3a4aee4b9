"""Self-query rules (tasks/rewrite/self_query.py, ``mode: rules``): how often the filter read out of a
request is the right one, and what the stage adds to a query.

Labelled set: 40 phrasings written for this benchmark (not the unit tests' ones), each a SciFact
claim with a time or venue phrase around it, and the filter a person would mean (None: no
filter: numbers that are counts, years out of range, negations). The claims carry their own
numbers ("1 in 5,000", "p53", "COVID-19"), so a rule that fires on any number is caught. Then
every SciFact query as written (no phrase added): any filter there is a false positive.

Usage: .venv/bin/python bench/self_query.py [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from common import SCIFACT, percentile, publish, save

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.tasks.rewrite.self_query import Params, self_query

PARAMS = Params(fields={"year": {"type": "int", "min": 1950, "max": 2030},
                        "venue": {"type": "enum", "values": ["pubmed", "arxiv", "cochrane", "medrxiv"]}})
Y = "year"
RANGE = lambda low, high: {"$and": [{Y: {"$gte": low}}, {Y: {"$lte": high}}]}  # noqa: E731

LABELLED: list[tuple[str, dict | None]] = [
    ("Studies from 2014: {claim}", {Y: {"$eq": 2014}}),
    ("{claim} (evidence published in 2009)", {Y: {"$eq": 2009}}),
    ("Is it true that {claim}? Only papers from 2017.", {Y: {"$eq": 2017}}),
    ("What did 2012 studies find on this: {claim}", {Y: {"$eq": 2012}}),
    ("{claim} -- research since 2016", {Y: {"$gte": 2016}}),
    ("Since 2010, has anyone shown that {claim}?", {Y: {"$gte": 2010}}),
    ("{claim}; results from 2018 onwards", {Y: {"$gte": 2018}}),
    ("2015 or later papers: {claim}", {Y: {"$gte": 2015}}),
    ("Trials after 2011 on whether {claim}", {Y: {"$gt": 2011}}),
    ("{claim} in work published after 2005", {Y: {"$gt": 2005}}),
    ("Before 2000, was it known that {claim}?", {Y: {"$lt": 2000}}),
    ("{claim}, in papers prior to 2008", {Y: {"$lt": 2008}}),
    ("Reports up to 2013: {claim}", {Y: {"$lte": 2013}}),
    ("{claim} -- articles until 2019", {Y: {"$lte": 2019}}),
    ("Between 2010 and 2015, which studies found that {claim}?", RANGE(2010, 2015)),
    ("{claim} (from 2001 to 2004)", RANGE(2001, 2004)),
    ("2016-2020 evidence: {claim}", RANGE(2016, 2020)),
    ("{claim}, 1995–1999 reviews", RANGE(1995, 1999)),
    ("Research in the 1980s on: {claim}", RANGE(1980, 1989)),
    ("{claim} in 2019 or 2020 studies", {Y: {"$in": [2019, 2020]}}),
    ("Cochrane reviews: {claim}", {"venue": "cochrane"}),
    ("{claim} -- on medRxiv", {"venue": "medrxiv"}),
    ("PubMed abstracts from 2011 about: {claim}", {"$and": [{Y: {"$eq": 2011}}, {"venue": "pubmed"}]}),
    ("arXiv or medRxiv preprints: {claim}", {"venue": {"$in": ["arxiv", "medrxiv"]}}),
    ("{claim}", None),
    ("Is it true that {claim}?", None),
    ("{claim} -- in 2000 patients", None),
    ("{claim}: a cohort of 2015 participants", None),
    ("Top 1000 genes: {claim}", None),
    ("{claim} in 1850", None),
    ("{claim} (not from pubmed)", None),
    ("{claim}, excluding arxiv", None),
    ("{claim} with 2500 mg doses", None),
    ("Evidence that {claim}", None),
    ("{claim} in the 2020 census", {Y: {"$eq": 2020}}),  # what a reader may mean; rules cannot tell
    ("Papers from last year: {claim}", None),  # relative dates: not read by the rules
    ("{claim} in recent studies", None),
    ("Studies published this decade: {claim}", None),
    ("{claim} -- 2018 papers only", {Y: {"$eq": 2018}}),
    ("During 2021, did trials confirm that {claim}?", {Y: {"$eq": 2021}}),
]


def claims() -> list[str]:
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
        return [json.loads(line)["text"].rstrip(".") for line in handle]


def filter_of(text: str, ctx: StepContext) -> dict | None:
    return self_query.fn(query=Query(text=text), params=PARAMS, ctx=ctx).filters


def score_labelled(texts: list[str], ctx: StepContext) -> dict:
    """Precision: produced filters that are the labelled one; recall: labelled filters produced."""
    produced = correct = wanted = found = 0
    misses = []
    for (template, expected), claim in zip(LABELLED, texts):
        text = template.format(claim=claim)
        got = filter_of(text, ctx)
        produced += got is not None
        correct += got is not None and got == expected
        wanted += expected is not None
        found += expected is not None and got == expected
        if got != expected:
            misses.append({"text": text, "expected": expected, "got": got})
    return {"phrasings": len(LABELLED), "produced": produced, "precision": round(correct / produced, 3),
            "with_filter": wanted, "recall": round(found / wanted, 3),
            "exact": sum(1 for _ in LABELLED) - len(misses), "misses": misses}


def latency(texts: list[str], ctx: StepContext, repeats: int = 3) -> dict:
    times = []
    for _ in range(repeats):
        for text in texts:
            query = Query(text=text)
            start = time.perf_counter()
            self_query.fn(query=query, params=PARAMS, ctx=ctx)
            times.append(time.perf_counter() - start)
    return {"calls": len(times), "median_us": round(1e6 * statistics.median(times)),
            "p95_us": round(1e6 * percentile(times, 95))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-readme", action="store_true", help="print the table, leave docs/ alone")
    args = parser.parse_args()
    ctx = StepContext(pipeline="bench", step_id="self_query")
    texts = claims()
    labelled = score_labelled(texts, ctx)
    plain = [t for t in texts if filter_of(t, ctx) is not None]
    timing = latency(texts, ctx)
    result = {"labelled": labelled, "scifact_queries": len(texts), "false_positives_on_plain_queries": plain,
              "latency": timing}
    save("self_query", result)
    publish("self_query", [
        "| set | phrasings | filters produced | precision | recall | exact (filter or none) |",
        "|---|---|---|---|---|---|",
        f"| labelled (SciFact claims + a time/venue phrase) | {labelled['phrasings']} | {labelled['produced']} | "
        f"{labelled['precision']:.3f} | {labelled['recall']:.3f} | {labelled['exact']}/{labelled['phrasings']} |",
        f"| SciFact queries as written (any filter is wrong) | {len(texts)} | {len(plain)} | – | – | "
        f"{len(texts) - len(plain)}/{len(texts)} |",
        "",
        f"Stage latency, rules mode (the call, {timing['calls']} calls over the SciFact queries): "
        f"median {timing['median_us']} µs, p95 {timing['p95_us']} µs.",
    ], readme=not args.no_readme)


if __name__ == "__main__":
    main()
