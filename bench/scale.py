"""Ingestion at scale (issue 22): what an incremental run costs as the corpus grows, with the real
loader, chunker (its tokenizer only), Chroma, BM25 and state, and a hash-based stand-in for the
embedding step (tests/helpers/hash_embed.py: embed's contract, no model) so only the engine and the
stores are timed.

Per size: N markdown files (SciFact abstracts, each made unique), in folders of 1,000, aged so their
change signals are trusted. Each run is a fresh process (peak RSS = its ru_maxrss): the full ingest
(wall, CPU, CPU per chunk, peak RSS), an unchanged re-run, one document changed, one added, one
deleted; then the median of 20 BM25 queries (retrieve_sparse through the engine) without and with a
metadata filter. Prints a Markdown table; bench/out/scale.json keeps the figures.

``--backend milvus``: the same runs with one milvus resource (embedded milvus-lite ``.db``) as both `store`
and `sparse` (only the resource lines change), saved as bench/out/scale_milvus.json.

``--backend managed``: the default resources, with the store's folder served by the managed ``chroma run``
that ``ragline serve`` starts (flows/ops/chroma_server.py): as scheduled re-indexing runs under the
service, each run's process talks HTTP to the server, which holds the HNSW index. The process's own
peak RSS and the server's resident memory after each run are reported apart; CPU is both together.
Saved as bench/out/scale_managed.json.

``--backend milvus_managed``: the milvus resource with its ``.db`` file served by the managed milvus-lite
engine that ``ragline serve`` starts (flows/ops/milvus_server.py): each run's process talks gRPC to the
engine, which keeps the collection loaded between runs. Reported as ``managed``. Saved as
bench/out/scale_milvus_managed.json.

``--watch``: the incremental runs with the corpus folder watched, as ``ragline serve`` watches it
(flows/sources/journal.py): each run lists what changed instead of every file. The same invocation
also measures an unchanged run and a one-change run listed in full, as the baseline. Saved as
bench/out/scale_watch.json (``scale_<backend>_watch``).

Usage: .venv/bin/python bench/scale.py [--sizes 25000 100000] [--huge] [--backend milvus|managed|milvus_managed] [--keep DIR [--again]] [--watch]  (--huge adds 300000)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import OUT, REPO, SCIFACT, save

PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: scale}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  index:
    kind: ingestion
    batch_size: 256
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk}
      - {id: embed,   task: tests.helpers.hash_embed.hash_embed, with: {kind: words}}
      - {id: write,   task: index, with: {gate_floor_pairs: 0}}
  search:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 20}}
"""
QUERIES = ["protein folding in yeast", "vitamin D deficiency and bone density", "stem cell differentiation",
           "antibiotic resistance genes", "tumour suppressor p53 mutations"] * 4
STORE_LINES = """  store:    {type: chroma, path: idx/chroma, collection: scale}
  sparse:   {type: bm25, path: idx/bm25}
"""
MILVUS_LINES = """  store:    &engine {type: milvus, uri: idx/milvus.db, collection: scale}
  sparse:   *engine
"""
BACKENDS = {"default": STORE_LINES, "managed": STORE_LINES, "milvus": MILVUS_LINES, "milvus_managed": MILVUS_LINES}
SERVED = {"managed": ("chroma_server", "ManagedChroma", "idx/chroma"),  # backend: the managed server of its store
          "milvus_managed": ("milvus_server", "ManagedMilvus", "idx/milvus.db")}
FILTER = {"file_name": {"$in": [f"d{i:06d}.md" for i in range(0, 25_000, 500)]}}  # 50 documents' chunks


def abstracts() -> list[tuple[str, str]]:
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        return [(r.get("title", ""), r["text"]) for r in map(json.loads, handle) if r.get("text")]


def document(i: int, source: list[tuple[str, str]], note: str = "") -> str:
    title, text = source[i % len(source)]
    return f"# {title} ({i})\n\n{text}\n\nDocument {i}.{note}\n"


def age(path: Path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def write_corpus(docs: Path, n: int) -> None:
    source = abstracts()
    for i in range(n):
        path = docs / f"f{i // 1000:03d}" / f"d{i:06d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(document(i, source))
        age(path)


def child(project: Path, mode: str) -> None:
    """One measured run in this process: prints its figures as JSON."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    started, cpu = time.perf_counter(), time.process_time()
    if mode == "index":
        report = engine.run(load_project(project).pipeline("index"), orchestrate=False)
        out = {"added": report.added, "updated": report.updated, "deleted": report.deleted,
               "unchanged": report.unchanged, "chunks": report.chunks_written}
    else:
        pipeline = load_project(project).pipeline("search")
        engine.run(pipeline, {"query": "warm up"}, orchestrate=False)
        out = {}
        for name, filters in (("unfiltered", None), ("filtered", FILTER)):
            times = []
            for text in QUERIES:
                t0 = time.perf_counter()
                engine.run(pipeline, {"query": {"text": text, "filters": filters}}, orchestrate=False)
                times.append(time.perf_counter() - t0)
            out[name] = round(1000 * statistics.median(times), 1)
    out.update(wall=round(time.perf_counter() - started, 2), cpu=round(time.process_time() - cpu, 2),
               rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    engine_cpu, engine_rss = engine_usage()
    if engine_rss:  # milvus-lite's engine is a child process: its CPU and memory count too
        out.update(cpu=round(out["cpu"] + engine_cpu, 2), rss_mb=out["rss_mb"] + engine_rss, engine_rss_mb=engine_rss)
    print("RESULT " + json.dumps(out))


def engine_usage() -> tuple[float, int]:
    """CPU seconds and peak RSS (MB) of this process's live child processes (the embedded milvus-lite
    engine), from /proc: ``process_time`` and ``ru_maxrss`` see neither."""
    cpu, rss = 0.0, 0
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in task.read_text().split():
            try:
                child_cpu, peak = process_usage(int(pid), memory="VmHWM")
            except (OSError, StopIteration, IndexError, ValueError):  # it ended meanwhile
                continue
            cpu, rss = cpu + child_cpu, rss + peak
    return cpu, rss


def process_usage(pid: int, memory: str = "VmRSS") -> tuple[float, int]:
    """A process's CPU seconds so far (user + system) and one memory figure of its status in MB
    (``VmRSS``: resident now, ``VmHWM``: its peak), from /proc/<pid>/stat and status."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    status = Path(f"/proc/{pid}/status").read_text()
    kb = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith(f"{memory}:")))
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), kb // 1024


def measured(project: Path, mode: str, server_pid: int | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), RAGLINE_DATA_DIR=str(SCIFACT.parent))
    server_cpu = process_usage(server_pid)[0] if server_pid else 0.0
    done = subprocess.run([sys.executable, __file__, "--child", str(project), mode], capture_output=True,
                          text=True, env=env, cwd=project.parent)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-3000:]}")
    out = json.loads(line[7:])
    if server_pid:  # the managed server did this run's store work: its CPU counts, its memory is shown apart
        cpu, rss = process_usage(server_pid)
        out.update(process_cpu=out["cpu"], cpu=round(out["cpu"] + cpu - server_cpu, 2), server_rss_mb=rss)
    return out


def measure(n: int, folder: Path, backend: str = "default", again: bool = False, watch: bool = False) -> dict:
    """A size's runs; ``again``: the incremental runs only, on a kept folder whose full ingest was
    measured before (its row is kept beside it), with documents no earlier round changed; ``watch``:
    under a folder watcher, as ``ragline serve`` runs them (``watched_runs``)."""
    project = folder / "pipelines.yaml"
    docs = folder / "docs"
    saved = folder / "row.json"
    if not again:
        project.write_text(PIPELINES.replace(STORE_LINES, BACKENDS[backend]))
        (folder / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["tests.helpers.hash_embed"]\n')
        write_corpus(docs, n)
    with contextlib.ExitStack() as stack:
        server = None
        if backend in SERVED:
            import importlib

            module, kind, store = SERVED[backend]
            managed = getattr(importlib.import_module(f"ragline.flows.ops.{module}"), kind)
            server = managed(folder / store, logs=folder / "logs").start()
            stack.callback(server.stop)
        earlier = json.loads(saved.read_text()) if again else None
        if watch:
            row = watched_runs(n, project, docs, server.process.pid if server else None, earlier)
        else:
            row = runs(n, project, docs, server.process.pid if server else None, earlier)
    saved.write_text(json.dumps(row))
    return row


def runs(n: int, project: Path, docs: Path, server_pid: int | None, earlier: dict | None = None) -> dict:
    source = abstracts()
    round_ = earlier.get("round", 0) + 1 if earlier else 0  # each round edits, adds and deletes other documents
    row: dict = {"documents": n, "load_average": os.getloadavg()[0], "round": round_}
    row["full"] = earlier["full"] if earlier else measured(project, "index", server_pid)
    row["unchanged"] = measured(project, "index", server_pid)
    changed = docs / "f000" / f"d{3 + 10 * round_:06d}.md"
    changed.write_text(document(3 + 10 * round_, source, " Edited."))
    age(changed, 1800)
    row["changed"] = measured(project, "index", server_pid)
    added = docs / "f000" / ("added.md" if not round_ else f"added{round_}.md")
    added.write_text(document(n + 1 + round_, source))
    age(added, 1800)
    row["added"] = measured(project, "index", server_pid)
    (docs / "f000" / f"d{5 + 10 * round_:06d}.md").unlink()
    row["deleted"] = measured(project, "index", server_pid)
    row["queries"] = measured(project, "search", server_pid)
    print(json.dumps(row), flush=True)
    return row


def watched_runs(n: int, project: Path, docs: Path, server_pid: int | None, earlier: dict | None = None) -> dict:
    """The incremental runs with the corpus folder watched (flows/sources/journal.py), so each run
    lists what changed; in the same invocation, the same kinds of run listed in full (the watcher
    stopped), as the baseline."""
    from ragline.flows.sources.journal import FolderWatcher, Journal, journal_file

    source = abstracts()
    round_ = earlier.get("round", 0) + 1 if earlier else 0
    row: dict = {"documents": n, "load_average": os.getloadavg()[0], "round": round_, "watched": True}
    row["full"] = earlier["full"] if earlier else measured(project, "index", server_pid)
    journal = Journal(journal_file(project.parent, "index", str(docs)))
    watcher = FolderWatcher(str(docs), [journal]).start()
    try:
        if not watcher.ready.wait(600):
            raise RuntimeError("the folder watcher did not start")
        row["unchanged_listed"] = measured(project, "index", server_pid)  # in full: it vouches for the journal
        row["unchanged"] = measured(project, "index", server_pid)

        def journaled(path: Path) -> Path:
            deadline = time.monotonic() + 60
            while str(path.resolve()) not in journal.changes():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the watcher did not record {path}")
                time.sleep(0.05)
            return path

        changed = docs / "f000" / f"d{3 + 10 * round_:06d}.md"
        changed.write_text(document(3 + 10 * round_, source, " Edited."))
        age(journaled(changed), 1800)
        row["changed"] = measured(project, "index", server_pid)
        added = docs / "f000" / f"added{round_}w.md"
        added.write_text(document(n + 1 + round_, source))
        age(journaled(added), 1800)
        row["added"] = measured(project, "index", server_pid)
        deleted = docs / "f000" / f"d{5 + 10 * round_:06d}.md"
        deleted.unlink()
        journaled(deleted)
        row["deleted"] = measured(project, "index", server_pid)
    finally:
        watcher.stop()
    listed = docs / "f000" / f"d{7 + 10 * round_:06d}.md"  # the same change, listed in full
    listed.write_text(document(7 + 10 * round_, source, " Edited."))
    age(listed, 1800)
    row["changed_listed"] = measured(project, "index", server_pid)
    row["queries"] = measured(project, "search", server_pid)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = "| | " + " | ".join(f"{r['documents']:,} docs ({r['full']['chunks']:,} chunks)" for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]

    def line(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in rows) + " |")

    kinds = ("changed", "added", "deleted", "unchanged")
    if all(r.get("watched") for r in rows):
        kinds += ("changed_listed", "unchanged_listed")
    labels = {"unchanged": "unchanged re-run", "changed_listed": "one document changed, listed in full",
              "unchanged_listed": "unchanged re-run, listed in full"}
    for kind in kinds:
        line(f"{labels.get(kind, 'one document ' + kind)}: wall / CPU / peak RSS",
             lambda r, k=kind: f"{r[k]['wall']} s / {r[k]['cpu']} s / {memory(r[k])}")
    line("full ingest: wall / CPU", lambda r: f"{r['full']['wall']} s / {r['full']['cpu']} s")
    line("full ingest CPU per chunk", lambda r: f"{1000 * r['full']['cpu'] / max(1, r['full']['chunks']):.2f} ms")
    line("full ingest peak RSS", lambda r: memory(r["full"]))
    line("BM25 query median: unfiltered / filtered",
         lambda r: f"{r['queries']['unfiltered']} / {r['queries']['filtered']} ms")
    line("load average (1 min) at start", lambda r: f"{r['load_average']:.1f}")
    return "\n".join(lines)


def memory(run: dict) -> str:
    """The run's peak RSS; with a managed server, the process's and the server's after the run."""
    if "server_rss_mb" in run:
        return f"{run['rss_mb']} MB + server {run['server_rss_mb']} MB"
    return f"{run['rss_mb']} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 100_000])
    parser.add_argument("--huge", action="store_true", help="add 300,000 documents (hours on 2 cores)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="default",
                        help="milvus: one embedded milvus-lite resource as store and sparse; managed: the "
                        "store served by the managed chroma run, as under ragline serve; milvus_managed: the "
                        "milvus-lite file served by its managed engine, as under ragline serve")
    parser.add_argument("--keep", type=Path, help="build each size's corpus and index in PATH/<size> and keep "
                        "them (to profile runs on them afterwards)")
    parser.add_argument("--again", action="store_true", help="with --keep: the incremental runs again on each "
                        "kept size (its full ingest's figures are the earlier ones)")
    parser.add_argument("--watch", action="store_true", help="the incremental runs with the corpus folder "
                        "watched, as under ragline serve (each run lists what changed), and the same runs listed "
                        "in full as the baseline")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    name = "scale" if args.backend == "default" else f"scale_{args.backend}"
    name += "_watch" if args.watch else ""
    rows = earlier_rows(name)
    for n in args.sizes + ([300_000] if args.huge else []):
        if args.keep:
            if not args.again:
                (args.keep / str(n)).mkdir(parents=True)  # an existing one is refused: its index is not fresh
            row = measure(n, args.keep / str(n), args.backend, again=args.again, watch=args.watch)
        else:
            with tempfile.TemporaryDirectory(prefix=f"scale-{n}-") as folder:
                row = measure(n, Path(folder), args.backend, watch=args.watch)
        rows = sorted([r for r in rows if r["documents"] != n] + [row], key=lambda r: r["documents"])
        save(name, {"backend": args.backend, "rows": rows})  # after every size: a long run keeps what it had
    print(table(rows))


def earlier_rows(name: str) -> list[dict]:
    """The saved rows of other sizes, so sizes measured in separate runs (hours each) make one table."""
    try:
        return json.loads((OUT / f"{name}.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


if __name__ == "__main__":
    main()
