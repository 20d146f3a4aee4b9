"""The tuned overlay: applied on top of pipelines.yaml by every command (never written into it),
validated like --set, shown by `ragline validate`, skipped where the user changed the file since
tuning, ignored with --no-tuned, per data folder, and carried to steps in other processes."""
from __future__ import annotations

import textwrap

import pytest

from ragline.flows import cli
from ragline.flows.spec import overlay
from ragline.flows.run import steps
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Candidate, TuneReport
from ragline.flows.spec.parse import SpecValidationError

PIPELINES = """
resources:
  embedder: {type: sentence_transformer}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 100}}
      - {id: sparse, task: retrieve_sparse, with: {k: 100}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {method: rrf, k: 60}}
  tune:
    kind: job
    schedule: {cron: "0 3 * * 0"}
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
"""

OVERLAY = """\
# Written by `ragline tune` (test)
version: 1
tuned:
  at: '2025-01-01T00:00:00+00:00'
  pseudo_queries: {count: 300}
  metric: ndcg@10
  chosen: {name: 'rrf k=20, dense weight 0.7', ndcg@10: 0.61}
  baseline: {name: 'rrf k=60, dense weight 0.5', ndcg@10: 0.58}
resources:
  sparse: {k1: 0.9, b: 0.5, stemmer: english}
pipelines:
  search:
    fuse: {method: rrf, k: 20, weights: {dense: 0.7, sparse: 0.3}}
    dense: {k: 50}
replaces:
  resources:
    sparse: {k1: 1.2, b: 0.75, stemmer: english}
  pipelines:
    search:
      fuse: {method: rrf, k: 60, weights: {}}
      dense: {k: 100}
"""


@pytest.fixture
def project_file(make_project):
    path = make_project(PIPELINES)
    (path.parent / "pipelines.tuned.yaml").write_text(OVERLAY)
    return path


def fuse_params(project):
    return project.pipeline("search").step("fuse").params


def test_overlay_sets_step_parameters_and_resource_fields(project_file):
    written = project_file.read_bytes()
    project = load_project(project_file)
    params = fuse_params(project)
    assert (params.method, params.k, params.weights) == ("rrf", 20, {"dense": 0.7, "sparse": 0.3})
    assert project.pipeline("search").step("dense").params.k == 50
    assert project.pipeline("search").step("sparse").params.k == 100  # not in the overlay
    sparse = project.spec.resources["sparse"]
    assert (sparse.k1, sparse.b) == (0.9, 0.5)
    assert project.resource("sparse").spec.k1 == 0.9  # the BM25 index is built (and rebuilt) with them
    assert project_file.read_bytes() == written
    assert project.overlay is not None and not project.overlay.notes
    plain = load_project(project_file, tuned=False)
    assert (fuse_params(plain).k, plain.spec.resources["sparse"].k1) == (60, 1.2)
    assert plain.overlay is None and plain.untuned is None


def test_no_tuned_and_the_environment_switch_ignore_it(project_file, monkeypatch):
    monkeypatch.setenv("RAGLINE_TUNED", "0")
    assert fuse_params(load_project(project_file)).k == 60
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    assert fuse_params(load_project(project_file)).k == 20


def test_validate_shows_what_the_overlay_changes(project_file, capsys, monkeypatch):
    assert cli.main(["validate", str(project_file)]) == 0
    out = capsys.readouterr().out
    assert "tuned overlay" in out and "pipelines.tuned.yaml" in out
    assert "chosen: rrf k=20, dense weight 0.7 (ndcg@10 0.61; pipelines.yaml's own 0.58" in out
    assert "pipeline search, step fuse: k 60 -> 20" in out
    assert "resource sparse: k1 1.2 -> 0.9" in out
    monkeypatch.setenv("RAGLINE_TUNED", "1")  # restored after the test: --no-tuned sets it for the process
    assert cli.main(["validate", str(project_file), "--no-tuned"]) == 0
    assert "tuned overlay" not in capsys.readouterr().out


def test_a_setting_changed_in_the_file_since_tuning_wins(project_file, caplog):
    project_file.write_text(project_file.read_text().replace("{method: rrf, k: 60}", "{method: rrf, k: 30}"))
    project = load_project(project_file)
    assert fuse_params(project).k == 30 and fuse_params(project).weights == {}  # the user's edit stands
    assert project.pipeline("search").step("dense").params.k == 50  # the rest still applies
    assert any("changed k (60 -> 30) since tuning" in n for n in project.overlay.notes)
    assert "since tuning" in caplog.text


def test_entries_whose_pipeline_or_step_is_gone_are_skipped_with_a_note(project_file):
    project_file.write_text(project_file.read_text().replace("id: fuse,   task: fuse", "id: merge,  task: fuse"))
    project = load_project(project_file)
    assert project.pipeline("search").step("merge").params.k == 60
    assert any("no step 'fuse'" in n for n in project.overlay.notes)


def test_an_invalid_overlay_is_an_error_naming_its_file_and_line(project_file, capsys):
    tuned = project_file.parent / "pipelines.tuned.yaml"
    tuned.write_text(OVERLAY.replace("{method: rrf, k: 20,", "{method: rrf, k: -5,"))
    with pytest.raises(SpecValidationError) as caught:
        load_project(project_file)
    error = caught.value.errors[0]
    assert error.file == str(tuned) and error.line == 13 and error.step == "fuse"
    assert cli.main(["validate", str(project_file)]) == 2  # bad configuration (issue 24)
    assert "pipelines.tuned.yaml:13" in capsys.readouterr().err
    tuned.write_text(OVERLAY.replace("version: 1", "version: 1\nsurprise: 2"))
    with pytest.raises(SpecValidationError, match="run `ragline tune` again"):
        load_project(project_file)


def test_each_data_folder_has_its_own_overlay(project_file, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    project = load_project(project_file)
    moved = project.relocated(other)
    assert fuse_params(moved).k == 60 and moved.overlay is None  # the file's overlay tunes the file's index
    (other / "pipelines.tuned.yaml").write_text(OVERLAY.replace("k: 20,", "k: 10,"))
    assert fuse_params(project.relocated(other)).k == 10
    assert overlay.overlay_path(project.relocated(other)) == (other / "pipelines.tuned.yaml").resolve()


def test_changing_a_resource_keeps_the_overlay(project_file):
    project = load_project(project_file).with_resource("embedder", backend="onnx_int8")
    assert project.spec.resources["embedder"].backend == "onnx_int8"
    assert fuse_params(project).k == 20 and project.spec.resources["sparse"].k1 == 0.9


def test_a_step_in_another_process_runs_with_the_drivers_values(project_file, monkeypatch):
    pipeline = load_project(project_file).pipeline("search")
    ref = steps.PipelineRef.of(pipeline)
    steps._LIVE.clear()  # as a fresh worker process
    monkeypatch.setenv("RAGLINE_TUNED", "0")  # even one that would not apply the overlay itself
    resolved = ref.resolve()
    fuse = resolved.step("fuse").params
    assert (fuse.k, fuse.weights) == (20, {"dense": 0.7, "sparse": 0.3})
    assert resolved.project.spec.resources["sparse"].k1 == 0.9
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    steps._LIVE.clear()
    assert steps.PipelineRef.of(load_project(project_file).pipeline("search")).resolve().step("fuse").params.k == 20


def report(**changes) -> TuneReport:
    chosen = Candidate(name="rrf k=20", setting={}, scores={"ndcg@10": 0.6, "mrr@10": 0.5, "recall@100": 0.9})
    return TuneReport(metric="ndcg@10", pairs=10, chosen=chosen, baseline=chosen, candidates=[chosen],
                      overrides={"resources": {"sparse": {"k1": 0.9}},
                                 "pipelines": {"search": {"fuse": {"k": 20}}}}, **changes)


def test_writing_never_touches_the_pipelines_file_or_a_foreign_file(project_file):
    project = load_project(project_file, tuned=False)
    with pytest.raises(ValueError, match="refusing"):
        overlay.write_overlay(project, project_file, report())
    foreign = project_file.parent / "mine.yaml"
    foreign.write_text("my: notes\n")
    with pytest.raises(ValueError, match="not written by `ragline tune`"):
        overlay.write_overlay(project, foreign, report())
    assert foreign.read_text() == "my: notes\n"
    path = overlay.write_overlay(project, project_file.parent / "pipelines.tuned.yaml", report())
    text = path.read_text()
    assert text.startswith(overlay.HEADER)
    assert "replaces:" in text and "k: 60" in text  # what the file had, so a later edit of it wins
    tuned = load_project(project_file)
    assert fuse_params(tuned).k == 20 and tuned.spec.resources["sparse"].k1 == 0.9


def test_a_job_pipeline_is_scheduled_like_an_ingestion(project_file):
    from ragline.flows.serve.supervise.service import deployment_options

    options = deployment_options(load_project(project_file))
    assert [s.cron for s in options["tune"]["schedules"]] == ["0 3 * * 0"]
    assert "schedules" not in options["search"]
    assert "job" in options["tune"]["tags"]


def test_a_job_pipeline_takes_no_cluster_runner(make_project):
    path = make_project(PIPELINES + textwrap.indent("runner: {type: dask}\n", "    "))
    with pytest.raises(SpecValidationError, match="a job pipeline runs in the caller's process"):
        load_project(path)


def adaptation(model_path, **changes):
    from ragline.tasks.jobs.adapt_embedder import AdaptReport

    fields = {"base_model": "all-MiniLM-L6-v2", "key": "abc123", "pairs": 300, "strategies": {"inverse_cloze": 300},
              "chunks": 42, "timings": {"training": 61.5}}
    return AdaptReport(model_path=str(model_path), **{**fields, **changes})


def test_the_adapted_model_and_the_tuned_settings_keep_each_other(project_file, capsys):
    path = project_file.parent / "pipelines.tuned.yaml"
    model = project_file.parent / "idx" / "models" / "all-MiniLM-L6-v2-adapted-abc123"
    model.mkdir(parents=True)
    plain = load_project(project_file, tuned=False)
    overlay.write_adaptation(plain, path, adaptation(model))
    adapted = load_project(project_file)
    assert adapted.spec.resources["embedder"].model == str(model)
    assert adapted.overlay.adapted["base_model"] == "all-MiniLM-L6-v2" and adapted.overlay.adapted["pairs"] == 300
    assert any("adapted embedder" in line and str(model) in line for line in adapted.overlay.describe())

    overlay.write_overlay(adapted, path, report())  # tuning afterwards keeps the model, and sets its own
    both = load_project(project_file)
    assert both.spec.resources["embedder"].model == str(model)
    assert fuse_params(both).k == 20 and both.spec.resources["sparse"].k1 == 0.9

    overlay.write_adaptation(both, path, adaptation(model, key="def456"))  # adapting again keeps the tuning
    again = load_project(project_file)
    assert again.overlay.adapted["key"] == "def456" and fuse_params(again).k == 20
    assert again.overlay.tuned["chosen"]["name"] == "rrf k=20"

    assert cli.main(["validate", str(project_file)]) == 0
    out = capsys.readouterr().out
    assert "adapted embedder" in out and "ragline tune" in out and "adapt," in out

    # the user points the embedder elsewhere in pipelines.yaml: the file wins, the tuning still applies
    project_file.write_text(PIPELINES.replace("{type: sentence_transformer}",
                                              "{type: sentence_transformer, model: /models/mine}"))
    mine = load_project(project_file)
    assert mine.spec.resources["embedder"].model == "/models/mine" and fuse_params(mine).k == 20
    assert any("resource 'embedder'" in note and "changed" in note for note in mine.overlay.notes)


def test_a_deleted_adapted_model_is_not_applied(project_file):
    path = project_file.parent / "pipelines.tuned.yaml"
    gone = project_file.parent / "idx" / "models" / "gone"
    overlay.write_adaptation(load_project(project_file, tuned=False), path, adaptation(gone))
    project = load_project(project_file)
    assert project.spec.resources["embedder"].model == "all-MiniLM-L6-v2"
    assert any("the adapted model" in note and "is gone" in note for note in project.overlay.notes)


def test_a_project_compiled_for_one_pipeline_takes_its_overlay_and_notes_nothing_of_the_others(project_file):
    project = load_project(project_file, only=["tune"])
    assert list(project.pipelines) == ["tune"] and project.overlay.notes == []
    assert project.spec.resources["sparse"].k1 == 0.9  # the resources' overlay all the same
    assert fuse_params(load_project(project_file, only=["search"])).k == 20
