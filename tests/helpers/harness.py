"""Helpers for ingestion tests: a corpus on disk, runs, and snapshots of all three indexes."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.data import REPO, scifact_records, write_jsonl
from tests.helpers.net import free_port


def write_corpus(docs: Path, records: list[dict], notes: dict[str, str]) -> None:
    """A JSONL file of SciFact records plus one markdown file per note."""
    docs.mkdir(parents=True, exist_ok=True)
    write_jsonl(docs / "corpus.jsonl", records)
    for old in docs.glob("*.md"):
        if old.stem not in notes:
            old.unlink()
    for name, text in notes.items():
        (docs / f"{name}.md").write_text(text)


def default_corpus(docs: Path, n: int = 10) -> list[dict]:
    records = scifact_records(n)
    write_corpus(docs, records, {"alpha": "# Alpha\n\nAlpha notes about zebrafish regeneration.\n",
                                 "beta": "# Beta\n\nBeta notes about telomerase in stem cells.\n"})
    return records


def run_index(project_path: Path, **overrides):
    pipeline = load_project(project_path).pipeline("index")
    if overrides:
        pipeline = pipeline.with_overrides(overrides)
    return engine.run(pipeline, orchestrate=False)


def snapshot(project_path: Path) -> dict:
    """Everything both indexes and the state hold, in a comparable form (fresh process view)."""
    clear_cache()
    project = load_project(project_path)
    store, state = project.resource("store"), project.resource("state")
    sparse = store if store.type_name() == "milvus" else project.resource("sparse")
    if store.type_name() == "milvus":  # the engine's rows (one resource, both roles)
        ids = sorted(store.all_ids())
        rows = store.rows(ids, ["text", "metadata"])
        got = {"ids": ids, "documents": [rows[i]["text"] for i in ids], "metadatas": [rows[i]["metadata"] for i in ids]}
    else:
        got = store.collection.get(include=["documents", "metadatas"])
    # `modified` is the mtime of the content version that was embedded: a touched but unchanged file
    # keeps it incrementally, while a clean build stamps the current one. Everything else must match.
    metas = [json.dumps({k: v for k, v in m.items() if k != "modified"}, sort_keys=True) for m in got["metadatas"]]
    chroma = sorted(zip(got["ids"], got["documents"], metas))  # the dense store's chunks (Chroma's or Milvus's)
    bm25 = sparse.published_ids()
    snap = {"chroma": chroma, "bm25": sorted(bm25), "state_chunks": sorted(c[0] for c in state.chunk_rows()),
            "sources": state.sources()}
    clear_cache()
    return snap


def kill_at_random(project_path: Path, seed: int, times: int = 3) -> None:
    """Start ``times`` index runs one after the other, each killed at a random moment (1-6 s in)."""
    import random
    import time

    rng = random.Random(seed)
    forks = forked_children()
    for _ in range(times):
        child = forks.Process(target=run_index, args=(project_path,))
        child.start()
        time.sleep(rng.uniform(1, 6))  # a forked child starts working at once
        child.kill()
        child.join()


def run_child(project_path: Path, failpoints: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the index pipeline in a new process (``fork_index``), optionally armed to SIGKILL itself
    at a failpoint; its output is the result's stdout and stderr."""
    handle, log = tempfile.mkstemp(suffix=".log", prefix="ragline-child-")
    os.close(handle)
    try:
        code, _ = fork_index(project_path, Path(log), failpoints, timeout)
        output = Path(log).read_text(errors="replace")
    finally:
        os.unlink(log)
    return subprocess.CompletedProcess(["index", str(project_path)], code, output, output)


def fork_index(project_path: Path, log: Path, failpoints: str = "", timeout: float = 600) -> tuple[int, int]:
    """(exit code, pid) of one index run in a child forked from a server that imported the stack
    once (``forked_children``): a process of its own (its caches, its death; -9 when a failpoint
    killed it) without the 5-30 s of imports a new Python costs on a busy machine. Output: ``log``."""
    env = dict(os.environ, RAGLINE_FAILPOINTS=failpoints)
    child = forked_children().Process(target=_index_in_child, args=(str(project_path), env, str(log)))
    child.start()
    child.join(timeout)
    if child.exitcode is None:
        child.kill()
        child.join()
        raise subprocess.TimeoutExpired(f"index {project_path}", timeout)
    return child.exitcode, child.pid


def forked_children():
    """The stdlib ``forkserver`` context, its server preloading this module (ragline's engine,
    Chroma, BM25, sentence-transformers; imported only: one thread, no store opened, safe to fork),
    started once per test process."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "sentence_transformers", "chromadb", "bm25s"])
    policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read when the server loads OpenMP: no spinning children
    try:
        forkserver.ensure_running()
    finally:
        if policy is None:
            del os.environ["OMP_WAIT_POLICY"]
        else:
            os.environ["OMP_WAIT_POLICY"] = policy
    return context


def _index_in_child(project_path: str, env: dict[str, str], log: str) -> None:
    """A forked child's work: the caller's environment as it was at the call (the fork server's is
    older), output appended to ``log``, then the index run."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    print(run_index(Path(project_path)).summary(), flush=True)


class ChromaServer:
    """A real `chroma run` (started by deploy/chroma/serve.sh) on a fixed path and port, so a test can
    stop it and start it again as the same server. Its output goes to ``log`` beside the data folder."""

    def __init__(self, path: Path, port: int | None = None, host: str = "127.0.0.1"):
        self.path, self.host, self.port = path, host, port or free_port()
        self.log = path.parent / f"{path.name}.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def store_yaml(self, collection: str = "test", **options) -> str:
        """The `store:` resource of a pipelines.yaml that points at this server."""
        extra = "".join(f", {k}: {v}" for k, v in options.items())
        return f"{{type: chroma, host: {self.host}, port: {self.port}, collection: {collection}{extra}}}"

    def start(self, timeout: float = 60) -> None:
        import time

        import httpx

        env = dict(os.environ, CHROMA_PATH=str(self.path), CHROMA_HOST=self.host, CHROMA_PORT=str(self.port))
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(["bash", str(REPO / "deploy" / "chroma" / "serve.sh")], env=env,
                                            stdout=out, stderr=subprocess.STDOUT, cwd=self.path.parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chroma exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/api/v2/heartbeat", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"chroma at {self.url} did not answer within {timeout}s")

    def stop(self) -> None:
        """SIGTERM, then wait (SIGKILL only if it hangs)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self, down_seconds: float = 0.0) -> None:
        import time

        self.stop()
        time.sleep(down_seconds)
        self.start()
