"""Ingestion under faults (issue 9, item 2): a seeded schedule of kill -9 points across load, chunk,
embed and index; SIGTERM and Ctrl-C of `ragline index`; a scheduled run firing during a manual one.

Every case ends the same way: the index equals what a clean build of the same corpus holds (chunk
ids and texts, embeddings, BM25 documents, the state's sources and chunks, no dirty flag, no lease).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import IndexReport
from ragline.flows.resources import clear_cache
from tests.helpers.data import REPO, scifact_records
from tests.helpers.harness import fork_index, run_index, snapshot, write_corpus

pytestmark = pytest.mark.integration

SEED = 92  # issue 9, item 2; another seed draws another schedule (the test id shows it)
KILLS = 20
BATCH = 3
STATES = 3  # the corpus cycles S0 -> S1 -> S2 -> S0 ...: three clean builds serve every kill

# where a run can be killed; per batch of changed documents, once per run, or once per loaded document
PER_DOCUMENT = {"load": ["load.after_read"]}
PER_BATCH = {"chunk": ["chunk.after_batch"], "embed": ["embed.after_batch"],
             "index": ["index.after_forget", "index.after_delete", "index.after_upsert", "index.after_record"]}
PER_RUN = {"finalize": ["finalize.after_forget", "finalize.after_delete", "bm25.before_pointer",
                        "finalize.after_publish"]}
# how many of the kills each stage gets (sums to KILLS): every stage is hit several times
SHARES = {"load": 4, "chunk": 2, "embed": 5, "index": 5, "finalize": 4}


# ----------------------------------------------------------------------------- corpus and snapshots
def write_state(docs: Path, records: list[dict], k: int) -> None:
    """Corpus state k: one record deleted (a different one per state), two edited, a note edited, one
    note added or deleted; so every step of the cycle adds, updates and deletes documents."""
    kept = []
    for i, record in enumerate(records):
        if i == k:
            continue
        if i in (3 + 2 * k, 4 + 2 * k):
            record = dict(record, text=record["text"] + f" Revision {k} of this abstract.")
        kept.append(record)
    notes = {"beta": f"# Beta\n\nBeta notes about telomerase in stem cells, version {k}.\n"}
    if k != 2:
        notes["alpha"] = "# Alpha\n\nAlpha notes about zebrafish regeneration.\n"
    if k != 0:
        notes["gamma"] = "# Gamma\n\nNew notes on CRISPR screens.\n"
    write_corpus(docs, kept, notes)


def full_snapshot(project: Path) -> dict:
    """harness.snapshot plus the embeddings (count, dimensions), the dirty flag and the lease."""
    snap = snapshot(project)
    compiled = load_project(project)
    store, state = compiled.resource("store"), compiled.resource("state")
    embeddings = store.collection.get(include=["embeddings"])["embeddings"]
    snap["embeddings"] = (len(embeddings), sorted({len(e) for e in embeddings}))
    snap["dirty"] = state.get_meta("dirty")
    snap["lease"] = state.lease_holder()
    clear_cache()
    return snap


def consistent(snap: dict) -> bool:
    """Chroma, BM25 and the state name the same chunks, each with one embedding."""
    ids = [c[0] for c in snap["chroma"]]
    return ids == snap["bm25"] == snap["state_chunks"] and snap["embeddings"][0] == len(ids)


def clean_build(project: Path, name: str) -> dict:
    """What a clean run builds from the corpus as it is now: a new project beside this one, whose load
    step reads the same folder by its absolute path (so source and chunk ids are the same)."""
    folder = project.parent / name
    folder.mkdir()
    (folder / "prompts").mkdir()
    (folder / "pipelines.yaml").write_text(project.read_text().replace("[docs]", f"[{project.parent / 'docs'}]"))
    clear_cache()
    report = run_index(folder / "pipelines.yaml")
    assert report.failed == 0 and report.added > 0, report.summary()
    snap = full_snapshot(folder / "pipelines.yaml")
    assert consistent(snap) and snap["dirty"] == "0" and snap["lease"] is None
    return snap


def rerun(project: Path) -> dict:
    """The next run, as a new process sees the stores (clear_cache), then its snapshot."""
    clear_cache()
    report = run_index(project)
    assert report.failed == 0, report.failures
    return full_snapshot(project)


# ----------------------------------------------------------------------------- killed runs, forked
class Forker:
    """Runs the index pipeline in forked processes (``harness.fork_index``), armed with failpoints;
    their output goes to ``log``."""

    def __init__(self, log: Path):
        self.log = log

    def run(self, project: Path, failpoints: str = "", timeout: float = 300) -> tuple[int, int]:
        """(exit status, pid) of one run: -9 when a failpoint killed it."""
        return fork_index(project, self.log, failpoints, timeout)


@pytest.fixture
def forker(tmp_path):
    return Forker(tmp_path / "forker.log")


# ----------------------------------------------------------------------------- the kill schedule
def kill_schedule(seed: int) -> list[tuple[str, str, float]]:
    """(stage, failpoint, draw) per kill, in a seeded order; ``draw`` in [0, 1) picks which hit of the
    point kills (the number of hits depends on the corpus change, known only when the kill comes)."""
    rng = random.Random(seed)
    stages = [stage for stage, share in SHARES.items() for _ in range(share)]
    rng.shuffle(stages)
    points = {**PER_DOCUMENT, **PER_BATCH, **PER_RUN}
    return [(stage, rng.choice(points[stage]), rng.random()) for stage in stages]


def hits_per_run(stage: str, before: dict, after: dict) -> int:
    """How often a run from the clean index ``before`` to the corpus of ``after`` reaches a point."""
    if stage in PER_DOCUMENT:
        return len(after["sources"])  # every document is loaded, changed or not
    if stage in PER_BATCH:
        changed = sum(1 for source, value in after["sources"].items() if before["sources"].get(source) != value)
        return math.ceil(changed / BATCH)
    return 1


def test_kill_schedule_has_every_stage():
    schedule = kill_schedule(SEED)
    assert len(schedule) == KILLS >= 20
    assert {stage for stage, _, _ in schedule} == set(SHARES)
    assert kill_schedule(SEED) == schedule  # seeded: the same kills every run
    assert kill_schedule(SEED + 1) != schedule


@pytest.mark.parametrize("seed", [SEED], ids=lambda seed: f"seed={seed}")
def test_seeded_kills_across_load_embed_and_index_converge(seed, index_project, forker, tmp_path):
    """20 kill -9s, each in a run that has adds, edits and deletions to do, at a seeded point and hit
    count; after each, a re-run must leave exactly what a clean build of that corpus holds."""
    project = index_project(batch_size=BATCH)
    docs = tmp_path / "docs"
    records = scifact_records(10)
    write_state(docs, records, 0)
    clear_cache()
    assert run_index(project).failed == 0
    clean = {0: full_snapshot(project)}  # the first run of an empty index is a clean build
    assert consistent(clean[0])

    schedule = kill_schedule(seed)
    done: list[str] = []
    state = 0
    for number, (stage, point, draw) in enumerate(schedule, start=1):
        target = (state + 1) % STATES
        write_state(docs, records, target)
        if target not in clean:
            clean[target] = clean_build(project, f"clean-{target}")
        hits = hits_per_run(stage, clean[state], clean[target])
        nth = 1 + int(draw * hits)
        kill = f"kill {number}/{len(schedule)} (seed {seed}): {point}:{nth} of {hits}, S{state} -> S{target}"
        print(kill)

        started = time.monotonic()
        code, pid = forker.run(project, failpoints=f"{point}:{nth}")
        killed = time.monotonic()
        assert code == -signal.SIGKILL, f"{kill}: not killed\n{forker.log.read_text()[-3000:]}"
        assert lease_pid(project) == pid, kill  # it died holding the writer lease

        after = rerun(project)
        print(f"  killed after {killed - started:.1f} s, re-run and snapshot {time.monotonic() - killed:.1f} s")
        assert consistent(after), kill
        assert after == clean[target], f"{kill}: the re-run did not converge (after: {', '.join(done)})"
        done.append(f"{point}:{nth}")
        state = target
    assert len(done) == KILLS


# ----------------------------------------------------------------------------- SIGTERM and Ctrl-C
def state_meta(project: Path, key: str) -> str | None:
    """Read the state database directly (the run being watched is another process)."""
    with contextlib.closing(sqlite3.connect(project.parent / "idx" / "state.sqlite", timeout=30)) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return row[0] if row else None


def lease_pid(project: Path) -> int | None:
    with contextlib.closing(sqlite3.connect(project.parent / "idx" / "state.sqlite", timeout=30)) as conn:
        row = conn.execute("SELECT pid FROM lease WHERE name='writer'").fetchone()
    return row[0] if row else None


def generation(project: Path) -> int:
    """The state's write counter: each batch written moves it twice (forget, then record)."""
    return int(state_meta(project, "generation") or 0)


def wait_until_planned(project: Path, child: subprocess.Popen, generation_at_least: int = 0,
                       timeout: float = 300) -> None:
    """Until ``child`` holds the lease and has planned its run (loaded every document, marked the
    index dirty), and the state's generation has reached ``generation_at_least``; its batches are
    being chunked, embedded and written now."""
    deadline = time.monotonic() + timeout
    while not (lease_pid(project) == child.pid and state_meta(project, "dirty") == "1"
               and generation(project) >= generation_at_least):
        assert child.poll() is None, f"the run ended before it was caught mid-run: {child.communicate()}"
        assert time.monotonic() < deadline, "the run never got past its plan"
        time.sleep(0.05)


def cli(project: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`ragline index` (the console script's module), in its own session as a job started from a shell."""
    command = [sys.executable, "-m", "ragline.flows.cli", "index", "-f", str(project), *extra]
    env = dict(env or os.environ, PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_the_interrupt_guard_takes_sigterm_and_gives_it_back():
    from ragline.flows.ops import prefect_server

    before = signal.getsignal(signal.SIGTERM)
    with prefect_server.interrupt_guard():
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig, code, line, prefect", [(signal.SIGTERM, 143, "terminated", False),
                                                      (signal.SIGINT, 130, "interrupted", False),
                                                      (signal.SIGTERM, 143, "terminated", True)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-flow-run"])
def test_a_signalled_index_run_exits_with_one_line_and_the_rerun_converges(sig, code, line, prefect, index_project,
                                                                            tmp_path, request):
    """SIGTERM (kill, systemd, docker stop) or Ctrl-C to `ragline index` while it writes batches: it
    exits within seconds, saying so in one word on stderr, no traceback; the next run converges.

    As a Prefect flow run (the CLI's default) SIGTERM first meets Prefect's own handler (its flow
    engine swaps it in for the run), which marks the flow and task runs Crashed and logs that, one
    line each, before ragline's guard prints ``terminated``."""
    env = dict(os.environ)
    if prefect:
        request.getfixturevalue("prefect_server")
        from prefect.settings import PREFECT_API_URL

        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    project = index_project(batch_size=BATCH)
    docs = tmp_path / "docs"
    records = scifact_records(16)
    write_state(docs, records[:4], 0)
    clear_cache()
    assert run_index(project).failed == 0
    write_state(docs, records, 1)  # 16 documents to index: six batches
    clean = clean_build(project, "clean")

    first_batch_written = generation(project) + 2
    child = cli(project, "--prefect" if prefect else "--no-prefect", env=env)
    # past its first batch: the model is loaded (a thread importing torch holds the interpreter for
    # seconds, in which no signal handler runs), five batches are still to go
    wait_until_planned(project, child, first_batch_written)
    start = time.monotonic()
    os.killpg(child.pid, sig)  # the whole job, as `kill -TERM -PGID` or the terminal's Ctrl-C
    try:
        out, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail(f"still running 60 s after {sig.name}: {child.communicate()}")
    took = time.monotonic() - start
    assert child.returncode == code, err[-3000:]
    assert took < 15, f"{took:.1f} s to exit after {sig.name}"
    lines = [text for text in err.splitlines() if text.strip()]
    assert lines[-1:] == [line] and lines.count(line) == 1, err[-3000:]
    # what the run printed before the signal: transformers' model-loading bar, ragline's line per batch
    expected = ("Loading weights: ", "indexing (index): ")
    if prefect:
        expected += ("ERROR prefect.flow_runs: ", "ERROR prefect.task_runs: ")
    assert [text for text in lines[:-1] if not text.startswith(expected)] == [], err[-3000:]  # no traceback

    after = rerun(project)
    assert consistent(after)
    assert after == clean


# ----------------------------------------------------------------------------- a scheduled run during a manual one
class Waiting(logging.Handler):
    """Set when a run logs that it waits for the writer lease."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.event, self.messages = threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("waiting: the index is being written by"):
            self.messages.append(message)
            self.event.set()


def test_a_scheduled_run_firing_during_a_manual_run_waits_and_loses_nothing(prefect_server, index_project, tmp_path):
    """A manual `ragline index` (a Prefect flow run, the CLI's default) is writing when the schedule
    fires: the deployment's flow (``served_flow``, with the parameters ``ragline serve`` gives the
    deployment) waits for the lease, naming the manual run, then indexes the change the manual run
    could not see (made after its load). Both succeed; the index equals a clean build."""
    from prefect.settings import PREFECT_API_URL

    from ragline.flows.serve.supervise.service import deployment_options, served_flow

    project = index_project(batch_size=BATCH)
    docs = tmp_path / "docs"
    records = scifact_records(8)
    write_state(docs, records[:4], 0)
    clear_cache()
    assert run_index(project).failed == 0
    write_state(docs, records, 1)

    compiled = load_project(project)
    scheduled_run, parameters = served_flow(compiled), deployment_options(compiled)["index"]["parameters"]
    clear_cache()
    manual = cli(project, env=dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value()))
    waiting = Waiting()
    logging.getLogger("ragline").addHandler(waiting)
    try:
        wait_until_planned(project, manual)
        # Freeze the manual run mid-write, so the schedule surely fires while it holds the lease; it
        # goes on once the scheduled run is seen waiting, or after 20 s: its lease, last renewed at
        # most 5 s before, is not stale (30 s) by then.
        os.kill(manual.pid, signal.SIGSTOP)
        (docs / "late.md").write_text("# Late\n\nNotes saved while the manual run was indexing.\n")
        resume = threading.Thread(target=lambda: (waiting.event.wait(20), os.kill(manual.pid, signal.SIGCONT)))
        resume.start()
        payload = scheduled_run(**parameters)
        resume.join()
    finally:
        logging.getLogger("ragline").removeHandler(waiting)
        if manual.poll() is None:
            os.kill(manual.pid, signal.SIGCONT)
    out, err = manual.communicate(timeout=300)

    assert manual.returncode == 0, err[-3000:]
    assert waiting.event.is_set(), "the scheduled run never waited for the manual one"
    assert len(waiting.messages) == 1 and f"index run (pid {manual.pid} " in waiting.messages[0], waiting.messages
    manual_summary = out.strip().splitlines()[-1]
    assert "added 6, updated 2, deleted 1," in manual_summary, out  # S0 of 4 records -> S1 of 8, and the notes
    scheduled = IndexReport.model_validate(payload)
    assert (scheduled.added, scheduled.updated, scheduled.deleted, scheduled.failed) == (1, 0, 0, 0), payload
    assert full_snapshot(project) == clean_build(project, "clean")
