"""A tuning project over SciFact records in the BEIR layout (corpus, queries, qrels): its pipelines.yaml
(index, a gated query, the keyword-expansion search and the tune job), shared by the tuner's tests on
each store backend."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.data import SEARCH_TERMS, index_and_search_yaml, write_jsonl


# ----------------------------------------------------------------------------- end to end
TUNE_YAML = index_and_search_yaml().replace("paths: [docs]", "paths: [dataset/corpus.jsonl]").replace(
    "\npipelines:\n", """
  llm:      {type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}  # never called: the gate's floor needs none
pipelines:
""", 1) + """  gated:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
      - {id: insert, task: insert}
      - {id: gate,   task: answerable}
""" + SEARCH_TERMS + """  tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries, with: {n: 30}}
      - {id: tune,  task: tune_retrieval, with: {depths: [10, 20], rrf_k: [10, 60], dense_weights: [0, 0.3, 0.5, 0.7, 1],
                                                 bm25_k1: [1.2, 1.5], bm25_b: [0.75], bm25_stemmer: [english, none]}}
"""


def judged(dataset: Path) -> None:
    """Queries (each record's title) and qrels (its own record) beside the corpus (again, once a
    test has removed them)."""
    records = [json.loads(line) for line in (dataset / "corpus.jsonl").read_text().splitlines()]
    write_jsonl(dataset / "queries.jsonl", [{"_id": str(i), "text": r["title"]} for i, r in enumerate(records)])
    (dataset / "qrels").mkdir(exist_ok=True)
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{i}\t{r['_id']}\t1\n" for i, r in enumerate(records)))
