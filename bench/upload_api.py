"""The document API under concurrent clients (issue 18, item 2): 100 uploads from 10 concurrent
clients, then 20 deletes, against `ragline serve` (a real Prefect server, triggered deployment
runs); then the served index is compared with a clean build of the remaining files.

Measured: upload latency (p50/p95) and throughput, how many uploads started a run or were
scheduled after a busy one, the time until all 100 are listed `indexed`, the same for the deletes,
and whether the state (sources with their content hashes, chunk ids and texts), Chroma's ids and
BM25's published ids equal those of a fresh project that indexes the same 80 files in-process.

Usage: .venv/bin/python bench/upload_api.py [--files 100] [--clients 10] [--deletes 20] [--no-readme]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import REPO, SCIFACT, percentile, publish, save

TOKEN = "bench-upload-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: uploads}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [{type: uploads}]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 128, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  search:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 10}}
"""
SERVE = ("import sys; from ragline.flows.serve.supervise.service import serve; "
         "sys.exit(serve(sys.argv[1], port=int(sys.argv[2]), token=sys.argv[3]))")


def files(n: int) -> list[tuple[str, bytes]]:
    """SciFact abstracts as Markdown files."""
    out = []
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        for _, line in zip(range(n), handle):
            record = json.loads(line)
            out.append((f"{record['_id']}.md", f"# {record['title']}\n\n{record['text']}\n".encode()))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(project: Path, prefect_api: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = project.parent / "serve.log"
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(project.parent / "prefect-client"))
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-c", SERVE, str(project), str(port), TOKEN], cwd=project.parent,
                                   env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while "ragline serve: Prefect API" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ragline serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.3)
    return process, f"http://127.0.0.1:{port}"


def listed(url: str) -> dict[str, dict]:
    out, cursor = {}, None
    while True:
        page = httpx.get(f"{url}/v1/documents", params={"limit": 1000, **({"cursor": cursor} if cursor else {})},
                         headers=AUTH, timeout=60).json()
        out.update({d["id"]: d for d in page["documents"]})
        if not (cursor := page["next_cursor"]):
            return out


def wait_until(url: str, done, timeout: float = 900) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if done(listed(url)):
            return time.monotonic() - started
        time.sleep(0.5)
    raise TimeoutError("the index never reached the expected state")


def index_view(project: Path) -> dict:
    """What the index holds: the state's sources and chunks, Chroma's ids, BM25's published ids."""
    from ragline.flows.resources import clear_cache
    from ragline.flows.spec.compile import load_project

    loaded = load_project(project)
    state, store, sparse = (loaded.resource(n) for n in ("state", "store", "sparse"))
    sources = {sid: h for sid, (h, _) in state.sources().items()}
    chunks = {cid: text for cid, text, _ in state.chunk_rows()}
    view = {"sources": sources, "chunks": chunks, "chroma": store.all_ids(), "bm25": set(sparse.published_ids())}
    clear_cache()
    return view


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--deletes", type=int, default=20)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    from ragline.flows.ops.prefect_server import database_url
    from ragline.flows.serve.supervise.service import start_prefect_server

    corpus = files(args.files)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        project = work / "served" / "pipelines.yaml"
        project.parent.mkdir()
        project.write_text(PIPELINES)
        prefect = start_prefect_server(work / "prefect-home", database=database_url(work / "prefect-home"),
                                      auth=False)  # a throwaway harness server, reached with plain HTTP
        process = None
        try:
            process, url = start_serve(project, prefect.api_url)

            def upload(item: tuple[str, bytes]) -> tuple[float, dict]:
                started = time.perf_counter()
                response = httpx.post(f"{url}/v1/documents", files={"file": item}, headers=AUTH, timeout=300)
                assert response.status_code == 201, response.text
                return time.perf_counter() - started, response.json()

            began = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                uploads = list(pool.map(upload, corpus))
            upload_wall = time.perf_counter() - began
            ids = [body["document"]["id"] for _, body in uploads]
            states = [body["ingestion"]["state"] for _, body in uploads]
            indexed_after = wait_until(url, lambda d: all(d.get(i, {}).get("status") == "indexed" for i in ids))

            def delete(upload_id: str) -> float:
                started = time.perf_counter()
                response = httpx.delete(f"{url}/v1/documents/{upload_id}", headers=AUTH, timeout=300)
                assert response.status_code == 202, response.text
                return time.perf_counter() - started

            gone = ids[::max(1, len(ids) // args.deletes)][:args.deletes]
            began = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                delete_latencies = list(pool.map(delete, gone))
            wait_until(url, lambda d: not set(gone) & set(d) and len(d) == len(ids) - len(gone))
            delete_wall = time.perf_counter() - began
        finally:
            if process is not None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
            prefect.stop()
        served = index_view(project)

        clean = work / "clean" / "pipelines.yaml"
        clean.parent.mkdir()
        clean.write_text(PIPELINES)
        shutil.copytree(project.parent / ".ragline" / "uploads", clean.parent / ".ragline" / "uploads")
        from ragline.flows.run import engine
        from ragline.flows.spec.compile import load_project

        engine.run(load_project(clean).pipeline("index"), orchestrate=False)
        fresh = index_view(clean)

    latencies = [1000 * s for s, _ in uploads]
    result = {
        "files": args.files, "clients": args.clients, "deletes": len(gone),
        "upload_p50_ms": round(percentile(latencies, 50), 1), "upload_p95_ms": round(percentile(latencies, 95), 1),
        "uploads_per_s": round(args.files / upload_wall, 1),
        "runs_started": states.count("started"), "scheduled": states.count("scheduled"),
        "seconds_until_all_indexed": round(indexed_after, 1),
        "delete_p50_ms": round(percentile([1000 * s for s in delete_latencies], 50), 1),
        "seconds_until_deletes_applied": round(delete_wall, 1),
        "sources": len(served["sources"]), "chunks": len(served["chunks"]),
        "state_equal": served["sources"] == fresh["sources"] and served["chunks"] == fresh["chunks"],
        "chroma_equal": served["chroma"] == fresh["chroma"], "bm25_equal": served["bm25"] == fresh["bm25"],
        "chroma_ids_equal_state": served["chroma"] == set(served["chunks"]),
    }
    save("upload_api", result)
    lines = ["| measure | value |", "|---|---|",
             *(f"| {key} | {value} |" for key, value in result.items()),
             "", (f"{args.files} SciFact abstracts as Markdown uploaded by {args.clients} concurrent clients to "
                 f"`ragline serve` (real Prefect server, triggered runs), then {len(gone)} deleted; "
                 f"`*_equal`: the served index against a clean in-process build of the remaining files.")]
    publish("upload_api", lines, readme=not args.no_readme)


if __name__ == "__main__":
    main()
