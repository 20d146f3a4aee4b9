"""Running one step anywhere: ``StepCall``/``PipelineRef`` as plain data that another process
resolves (and refuses once the file changed), ``digest_of``, ``pin_file``/``served_copy`` (the
copy ``ragline serve`` pins), and ``execute``/``invoke`` (inputs joined, only the arguments a
stage takes, failures wrapped once naming pipeline, step and stage)."""
from __future__ import annotations

import hashlib
import pickle

import pytest
from pydantic import BaseModel, ConfigDict

from ragline.flows.run import steps
from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query, Ranking, StepResult
from ragline.flows.spec.registry import stage
from ragline.flows.run.steps import (SERVED_DIR, PipelineRef, StepCall, StepFailed, digest_of, execute, invoke, pin_file,
                                 served_copy)


class TagParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "t"
    fail: bool = False


@stage("test_steps_tag", params=TagParams, produces="rankings", kind="query")
def _tag(query: Query, params: TagParams, ctx) -> list[Ranking]:
    """One ranking naming the step, its tag and the query."""
    if params.fail:
        raise KeyError("missing thing")
    return [Ranking(retriever=ctx.step_id, query=query.text,
                    passages=[Passage(chunk_id=f"{ctx.step_id}:{params.tag}:{query.text}", source_id="s", text="x")])]


@stage("test_steps_bare", produces="rankings", kind="query")
def _bare(query: Query) -> list[Ranking]:
    """Takes neither params nor ctx: invoke must not pass them."""
    return [Ranking(retriever="bare", query=query.text, passages=[])]


@stage("test_steps_reraise", produces="rankings", kind="query")
def _reraise(query: Query) -> list[Ranking]:
    raise StepFailed("inner", "deep", "nested")


PROJECT = """
pipelines:
  search:
    kind: query
    steps:
      - {id: one,  task: test_steps_tag, with: {tag: first}}
      - {id: two,  task: test_steps_tag, after: []}
      - {id: fuse, task: fuse, after: [one, two]}
  odd:
    kind: query
    steps:
      - {id: bare,  task: test_steps_bare}
      - {id: bad,   task: test_steps_tag, after: [], with: {fail: true}}
      - {id: inner, task: test_steps_reraise, after: []}
      - {id: fuse,  task: fuse, after: [bare, bad, inner]}
"""


@pytest.fixture
def project_file(make_project):
    return make_project(PROJECT)


@pytest.fixture
def search(project_file):
    return load_project(project_file).pipeline("search")


def ctx_for(pipeline, step_id: str) -> StepContext:
    return StepContext(pipeline=pipeline.name, step_id=step_id, project=pipeline.project)


# ----------------------------------------------------------------------------- digests and pinned copies
def test_digest_of_is_the_content_hash_and_empty_for_a_missing_file(tmp_path):
    path = tmp_path / "pipelines.yaml"
    path.write_text("a: 1\n")
    assert digest_of(path) == hashlib.sha256(b"a: 1\n").hexdigest()[:16]
    assert digest_of(tmp_path / "absent.yaml") == ""
    path.write_text("a: 2\n")
    assert digest_of(path) == hashlib.sha256(b"a: 2\n").hexdigest()[:16]


def test_served_copy_lies_under_the_data_dir_or_beside_the_file(tmp_path):
    digest = "0123456789abcdef"
    file = tmp_path / "p" / "pipelines.yaml"
    assert served_copy(file, None, digest) == (tmp_path / "p").resolve() / SERVED_DIR / f"{digest}.yaml"
    assert served_copy(file, tmp_path / "data", digest) == (tmp_path / "data").resolve() / SERVED_DIR / f"{digest}.yaml"


@pytest.mark.parametrize("digest", ["", "../../etc/passwd", "0123456789ABCDEF", "0123456789abcde", None])
def test_served_copy_refuses_anything_but_a_digest(tmp_path, digest):
    """The digest arrives as a flow-run parameter: it never names a path of its own."""
    with pytest.raises(ValueError, match=r"parameter 'digest': .* is not a pipelines-file digest \(16 hex digits\)"):
        served_copy(tmp_path / "pipelines.yaml", None, digest)


def test_pin_file_copies_the_text_once_per_content(project_file, tmp_path):
    data = tmp_path / "data"
    pinned = pin_file(project_file, data)
    assert pinned == served_copy(project_file, data, digest_of(project_file))
    assert pinned.read_text() == project_file.read_text()
    assert pin_file(project_file, data) == pinned  # same content: same copy
    project_file.write_text(project_file.read_text() + "\n# edited\n")
    edited = pin_file(project_file, data)
    assert edited != pinned and pinned.is_file() and edited.read_text().endswith("# edited\n")
    assert not list(pinned.parent.glob(".*.partial"))


def test_a_damaged_pinned_copy_is_rewritten(project_file, tmp_path):
    pinned = pin_file(project_file, tmp_path)
    pinned.write_text("truncat")
    assert pin_file(project_file, tmp_path) == pinned and pinned.read_text() == project_file.read_text()


# ----------------------------------------------------------------------------- PipelineRef and StepCall
def test_a_call_is_plain_data_with_the_drivers_changes(search, tmp_path):
    changed = search.with_overrides({"two": {"tag": "second"}})
    ref = PipelineRef.of(changed)
    call = StepCall(ref, "two", "fp", None)
    assert pickle.loads(pickle.dumps(call)) == call
    assert ref.overrides == {"two": {"tag": "second"}} and ref.digest == digest_of(search.project.path)
    assert ref.resolve() is changed  # this process: the driver's own object


def test_another_process_compiles_the_same_pipeline_from_the_file(search):
    ref = PipelineRef.of(search.with_overrides({"two": {"tag": "second"}}))
    steps._LIVE.pop(ref.key)  # as in a fresh worker
    resolved = ref.resolve()
    assert resolved.step("two").params.tag == "second" and resolved.step("one").params.tag == "first"
    assert ref.resolve() is resolved  # compiled once per process


def test_a_worker_refuses_a_file_edited_since_the_run_started(search, project_file):
    ref = PipelineRef.of(search)
    steps._LIVE.pop(ref.key)
    project_file.write_text(project_file.read_text().replace("tag: first", "tag: edited"))
    with pytest.raises(RuntimeError, match=rf"{project_file} changed since this run started; run it again"):
        ref.resolve()


def test_a_pinned_source_is_read_instead_of_the_file(project_file, tmp_path):
    pinned = pin_file(project_file, tmp_path)
    project_file.write_text(project_file.read_text().replace("tag: first", "tag: edited"))  # after serve pinned it
    pipeline = load_project(project_file, source=pinned).pipeline("search")
    ref = PipelineRef.of(pipeline)
    steps._LIVE.pop(ref.key)
    assert ref.source == str(pinned.resolve()) and ref.resolve().step("one").params.tag == "first"


def test_the_live_cache_is_bounded(search):
    for i in range(steps._LIVE_LIMIT + 5):
        PipelineRef.of(search.with_overrides({"two": {"tag": f"t{i}"}}))
    assert len(steps._LIVE) == steps._LIVE_LIMIT


# ----------------------------------------------------------------------------- execute and invoke
def test_execute_joins_several_producers_and_reports_timing(search):
    call = StepCall(PipelineRef.of(search), "fuse", "fp")
    one = execute(StepCall(PipelineRef.of(search), "one"), {"query": [StepResult(Query(text="q"))]})
    two = execute(StepCall(PipelineRef.of(search), "two"), {"query": [StepResult(Query(text="q"))]})
    fused = execute(call, {"rankings": [one, two]})
    assert {p.chunk_id for p in fused.value} == {"one:first:q", "two:t:q"}
    assert fused.seconds > 0 and fused.failures == []


def test_invoke_passes_only_what_the_stage_takes(project_file):
    odd = load_project(project_file).pipeline("odd")
    assert invoke(odd, odd.step("bare"), {"query": Query(text="q")}, ctx_for(odd, "bare"))[0].retriever == "bare"


def test_a_stage_failure_is_wrapped_once_naming_pipeline_step_and_stage(project_file):
    odd = load_project(project_file).pipeline("odd")
    with pytest.raises(StepFailed) as info:
        invoke(odd, odd.step("bad"), {"query": Query(text="q")}, ctx_for(odd, "bad"))
    error = info.value
    assert str(error) == "pipeline 'odd', step 'bad' (task 'test_steps_tag') failed: KeyError: 'missing thing'"
    assert (error.pipeline, error.step, error.stage) == ("odd", "bad", "test_steps_tag")
    assert isinstance(error.cause, KeyError) and error.where == "pipeline 'odd', step 'bad' (task 'test_steps_tag')"
    with pytest.raises(StepFailed) as nested:
        invoke(odd, odd.step("inner"), {"query": Query(text="q")}, ctx_for(odd, "inner"))
    assert nested.value.step == "deep"  # a StepFailed from inside passes through unwrapped


def test_invoke_takes_params_given_instead_of_the_steps(search):
    [ranking] = invoke(search, search.step("one"), {"query": Query(text="q")}, ctx_for(search, "one"),
                       params=TagParams(tag="given"))
    assert ranking.passages[0].chunk_id == "one:given:q"


def test_a_step_failure_pickles_without_its_cause():
    """In a fresh process: once Dask's `distributed` is imported, tblib's pickling support sends
    every exception's cause along too (so a test process that ran the Dask tests would)."""
    import subprocess
    import sys

    script = ("import pickle; from ragline.flows.run.steps import StepFailed; "
              "error = StepFailed('p', 's', 't', ValueError('x')); copy = pickle.loads(pickle.dumps(error)); "
              "print(str(copy) == str(error), copy.where == error.where, copy.cause is None)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True", "True"], result.stderr[-2000:]
