"""Where an ingestion's peak memory goes (issue 38.3): `ragline index corpus.jsonl --no-prefect` on the
first N SciFact abstracts with the shipped pipelines.yaml, varied one setting at a time: the embedder's
``batch_size`` (texts per encode call) and glibc's ``MALLOC_ARENA_MAX``. Each variant a fresh process and
workspace, run one after another; its wall time and the peak RSS of its process (sampled every 0.1 s),
and the RSS every ~10 s, which shows whether memory grows with the run or with a batch.

Usage: .venv/bin/python bench/ingest_memory.py [--docs 1000] [VARIANT ...]
  VARIANT: default | bs<N> (embedder batch_size N) | arena<N> (MALLOC_ARENA_MAX=N), joined by '+'
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from common import REPO, publish, save, subset_corpus

EMBEDDER = "model: all-MiniLM-L6-v2, batch_size: "


def configured(variant: str) -> tuple[str, dict[str, str]]:
    """The shipped pipelines.yaml and the environment, changed as ``variant`` says."""
    text, env = (REPO / "pipelines.yaml").read_text(), {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    shipped = int(text.split(EMBEDDER, 1)[1].split("}", 1)[0])
    for part in variant.split("+"):
        if part.startswith("bs"):
            text = text.replace(f"{EMBEDDER}{shipped}}}", f"{EMBEDDER}{int(part[2:])}}}")
        elif part.startswith("arena"):
            env["MALLOC_ARENA_MAX"] = str(int(part[5:]))
        elif part != "default":
            raise SystemExit(f"unknown variant part {part!r}")
    return text, env


def measured(variant: str, corpus: Path, folder: Path) -> dict:
    text, env = configured(variant)
    (folder / "pipelines.yaml").write_text(text)
    (folder / "prompts").symlink_to(REPO / "prompts")
    started = time.perf_counter()
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "ragline"), "index", str(corpus), "--no-prefect"],
                            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process, peak, trace = psutil.Process(proc.pid), 0, []
    while proc.poll() is None:
        try:
            rss = process.memory_info().rss >> 20
        except psutil.Error:
            break
        peak = max(peak, rss)
        trace.append((round(time.perf_counter() - started), rss))
        time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"{variant}: ragline index exited {proc.returncode}")
    return {"variant": variant, "wall_s": round(time.perf_counter() - started, 1), "peak_mb": peak,
            "trace": trace[::100]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("variants", nargs="*", default=["default", "bs64", "bs16", "arena2", "bs64+arena2"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = subset_corpus(args.docs, work / "corpus")
        rows = []
        for number, variant in enumerate(args.variants):
            folder = work / str(number)
            folder.mkdir()
            rows.append(measured(variant, corpus, folder))
    save("ingest_memory", {"docs": args.docs, "rows": rows})
    base = rows[0]
    lines = ["| variant | wall (s) | peak RSS (MB) | peak / first row's |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['wall_s']} | {r['peak_mb']} | {r['peak_mb'] / base['peak_mb']:.2f}x |"
              for r in rows]
    publish("ingest_memory", lines)


if __name__ == "__main__":
    main()
