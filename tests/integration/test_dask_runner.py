"""`runner:` in pipelines.yaml (issue 6, item 3): ingestion on a real Dask cluster of worker
processes builds exactly the index the thread runner builds, the steps that transform documents
run in the workers, and the index sink stays a single writer in the driver process."""
from __future__ import annotations

import inspect
import os

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.resources import clear_cache
from ragline.tasks.generate.answerable import record_floor
from tests.helpers.data import BASE_RESOURCES, scifact_records, write_jsonl
from tests.helpers.harness import snapshot
from tests.helpers.prefect_runs import task_runs_once

DOCS = 24  # SciFact abstracts
BATCH = 5  # documents per batch: five batches, so several run on the cluster at once

PIPELINES = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    batch_size: BATCH
    runner: RUNNER
    steps:
      - {id: load,    task: load, with: {paths: ["DOCS"]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 96, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 20}}
      - {id: sparse, task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 20}}
"""


def project(folder, docs, runner: str):
    """A project in ``folder`` (its own indexes) over the shared ``docs`` (same source ids)."""
    folder.mkdir()
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES.replace("BATCH", str(BATCH)).replace("RUNNER", runner).replace("DOCS", str(docs)))
    return path


# --------------------------------------------------------------------------- probes run in the Dask workers
def _spy_on_embedder() -> int:
    """Count, in this worker process, the texts every Embedder encodes for documents."""
    from ragline.flows.resources.models.embedder import Embedder

    if not hasattr(Embedder, "_spied"):
        original = Embedder.encode_documents

        def encode_documents(self, texts):
            Embedder._spied.append(len(texts))
            return original(self, texts)

        Embedder._spied = []
        Embedder.encode_documents = encode_documents
    return os.getpid()


def _worker_report() -> dict:
    """What ran in this worker: the texts it embedded, and which resources it ever opened."""
    from ragline.flows.resources import _cache
    from ragline.flows.resources.models.embedder import Embedder

    return {"pid": os.getpid(), "embedded": list(getattr(Embedder, "_spied", [])),
            "resources": sorted({key[0] for key in _cache})}


@pytest.mark.integration
def test_dask_runner_builds_the_thread_runners_index_with_the_sink_in_the_driver(prefect_server, tmp_path,
                                                                                monkeypatch):
    from distributed import Client, LocalCluster

    from ragline.flows.resources import _cache
    from ragline.flows.resources.models.embedder import Embedder

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the worker processes
    docs = write_jsonl(tmp_path / "docs" / "corpus.jsonl", scifact_records(DOCS)).parent
    thread_path = project(tmp_path / "thread", docs, "{type: thread}")

    # the reference: the default thread runner, as a Prefect flow run
    clear_cache()
    thread_report = engine.run(load_project(thread_path).pipeline("index"))
    assert thread_report.added == DOCS and not thread_report.failures
    expected = snapshot(thread_path)

    with LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        dask_path = project(tmp_path / "dask", docs, f"{{type: dask, address: '{cluster.scheduler_address}'}}")
        pids = client.run(_spy_on_embedder)
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()

        encoded_here: list[int] = []
        original = Embedder.encode_documents
        monkeypatch.setattr(Embedder, "encode_documents",
                            lambda self, texts: encoded_here.append(len(texts)) or original(self, texts))
        clear_cache()
        dask_report = engine.run(load_project(dask_path).pipeline("index"))
        driver_resources = sorted({key[0] for key in _cache})
        workers = list(client.run(_worker_report).values())
    monkeypatch.undo()

    assert dask_report.added == DOCS and not dask_report.failures
    assert dask_report.chunks_written == thread_report.chunks_written > 0
    # the same index: chunk ids, texts and metadata in Chroma, BM25's documents, the state record
    got = snapshot(dask_path)
    assert got == expected
    assert len(got["chroma"]) == thread_report.chunks_written

    # chunk and embed ran in the worker processes: every chunk was embedded there, in several
    # batches; the driver embedded no chunk: only, at finalize, the pseudo-queries of the answerability
    # gate's floor (tasks.answerable.record_floor, one batch of at most its default pairs)
    floor_pairs = inspect.signature(record_floor).parameters["pairs"].default
    assert len(encoded_here) <= 1 and sum(encoded_here) <= floor_pairs, encoded_here
    assert sum(n for w in workers for n in w["embedded"]) == dask_report.chunks_written
    assert sum(len(w["embedded"]) for w in workers) >= -(-DOCS // BATCH)
    assert all(w["pid"] != os.getpid() for w in workers)
    # the sink (plan, batch writes, finalize) ran only in the driver: no worker opened a store
    assert {"chroma", "bm25", "index_state"} <= set(driver_resources)
    for w in workers:
        assert not {"chroma", "bm25", "index_state"} & set(w["resources"]), w

    # the steps were Prefect task runs of the one flow run, the sink's among them
    expected = {"write.plan", "write.finalize"} | {f"embed[batch {n}]" for n in range(-(-DOCS // BATCH))}
    runs = task_runs_once("index", lambda states: expected <= set(states))
    assert expected <= set(runs) and all(state.is_completed() for state in runs.values()), runs

    # and a search over either index returns the same ranking
    for record in scifact_records(3, offset=DOCS // 2):
        query = {"query": record["title"]}
        rankings = []
        for path in (thread_path, dask_path):
            clear_cache()
            passages = engine.run(load_project(path).pipeline("search"), query, orchestrate=False)
            rankings.append([(p.chunk_id, round(p.score, 4)) for p in passages])
        assert rankings[0] == rankings[1] and rankings[0]
    clear_cache()


# --------------------------------------------------------------------------- validation (no cluster)
QUERY_WITH_RUNNER = BASE_RESOURCES + """
pipelines:
  search:
    kind: query
    runner:
      type: dask
    steps:
      - {id: dense, task: retrieve_dense}
  index:
    kind: ingestion
    runner: {type: dask, address: "tcp://127.0.0.1:8786", n_workers: 2}
    steps:
      - {id: load, task: load, with: {paths: [docs]}}
      - {id: write, task: index}
"""


def test_runner_errors_are_located(make_project):
    path = make_project(QUERY_WITH_RUNNER)
    errors = validate_file(path)
    by_field = {(e.pipeline, e.field): e for e in errors}
    lines = path.read_text().splitlines()
    runner_line = lines.index("    runner:") + 1
    query = by_field[("search", "runner")]
    assert query.line == runner_line and "ingestion pipelines only" in query.message
    assert str(query).startswith(f"{path}:{runner_line}, pipeline 'search', field 'runner': ")
    workers = by_field[("index", "runner.n_workers")]
    assert workers.line == next(i for i, line in enumerate(lines, 1) if "n_workers" in line)
    assert "existing one" in workers.message
    assert len(errors) == 2


def test_runner_defaults_to_thread_and_builds_task_runners():
    from prefect_dask import DaskTaskRunner

    from ragline.flows.run.entrypoints import task_runner
    from ragline.flows.spec.parse import PipelineSpec, RunnerSpec

    spec = PipelineSpec.model_validate({"kind": "ingestion", "steps": [{"id": "load", "task": "load"}]})
    assert spec.runner.type == "thread" and task_runner(spec.runner) is None
    local = task_runner(RunnerSpec(type="dask", n_workers=3, threads_per_worker=1, processes=True))
    assert isinstance(local, DaskTaskRunner) and local.address is None
    assert local.cluster_kwargs == {"n_workers": 3, "threads_per_worker": 1, "processes": True}
    remote = task_runner(RunnerSpec(type="dask", address="tcp://10.0.0.5:8786"))
    assert remote.address == "tcp://10.0.0.5:8786" and remote.cluster_kwargs == {}


def test_ray_runner_without_prefect_ray_says_what_to_install():
    import importlib.util

    from ragline.flows.run.entrypoints import task_runner
    from ragline.flows.spec.parse import RunnerSpec

    if importlib.util.find_spec("prefect_ray") is not None:
        from prefect_ray import RayTaskRunner

        runner = task_runner(RunnerSpec(type="ray", n_workers=2))
        assert isinstance(runner, RayTaskRunner) and runner.init_kwargs["num_cpus"] == 2
        return
    with pytest.raises(ImportError, match=r"install ragline\[ray\]"):
        task_runner(RunnerSpec(type="ray"))
