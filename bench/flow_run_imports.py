"""What a served flow run imports before its first step (the stage registry made lazy): each flow
run of ``ragline serve`` is a fresh Python process (Prefect's runner spawns it), which imports
Prefect's flow engine and ``flows/run/entrypoints.py``, then compiles its pipeline. Compiling used
to import every builtin stage (the whole ``tasks`` package: tuning, adaptation, generation,
loaders); now it imports the modules of the stages the pipeline names (``tasks.STAGES``).

A fresh interpreter per measurement, the variants interleaved (A B A B ...), medians of ``--repeats``:
  - lazy: what a flow-run process does now: import the engine, compile the pipeline;
  - eager (the baseline, measured in the same run): the same, with every declared stage imported
    first (``registry.all_stages()``), which is what compiling did before.
Two pipelines as the serve integration tests serve them: ``search`` (dense + sparse + fuse) and
``index`` (load, convert, chunk, embed, index), in one file (compiling either validates both).
Timed: the process's wall time and CPU time (user + system, which a loaded machine's wait does not
inflate), and inside it the engine's imports and the compile. Nothing is run and no model loads
(unchanged by this work). Then, in CPU seconds, what the rest of a served search run imports when
its steps run (Chroma, torch, sentence-transformers): where a flow run's start-up goes now.

Usage: .venv/bin/python bench/flow_run_imports.py [--repeats 5] [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import publish, save

PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: main}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, uses: [embedder], with: {size: 128, overlap: 8}}
      - {id: embed,   task: embed, uses: [embedder]}
      - {id: write,   task: index, uses: {store: store, sparse: sparse, state: state}}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, uses: {store: store, embedder: embedder}, with: {k: 10}}
      - {id: sparse, task: retrieve_sparse, uses: {sparse: sparse, state: state}, with: {k: 10}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 5}}
"""
# What the spawned flow-run process does up to its first step (flows/run/entrypoints.run_pipeline).
CHILD = """
import json, sys, time
started = time.perf_counter()
import prefect.flow_engine  # the target Prefect's runner spawns
from ragline.flows.run.entrypoints import run_pipeline
from ragline.flows.run.steps import PipelineRef, digest_of
from ragline.flows.spec import registry
imported = time.perf_counter()
if sys.argv[2] == "eager":
    registry.all_stages()
path = sys.argv[1]
pipeline = PipelineRef(path, sys.argv[3], {}, {}, None, digest_of(__import__("pathlib").Path(path)), None).resolve()
compiled = time.perf_counter()
print(json.dumps({"imports_s": imported - started, "compile_s": compiled - imported, "cpu_s": time.process_time(),
                  "modules": len(sys.modules),
                  "stage_modules": sum(m.startswith("ragline.tasks.") for m in sys.modules),
                  "steps": len(pipeline.steps)}))
"""

# What the rest of a served search run imports when its steps run (dense: the embedder and Chroma),
# in CPU seconds per stage of the import, to show where a flow run's start-up goes after this work.
BREAKDOWN = """
import json, sys, time
from pathlib import Path
marks = [("interpreter", time.process_time())]
import prefect.flow_engine
from ragline.flows.run.entrypoints import run_pipeline
from ragline.flows.run.steps import PipelineRef, digest_of
marks.append(("Prefect's flow engine + entrypoints", time.process_time()))
PipelineRef(sys.argv[1], "search", {}, {}, None, digest_of(Path(sys.argv[1])), None).resolve()
marks.append(("compile (lazy stages)", time.process_time()))
import chromadb
marks.append(("chromadb", time.process_time()))
import torch
marks.append(("torch", time.process_time()))
import sklearn.metrics
marks.append(("sklearn.metrics (SciPy, pandas), which sentence_transformers imports", time.process_time()))
import sentence_transformers
marks.append(("the rest of sentence_transformers (transformers)", time.process_time()))
print(json.dumps([(what, t - (marks[i - 1][1] if i else 0.0)) for i, (what, t) in enumerate(marks)]))
"""


def breakdown(pipelines: Path, env: dict[str, str], repeats: int) -> list[str]:
    runs = []
    for _ in range(repeats):
        result = subprocess.run([sys.executable, "-c", BREAKDOWN, str(pipelines)], cwd=pipelines.parent, env=env,
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"breakdown exited {result.returncode}: {result.stderr[-2000:]}")
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    rows = [(what, statistics.median(run[i][1] for run in runs)) for i, (what, _) in enumerate(runs[0])]
    total = sum(seconds for _, seconds in rows)
    return ["", "| a served search run's imports | CPU (s) | share |", "|---|---:|---:|",
            *[f"| {what} | {seconds:.2f} | {seconds / total:.0%} |" for what, seconds in rows],
            f"| total | {total:.2f} | |"]


def measure(pipelines: Path, variant: str, pipeline: str, env: dict[str, str]) -> dict[str, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD, str(pipelines), variant, pipeline], cwd=pipelines.parent,
                            env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{variant} {pipeline} exited {result.returncode}: {result.stderr[-2000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "process_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-readme", action="store_true", help="print the table, leave docs/results.md alone")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ragline-flow-run-bench-") as folder:
        pipelines = Path(folder) / "pipelines.yaml"
        pipelines.write_text(PIPELINES)
        for pipeline in ("search", "index"):
            runs: dict[str, list[dict[str, float]]] = {"eager": [], "lazy": []}
            measure(pipelines, "lazy", pipeline, env)  # warm the file cache, untimed
            for _ in range(args.repeats):
                for variant in runs:
                    runs[variant].append(measure(pipelines, variant, pipeline, env))
            results[pipeline] = {variant: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                                 for variant, rows in runs.items()}
        where = breakdown(pipelines, env, args.repeats)
    lines = ["| pipeline | variant | process wall (s) | process CPU (s) | engine imports (s) | compile (s) | modules "
             "| stage modules |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for pipeline, variants in results.items():
        for variant, row in variants.items():
            lines.append(f"| {pipeline} | {variant} | {row['process_s']:.2f} | {row['cpu_s']:.2f} | "
                         f"{row['imports_s']:.2f} | "
                         f"{row['compile_s']:.2f} | {row['modules']:.0f} | {row['stage_modules']:.0f} |")
        eager, lazy = variants["eager"], variants["lazy"]
        lines.append(f"| {pipeline} | eager / lazy | {eager['process_s'] / lazy['process_s']:.2f}x | "
                     f"{eager['cpu_s'] / lazy['cpu_s']:.2f}x | | {eager['compile_s'] / lazy['compile_s']:.2f}x | | |")
    lines += where
    save("flow_run_imports", {"repeats": args.repeats, "results": results})
    publish("flow_run_imports", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
