"""Soak: a real ``ragline serve`` under mixed load for a bounded time, its LLM killed and restarted.

On a temporary project (SciFact abstracts plus markdown notes, indexed first), loopback only:

- ``ragline serve --start-prefect`` (deployments, runner, its own Prefect server, the HTTP API), as
  a user starts it: the ``ragline`` command in its own process group;
- the LLM: the scripted OpenAI-compatible server of ``tests/scripted_llm.py`` in a process of its
  own (``--vllm``: the packaged CPU vLLM server, very slow); killed with SIGKILL in the middle of
  the run, left down ``--llm-down-seconds``, started again on the same port;
- a few concurrent clients (``--clients``) sending ``/v1/query`` requests one after another, a mix
  of ``search`` and ``ask`` (``--ask-share``);
- incremental ingestion: every ``--ingest-every`` seconds a note is added, the previous one edited
  and an older one deleted in the sources folder, then ``POST /v1/ingest`` starts a flow run of the
  ``index`` deployment (a 409 while one is running is not a failure: the next round catches up).

- a store deleted in the middle (``--store-at``, 70 % of the run by default): the published BM25
  version folder is removed under the running service; hybrid queries answer from dense meanwhile
  (a warning, not a failure), and the next ingestion round finds it and rebuilds it from the state.

Printed: queries served, failures inside the restart window (from the kill until the LLM answers
again, plus the longest retry and timeout a query spends on a dead endpoint) and outside it (target
0), ingestion runs, RSS, open file descriptors and threads of the serve process and of its process
tree (itself and its Prefect server; flow-run processes come and go and are counted apart) sampled
every few seconds (first minute against last minute of the load: flat), and at the end, after a
last ingestion and a clean stop, the index's consistency: Chroma ids == BM25 documents == the state's
chunks, and the indexed sources == the files on disk. Exit status 1 if a failure happened outside
the window or the index is inconsistent.

Usage: .venv/bin/python bench/soak.py [--minutes 5] [--clients 4] [--docs 200] [--vllm]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import psutil

from api_overhead import free_port
from common import REPO, SCIFACT, percentile, save, subset_corpus

TOKEN = "soak-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
CLIENT_TIMEOUT = 180.0
LLM_GRACE_SECONDS = 10.0  # max_retries 3 with backoff 0.5 + 1 + 2 s, plus a refused connect: a query that met
# the dead endpoint just before it came back still fails; the window is extended by this much
SAMPLE_EVERY = 5.0
PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2, batch_size: 64}
  store:    {type: chroma, path: idx/chroma, collection: soak}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
  llm: {type: openai_compatible, base_url: "LLM_URL", model: LLM_MODEL, timeout_seconds: 120, max_retries: 3,
        hung_after_seconds: 20, max_concurrency: 4}

pipelines:
  index:
    kind: ingestion
    batch_size: 128
    steps:
      - {id: load,    task: load,    with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk,   uses: [embedder], with: {mode: tokens, size: 200, overlap: 32}}
      - {id: embed,   task: embed,   uses: [embedder]}
      - {id: write,   task: index,   uses: [store, sparse, state], with: {delete_missing: true}}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 10}}
  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 5}}
      - {id: insert, task: insert, with: {max_tokens: 600, max_documents: 3}}
      - {id: answer, task: generate, with: {max_tokens: 48}}
      - {id: check,  task: verify}
"""
# The scripted LLM on a fixed port (so it can come back where the served file points), its request
# log bounded; the answer cites [1] and the fact check says Yes.
SCRIPTED = """
import collections, sys
from http.server import ThreadingHTTPServer
from tests.scripted_llm import ScriptedLLM

llm = ScriptedLLM(lambda p: "Yes" if "Statement:" in p else "The first reference answers the question [1].",
                  chunk_delay=0.002)
llm.requests, llm.paths = collections.deque(maxlen=100), collections.deque(maxlen=100)
handler = llm.httpd.RequestHandlerClass
llm.httpd.server_close()
ThreadingHTTPServer.allow_reuse_address = True
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
"""


# ----------------------------------------------------------------------------- the LLM
class ScriptedLLMProcess:
    """The scripted server as its own process, killed and started again on the same port."""

    model = "scripted"

    def __init__(self, port: int):
        self.port, self.proc = port, None
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-c", SCRIPTED, str(self.port)], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _answers(f"http://127.0.0.1:{self.port}/health"), 60, "the scripted LLM did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    stop = kill


class VllmProcess:
    """The packaged CPU vLLM server (deploy/vllm), stopped with SIGKILL to its group and restarted."""

    def __init__(self, port: int):
        from ragline.flows.ops.llm_server import PACKAGED_MODEL

        self.port, self.server, self.model = port, None, PACKAGED_MODEL
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def start(self) -> None:
        from ragline.flows.ops.llm_server import start_vllm

        self.server = start_vllm(self.port)

    def kill(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0)

    stop = kill


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(ready, timeout: float, message: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(every)
    raise TimeoutError(message)


# ----------------------------------------------------------------------------- the workspace
def workspace(root: Path, docs: int, llm) -> tuple[Path, list[str], list[str]]:
    """The pipelines file over ``docs`` SciFact abstracts and three notes, indexed in this process;
    returns (file, questions, spare abstracts for the notes written during the run)."""
    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project
    from ragline.flows.resources import clear_cache

    (root / "docs").mkdir(parents=True)
    subset_corpus(docs, root / "docs")
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        spare = [json.loads(line) for _, line in zip(range(docs + 200), handle)][docs:]
    spare_texts = [f"# {r['title']}\n\n{r['text']}\n"
                   for r in spare]
    for i in range(3):
        (root / "docs" / f"note_{i:04d}.md").write_text(spare_texts[i])
    path = root / "pipelines.yaml"
    path.write_text(textwrap.dedent(PIPELINES).replace("LLM_URL", llm.base_url).replace("LLM_MODEL", llm.model))
    (root / "prompts").symlink_to(REPO / "prompts")
    started = time.perf_counter()
    report = engine.run(load_project(path).pipeline("index"), orchestrate=False)
    print(f"indexed {report.summary()} in {time.perf_counter() - started:.0f} s", flush=True)
    clear_cache()
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
        questions = [json.loads(line)["text"] for line in handle]
    return path, questions, spare_texts[3:]


def start_serve(project: Path, port: int, log: Path) -> subprocess.Popen:
    """``ragline serve --start-prefect`` in its own process group; returns once the API answers."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(RAGLINE_API_TOKEN=TOKEN, PREFECT_HOME=str(project.parent / "prefect-home"), OMP_WAIT_POLICY="PASSIVE",
               PYTHONUNBUFFERED="1", RAGLINE_START_LLM="0")
    ragline = Path(sys.executable).parent / "ragline"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(ragline), "serve", "-f", str(project), "--port", str(port), "--start-prefect",
                                 "--no-start-llm"], cwd=project.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while "ragline serve: Prefect API" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_serve(proc)
            raise RuntimeError(f"ragline serve did not start: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return proc


def stop_serve(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its group left behind
    return proc.returncode


# ----------------------------------------------------------------------------- load
class Soak:
    def __init__(self, url: str, project: Path, llm, questions: list[str], spare: list[str], args):
        self.url, self.project, self.llm, self.args = url, project, llm, args
        self.questions, self.spare = questions, spare
        self.requests: list[dict] = []
        self.ingests: list[dict] = []
        self.samples: list[dict] = []
        self.window: list[float] = []  # [killed, answering again]
        self.store_gone: list[float] = []  # [deleted, repaired by an ingestion]
        self.stop_at = 0.0
        self.rng = random.Random(0)
        self.note = 3

    # -- query clients
    async def client(self, http: httpx.AsyncClient, number: int) -> None:
        rng = random.Random(number)
        while time.monotonic() < self.stop_at:
            pipeline = "ask" if rng.random() < self.args.ask_share else "search"
            question = rng.choice(self.questions)
            started = time.monotonic()
            try:
                response = await http.post("/v1/query", json={"question": question, "pipeline": pipeline})
                ok, detail = response.status_code == 200, f"HTTP {response.status_code}"
                if ok:
                    body = response.json()
                    ok = bool(body["answer"]["text"]) if pipeline == "ask" else bool(body["passages"])
                    detail = "ok" if ok else "empty"
                elif response.headers.get("content-type", "").startswith("application/json"):
                    detail += f" {response.json()['error'].get('code')}"
            except httpx.HTTPError as exc:
                ok, detail = False, type(exc).__name__
            self.requests.append({"pipeline": pipeline, "start": started, "end": time.monotonic(), "ok": ok,
                                  "detail": detail})

    # -- incremental ingestion
    def mutate_sources(self) -> str:
        docs = self.project.parent / "docs"
        i = self.note
        (docs / f"note_{i:04d}.md").write_text(self.spare[i % len(self.spare)])
        previous = docs / f"note_{i - 1:04d}.md"
        if previous.exists():
            previous.write_text(previous.read_text() + f"\nEdited in round {i}: {self.rng.random():.6f}.\n")
        gone = docs / f"note_{i - 3:04d}.md"
        if i % 2 == 0 and gone.exists():
            gone.unlink()
        self.note += 1
        return f"round {i}"

    async def ingest_once(self, http: httpx.AsyncClient) -> dict:
        started = time.monotonic()
        record = {"start": started, "ok": False, "state": None, "summary": None}
        try:
            response = await http.post("/v1/ingest", json={"pipeline": "index"})
            if response.status_code == 409:
                record.update(ok=True, state="BUSY (409)", end=time.monotonic())
                return record
            if response.status_code != 202:
                record.update(state=f"HTTP {response.status_code}", end=time.monotonic())
                return record
            run_id = response.json()["run_id"]
            while True:
                await asyncio.sleep(1.0)
                status = (await http.get(f"/v1/runs/{run_id}")).json()
                if status.get("state") in FINAL:
                    record.update(ok=status["state"] == "COMPLETED", state=status["state"],
                                  summary=status.get("summary") or status.get("message"))
                    break
                if time.monotonic() - started > 600:
                    record.update(state="TIMEOUT")
                    break
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            record.update(state=type(exc).__name__)
        record["end"] = time.monotonic()
        return record

    async def ingester(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.stop_at:
            await asyncio.sleep(min(self.args.ingest_every, max(0.0, self.stop_at - time.monotonic())))
            if time.monotonic() >= self.stop_at:
                break
            await asyncio.to_thread(self.mutate_sources)
            self.ingests.append(await self.ingest_once(http))

    # -- the LLM killed and restarted
    async def chaos(self, kill_at: float) -> None:
        await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
        await asyncio.to_thread(self.llm.kill)
        self.window = [time.monotonic()]
        print(f"  LLM killed (SIGKILL) at {self.window[0] - self.t0:.0f} s", flush=True)
        await asyncio.sleep(self.args.llm_down_seconds)
        await asyncio.to_thread(self.llm.start)
        self.window.append(time.monotonic())
        print(f"  LLM answering again at {self.window[1] - self.t0:.0f} s", flush=True)

    # -- a store deleted under the running service
    async def delete_store(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        bm25 = self.project.parent / "idx" / "bm25"
        version = json.loads((bm25 / "CURRENT").read_text())["version"]
        await asyncio.to_thread(__import__("shutil").rmtree, bm25 / version)
        self.store_gone = [time.monotonic()]
        print(f"  BM25 version {version} deleted at {self.store_gone[0] - self.t0:.0f} s", flush=True)
        while time.monotonic() < self.stop_at + 600:
            await asyncio.sleep(1.0)
            pointer = json.loads((bm25 / "CURRENT").read_text())["version"]
            if (bm25 / pointer).is_dir() and pointer != version:
                self.store_gone.append(time.monotonic())
                print(f"  BM25 rebuilt ({pointer}) at {self.store_gone[1] - self.t0:.0f} s", flush=True)
                return

    # -- resources of the serve process tree
    def sample(self, serve_pid: int) -> dict:
        main = psutil.Process(serve_pid)
        procs = {"serve": [main], "prefect_server": [], "flow_runs": [], "other": []}
        for child in main.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                line = " ".join(child.cmdline())
                kind = ("flow_runs" if "spawn_main" in line or "prefect.engine" in line else
                        "prefect_server" if "prefect" in line or "uvicorn" in line else "other")
                procs[kind].append(child)

        def measure(group: list) -> tuple[float, int, int]:
            rss = fds = threads = 0
            for proc in group:
                with contextlib.suppress(psutil.Error):
                    rss += proc.memory_info().rss
                    fds += proc.num_fds()
                    threads += proc.num_threads()
            return rss / 2**20, fds, threads

        row = {"t": time.monotonic()}
        for kind, group in procs.items():
            rss, fds, threads = measure(group)
            row.update({f"{kind}_rss_mb": rss, f"{kind}_fds": fds, f"{kind}_threads": threads,
                        f"{kind}_processes": len(group)})
        steady = procs["serve"] + procs["prefect_server"] + procs["other"]
        row["tree_rss_mb"], row["tree_fds"], row["tree_threads"] = measure(steady)
        return row

    async def sampler(self, serve_pid: int) -> None:
        while time.monotonic() < self.stop_at:
            self.samples.append(await asyncio.to_thread(self.sample, serve_pid))
            await asyncio.sleep(SAMPLE_EVERY)

    async def run(self, serve_pid: int) -> None:
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + 60 * self.args.minutes
        limits = httpx.Limits(max_connections=self.args.clients + 2)
        async with httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=CLIENT_TIMEOUT, limits=limits) as http:
            await asyncio.gather(*(self.client(http, n) for n in range(self.args.clients)), self.ingester(http),
                                 self.chaos(self.t0 + 0.45 * 60 * self.args.minutes), self.sampler(serve_pid),
                                 self.delete_store(self.t0 + self.args.store_at * 60 * self.args.minutes))

    # -- figures
    def inside_window(self, record: dict) -> bool:
        if not self.window:
            return False
        start, end = self.window[0], self.window[-1] + LLM_GRACE_SECONDS
        return record["start"] < end and record["end"] > start

    def report(self) -> dict:
        inside = [r for r in self.requests if self.inside_window(r)]
        outside = [r for r in self.requests if not self.inside_window(r)]

        def kinds(records):
            found: dict[str, int] = {}
            for r in records:
                if not r["ok"]:
                    key = f"{r['pipeline']}: {r['detail']}"
                    found[key] = found.get(key, 0) + 1
            return found

        latency = {}
        for pipeline in ("search", "ask"):
            seconds = [r["end"] - r["start"] for r in outside if r["ok"] and r["pipeline"] == pipeline]
            if seconds:
                latency[pipeline] = {"n": len(seconds), "p50_s": round(statistics.median(seconds), 3),
                                     "p95_s": round(percentile(seconds, 95), 3), "max_s": round(max(seconds), 3)}
        minute = 60.0
        first = [s for s in self.samples if s["t"] - self.t0 < minute]
        last = [s for s in self.samples if s["t"] > self.stop_at - minute]
        resources = {}
        for key in ("serve_rss_mb", "serve_fds", "serve_threads", "tree_rss_mb", "tree_fds", "tree_threads",
                    "prefect_server_rss_mb", "flow_runs_processes"):
            values = [s[key] for s in self.samples]
            resources[key] = {"first_minute": round(statistics.median(s[key] for s in first), 1) if first else None,
                              "last_minute": round(statistics.median(s[key] for s in last), 1) if last else None,
                              "min": round(min(values), 1), "max": round(max(values), 1)}
        window = None
        if self.window:
            window = {"killed_at_s": round(self.window[0] - self.t0, 1),
                      "answering_at_s": round(self.window[-1] - self.t0, 1) if len(self.window) > 1 else None,
                      "counted_until_s": round(self.window[-1] + LLM_GRACE_SECONDS - self.t0, 1)}
        return {
            "minutes": self.args.minutes, "clients": self.args.clients, "ask_share": self.args.ask_share,
            "queries": len(self.requests), "served": sum(r["ok"] for r in self.requests),
            "by_pipeline": {p: {"sent": sum(r["pipeline"] == p for r in self.requests),
                                "served": sum(r["ok"] and r["pipeline"] == p for r in self.requests)}
                            for p in ("search", "ask")},
            "restart_window": window,
            "store_deleted": {"at_s": round(self.store_gone[0] - self.t0, 1) if self.store_gone else None,
                              "rebuilt_at_s": round(self.store_gone[1] - self.t0, 1) if len(self.store_gone) > 1
                              else None,
                              "queries_meanwhile": sum(1 for r in self.requests if len(self.store_gone) > 1
                                                       and r["start"] < self.store_gone[1]
                                                       and r["end"] > self.store_gone[0]),
                              "failures_meanwhile": sum(1 for r in self.requests if len(self.store_gone) > 1
                                                        and not r["ok"] and r["start"] < self.store_gone[1]
                                                        and r["end"] > self.store_gone[0])},
            "failures_inside_window": sum(not r["ok"] for r in inside), "inside_window_requests": len(inside),
            "failures_outside_window": sum(not r["ok"] for r in outside), "outside_window_requests": len(outside),
            "failure_kinds_inside": kinds(inside), "failure_kinds_outside": kinds(outside),
            "latency_outside_window": latency,
            "ingestion": {"rounds": len(self.ingests),
                          "completed": sum(i["state"] == "COMPLETED" for i in self.ingests),
                          "busy_409": sum(i["state"] == "BUSY (409)" for i in self.ingests),
                          "failed": [i["state"] for i in self.ingests if not i["ok"]],
                          "summaries": [i["summary"] for i in self.ingests if i["summary"]][-3:]},
            "resources": resources, "samples": len(self.samples),
            "series": [{k: round(v - self.t0 if k == "t" else v, 1) for k, v in s.items()} for s in self.samples],
        }


# ----------------------------------------------------------------------------- consistency
def consistency(project: Path) -> dict:
    """Chroma ids == BM25 documents == the state's chunks; the indexed sources == the files on disk."""
    sys.path.insert(0, str(REPO))
    from tests.helpers.harness import snapshot

    snap = snapshot(project)
    chroma = {row[0] for row in snap["chroma"]}
    bm25, state = set(snap["bm25"]), set(snap["state_chunks"])
    docs = project.parent / "docs"
    on_disk = {f"docs/{p.name}" for p in docs.glob("*.md")}  # ids are '<root name>/<path below the root>'
    with open(docs / "corpus.jsonl", encoding="utf-8") as handle:
        on_disk |= {f"docs/corpus.jsonl#{json.loads(line)['_id']}" for line in handle}
    indexed = set(snap["sources"])
    return {"chroma_ids": len(chroma), "bm25_docs": len(bm25), "state_chunks": len(state),
            "ids_equal": chroma == bm25 == state, "sources_indexed": len(indexed), "files_on_disk": len(on_disk),
            "sources_match_disk": indexed == on_disk,
            "missing_from_index": sorted(on_disk - indexed)[:5], "stale_in_index": sorted(indexed - on_disk)[:5]}


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the load (default 5)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ask-share", type=float, default=0.4, help="share of ask requests (the rest: search)")
    parser.add_argument("--docs", type=int, default=200, help="SciFact abstracts indexed at the start")
    parser.add_argument("--ingest-every", type=float, default=20.0, help="seconds between ingestion rounds")
    parser.add_argument("--llm-down-seconds", type=float, default=15.0)
    parser.add_argument("--store-at", type=float, default=0.7, help="delete the BM25 version at this share of the run")
    parser.add_argument("--vllm", action="store_true", help="the packaged CPU vLLM server instead of the scripted one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary project (its serve.log)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ragline-soak-"))
    llm = (VllmProcess if args.vllm else ScriptedLLMProcess)(free_port())
    serve = None
    try:
        llm.start()
        project, questions, spare = workspace(root / "project", args.docs, llm)
        port = free_port()
        log = root / "serve.log"
        started = time.monotonic()
        serve = start_serve(project, port, log)
        url = f"http://127.0.0.1:{port}"
        print(f"ragline serve (pid {serve.pid}) up in {time.monotonic() - started:.0f} s at {url}; "
              f"LLM {llm.base_url} ({'vLLM' if args.vllm else 'scripted'}); log {log}", flush=True)
        soak = Soak(url, project, llm, questions, spare, args)
        warm_up(url, soak)
        print(f"load: {args.minutes:g} min, {args.clients} clients ({args.ask_share:.0%} ask), an ingestion round "
              f"every {args.ingest_every:g} s, the LLM killed at 45% for {args.llm_down_seconds:g} s", flush=True)
        asyncio.run(soak.run(serve.pid))
        result = soak.report()
        print("load done; a last ingestion, then a clean stop", flush=True)
        last = asyncio.run(_last_ingest(url, soak))
        result["last_ingestion"] = {k: last[k] for k in ("state", "summary")}
        result["serve_exit_code"] = stop_serve(serve)
        serve = None
        result["consistency"] = consistency(project)
    finally:
        if serve is not None:
            stop_serve(serve)
        llm.stop()
        if not args.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    result["llm"] = "vLLM (CPU)" if args.vllm else "scripted (tests/scripted_llm.py, own process)"
    path = save("soak", result)
    print_report(result)
    print(f"written to {path.relative_to(REPO)}")
    ok = result["failures_outside_window"] == 0 and result["consistency"]["ids_equal"] and \
        result["consistency"]["sources_match_disk"] and not result["ingestion"]["failed"] and \
        result["store_deleted"]["rebuilt_at_s"] is not None
    sys.exit(0 if ok else 1)


def warm_up(url: str, soak: Soak) -> None:
    """Load the models in the serve process (first queries) so the first minute measures the load."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=CLIENT_TIMEOUT) as http:
        for pipeline in ("search", "ask", "search", "ask"):
            response = http.post("/v1/query", json={"question": soak.questions[0], "pipeline": pipeline})
            if response.status_code != 200:
                raise RuntimeError(f"warm-up {pipeline}: HTTP {response.status_code} {response.text[:300]}")
    record = asyncio.run(_last_ingest(url, soak))
    print(f"warm-up: 4 queries and one ingestion ({record['state']}: {record['summary']})", flush=True)


async def _last_ingest(url: str, soak: Soak) -> dict:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=CLIENT_TIMEOUT) as http:
        for _ in range(120):  # a run still going from the load answers 409: wait for it
            record = await soak.ingest_once(http)
            if record["state"] != "BUSY (409)":
                return record
            await asyncio.sleep(2)
    return record


def print_report(r: dict) -> None:
    print(f"\nsoak: {r['minutes']:g} min, {r['clients']} clients, LLM {r['llm']}")
    print(f"  queries: {r['queries']} sent, {r['served']} served "
          f"(search {r['by_pipeline']['search']['served']}/{r['by_pipeline']['search']['sent']}, "
          f"ask {r['by_pipeline']['ask']['served']}/{r['by_pipeline']['ask']['sent']})")
    w = r["restart_window"]
    if w:
        print(f"  LLM restart window: killed at {w['killed_at_s']} s, answering at {w['answering_at_s']} s, "
              f"counted until {w['counted_until_s']} s")
    print(f"  failures inside the window: {r['failures_inside_window']} of {r['inside_window_requests']} "
          f"{r['failure_kinds_inside'] or ''}")
    print(f"  failures outside the window: {r['failures_outside_window']} of {r['outside_window_requests']} "
          f"{r['failure_kinds_outside'] or ''} (target 0)")
    d = r["store_deleted"]
    print(f"  BM25 version deleted at {d['at_s']} s, rebuilt at {d['rebuilt_at_s']} s; queries meanwhile "
          f"{d['queries_meanwhile']}, failed {d['failures_meanwhile']}")
    for pipeline, lat in r["latency_outside_window"].items():
        print(f"  {pipeline:<6} latency outside the window: p50 {lat['p50_s']} s, p95 {lat['p95_s']} s, "
              f"max {lat['max_s']} s ({lat['n']})")
    ing = r["ingestion"]
    print(f"  ingestion: {ing['rounds']} rounds, {ing['completed']} completed, {ing['busy_409']} answered 409 "
          f"(a run was going), failed {ing['failed'] or 0}; last: {r['last_ingestion']}")
    print(f"  resources ({r['samples']} samples every {SAMPLE_EVERY:g} s; median of the first vs the last minute):")
    for key, v in r["resources"].items():
        print(f"    {key:<22} {v['first_minute']} -> {v['last_minute']}   (min {v['min']}, max {v['max']})")
    c = r["consistency"]
    print(f"  index: Chroma {c['chroma_ids']} ids, BM25 {c['bm25_docs']} docs, state {c['state_chunks']} chunks: "
          f"{'equal' if c['ids_equal'] else 'NOT EQUAL'}; sources {c['sources_indexed']} indexed, "
          f"{c['files_on_disk']} on disk: {'match' if c['sources_match_disk'] else 'MISMATCH'}")
    print(f"  ragline serve exit code: {r['serve_exit_code']}")


if __name__ == "__main__":
    main()
