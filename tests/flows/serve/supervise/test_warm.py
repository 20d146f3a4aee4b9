"""flows/serve/supervise/warm.py: serve's flow runs fork from a forkserver that imported their modules once."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import prefect.flow_engine as engine
import pytest

from ragline.flows.serve.supervise.warm import BASE_MODULES, preload_modules, warm_flow_runs
from ragline.flows.spec.compile import load_project
from tests.fake_vllm import REPO

PRELOADED = "wave"  # a module nothing a flow run imports needs (the forkserver is a fresh interpreter)


def _report(queue) -> None:
    queue.put((PRELOADED in sys.modules, os.getppid()))


def test_the_preload_is_the_engine_the_projects_stages_and_its_resources_libraries():
    modules = preload_modules(load_project(REPO / "pipelines.yaml"))
    assert modules[:len(BASE_MODULES)] == list(BASE_MODULES) and len(modules) == len(set(modules))
    assert {"ragline.tasks.ingest.load", "ragline.tasks.ingest.chunk", "ragline.tasks.ingest.index", "ragline.tasks.retrieve.dense",
            "ragline.tasks.generate.generate"} <= set(modules)
    assert {"chromadb", "bm25s", "sentence_transformers", "openai"} <= set(modules)
    assert "ragline.tasks.rewrite.self_query" not in modules  # only what the file's pipelines name


@pytest.mark.integration  # flow-run processes forked by a real forkserver
def test_flow_run_processes_fork_from_a_server_that_imported_their_modules():
    """In a fresh interpreter, as serve is: multiprocessing's forkserver is one per process and keeps
    the preload it started with, so one an earlier test started here (tests/helpers/harness.py)
    would not have imported ours."""
    done = subprocess.run([sys.executable, "-c", f"import {__name__} as t; t.fork_a_flow_run_process()"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def fork_a_flow_run_process() -> None:
    with warm_flow_runs([PRELOADED]) as warm:
        assert warm
        context = engine.multiprocessing.get_context("spawn")  # what Prefect asks for a flow run's process
        assert context.get_start_method() == "forkserver"
        queue = context.SimpleQueue()
        process = context.Process(target=_report, args=(queue,))
        process.start()
        preloaded, parent = queue.get()
        process.join(30)
        assert process.exitcode == 0 and preloaded
        assert parent != os.getpid() and _parent_of(parent) == os.getpid()  # forked by our forkserver
        assert engine.multiprocessing.get_context("fork").get_start_method() == "fork"  # others are multiprocessing's
    assert engine.multiprocessing is multiprocessing


def test_a_prefect_that_starts_runs_another_way_gets_them_started_cold(monkeypatch):
    other = object()
    monkeypatch.setattr(engine, "multiprocessing", other)
    with warm_flow_runs([PRELOADED]) as warm:
        assert warm is False and engine.multiprocessing is other  # nothing patched: Prefect's own way


def _parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
