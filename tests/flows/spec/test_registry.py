"""The stage registry: builtin stages found through the ``ragline.stages`` entry points (any
installed package may declare more), a stage's contract read from its signature, dotted user
stages only from allowlisted modules, and an unknown task named in the error. (The allowlist's
sources and narrowing in pipelines files: test_allowlist.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from typing import Optional

import pytest
from pydantic import BaseModel

from ragline.flows.spec import registry
from ragline.flows.spec.compile import validate_file
from ragline.flows.contracts import Chunk, Document, Query, Ranking
from ragline.flows.spec.registry import (BUILTIN_GROUP, NoParams, allowed_modules, get_stage, module_allowed,
                                    set_allowed_modules, stage, stage_names)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def no_external_allowlist(monkeypatch):
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    set_allowed_modules([])
    yield
    set_allowed_modules([])


class LimitParams(BaseModel):
    limit: int = 3


def _contract(docs: list[Document], extra: Optional[list[Chunk]] = None, *, params: LimitParams, ctx,
              store, sparse=None) -> list[Chunk]:
    """Declares every kind of argument a stage can take."""
    return []


CONTRACT = stage("test_registry_contract", params=LimitParams, produces="chunks",
                 uses={"store": ("chroma",), "sparse": ("bm25",)}, kind="ingestion",
                 prompt=lambda p: f"prompt_{p.limit}", prompt_variables=lambda p: ("a", "b")[:p.limit],
                 other_prompts={"judge": ("question",)}, version=3)(_contract)


# ----------------------------------------------------------------------------- discovery
def test_builtin_stages_come_from_the_entry_point_group():
    declared = {entry.value for entry in entry_points(group=BUILTIN_GROUP)}
    assert "ragline.tasks" in declared
    names = stage_names()
    for builtin in ("load", "chunk", "embed", "index", "retrieve_dense", "retrieve_sparse", "fuse", "generate"):
        assert builtin in names and get_stage(builtin).fn.__module__.startswith("ragline.tasks.")


DISCOVERY = """
import json, sys
from ragline.flows.spec import registry
names = registry.stage_names()
print(json.dumps({"extra": "test_extra_discovered" in names, "builtin": "retrieve_dense" in names,
                  "loaded": "extra_stages_pkg" in sys.modules}))
"""


def test_an_installed_package_declaring_the_entry_point_is_discovered(tmp_path):
    """A real distribution (a dist-info with entry_points.txt on sys.path), found in a fresh process."""
    (tmp_path / "extra_stages_pkg.py").write_text(textwrap.dedent("""
        from ragline.flows.spec.registry import stage

        @stage("test_extra_discovered", produces="chunks")
        def extra(chunks: list) -> list:
            return chunks
    """))
    dist = tmp_path / "extra_stages-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-stages\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{BUILTIN_GROUP}]\nextra = extra_stages_pkg\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", DISCOVERY], capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"extra": True, "builtin": True, "loaded": True}


# ----------------------------------------------------------------------------- declared, imported when used
def test_every_builtin_module_is_declared_and_registers_the_name_it_is_declared_under():
    import ragline.tasks as builtins

    modules = {"ragline." + ".".join(p.relative_to(REPO).with_suffix("").parts)
               for p in (REPO / "tasks").rglob("*.py") if p.stem != "__init__"}
    packages = {module for module in builtins.STAGES.values() if (REPO / module.split(".", 1)[1].replace(
        ".", "/") / "__init__.py").is_file()}  # a stage that is a package of its parts (``load``, ``tune_retrieval``)
    parts = {m for m in modules if any(m.startswith(package + ".") for package in packages)}
    assert packages == {"ragline.tasks.ingest.load", "ragline.tasks.jobs.tune_retrieval"}
    assert parts and modules - parts | packages == set(builtins.STAGES.values()) | set(builtins.HELPERS)
    stages = registry.all_stages()
    for name, module in builtins.STAGES.items():
        assert stages[name].fn.__module__ == module, name
    assert {n for n, s in stages.items() if s.fn.__module__.startswith("ragline.tasks.")} == set(builtins.STAGES)


LAZY_PIPELINES = """
resources:
  sparse: {type: bm25, path: idx/bm25}
  state:  {type: index_state, path: idx/state.sqlite}
pipelines:
  search:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, uses: {sparse: sparse, state: state}, with: {k: 3}}
      - {id: fuse, task: fuse, after: [sparse], with: {top_k: 2}}
"""
LAZY_PROBE = """
import json, sys
from ragline.flows.spec.compile import load_project
before = sorted(m for m in sys.modules if m.startswith("ragline.tasks."))
step = load_project("pipelines.yaml").pipeline("search").step("fuse")
after = sorted(m for m in sys.modules if m.startswith("ragline.tasks."))
print(json.dumps({"before": before, "after": after, "top_k": step.params.top_k}))
"""


def test_compiling_a_pipeline_imports_only_the_modules_of_its_stages(tmp_path):
    """In a fresh process (a served flow run is one): the modules of the stages a search names, no other."""
    (tmp_path / "pipelines.yaml").write_text(LAZY_PIPELINES)
    result = subprocess.run([sys.executable, "-c", LAZY_PROBE], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["before"] == [] and seen["top_k"] == 2
    after = set(seen["after"])  # retrieve_sparse imports retrieve_dense (its Params): nothing more
    assert {"ragline.tasks.retrieve.fuse", "ragline.tasks.retrieve.sparse"} <= after <= {
        "ragline.tasks.retrieve",  # the family's package: a docstring
        "ragline.tasks.retrieve.fuse", "ragline.tasks.retrieve.sparse", "ragline.tasks.retrieve.dense"}


def test_every_stage_name_is_suggested_without_importing_its_module():
    names = stage_names()
    assert "summarize_communities" in names and "adapt_embedder" in names


@pytest.fixture
def declared_broken(tmp_path, monkeypatch):
    """Stages declared like the builtins, by a package whose module fails or registers another name."""
    (tmp_path / "lazy_broken_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "lazy_misnamed_mod.py").write_text(textwrap.dedent("""
        from ragline.flows.spec.registry import stage

        @stage("lazy_other_name", produces="chunks")
        def other(chunks: list) -> list:
            return chunks
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    stages = {"lazy_broken": "lazy_broken_mod", "lazy_misnamed": "lazy_misnamed_mod"}
    registry.declare(stages)
    yield stages
    for name in stages:
        registry._DECLARED.pop(name, None)
    registry._REGISTRY.pop("lazy_other_name", None)


def test_a_declared_stage_whose_module_fails_is_an_error_on_its_task_line_at_compile(declared_broken,
                                                                                   make_project):
    with pytest.raises(ImportError, match=r"stage 'lazy_broken': importing module 'lazy_broken_mod' failed: "
                                          r"ModuleNotFoundError: No module named 'no_such_dependency_xyz'"):
        get_stage("lazy_broken")
    path = make_project("""
        pipelines:
          search:
            kind: query
            steps:
              - {id: one, task: lazy_broken}
              - {id: two, task: lazy_misnamed, after: [one]}
    """)
    errors = validate_file(path)
    assert [(e.line, e.field.rpartition(".")[2]) for e in errors] == [(6, "task"), (7, "task")]
    assert "importing module 'lazy_broken_mod' failed" in errors[0].message
    assert errors[1].message == ("stage 'lazy_misnamed': module 'lazy_misnamed_mod' does not register it "
                                 "(its @stage name differs)")


def test_a_declared_name_cannot_be_taken_by_another_module_before_its_own_is_imported(declared_broken):
    def impostor(chunks: list) -> list:
        return chunks

    impostor.__module__ = "somewhere.else"
    with pytest.raises(ValueError, match=r"stage 'lazy_broken' is already registered by lazy_broken_mod"):
        stage("lazy_broken", produces="chunks")(impostor)
    with pytest.raises(ValueError, match=r"stage 'lazy_broken' is already registered by lazy_broken_mod"):
        registry.declare({"lazy_broken": "somewhere.else"})


# ----------------------------------------------------------------------------- contracts
def test_a_stage_reads_its_contract_from_the_signature():
    assert CONTRACT.inputs == {"docs": list[Document], "extra": Optional[list[Chunk]]}
    assert CONTRACT.optional_inputs == {"extra"} and CONTRACT.optional_roles == {"sparse"}
    assert CONTRACT.output_type == list[Chunk] and CONTRACT.description == "Declares every kind of argument a stage can take."
    assert CONTRACT.default_prompt(LimitParams(limit=1)) == "prompt_1" and CONTRACT.default_prompt(None) is None
    assert CONTRACT.variables(LimitParams(limit=1)) == ("a",)
    assert CONTRACT.extra_prompts(LimitParams()) == {"judge": ("question",)} and CONTRACT.version == 3


def test_a_plain_stage_has_no_params_and_fixed_prompt():
    @stage("test_registry_plain", produces="rankings", kind="query", prompt="answer")
    def plain(query: Query) -> list[Ranking]:
        return []

    assert plain.params is NoParams and plain.default_prompt(None) == "answer" and plain.variables(NoParams()) is None
    assert get_stage("test_registry_plain") is plain


def test_sink_hooks_register_on_the_stage():
    @stage("test_registry_sink", produces="report", kind="ingestion")
    def sink(chunks: list[Chunk]) -> dict:
        return {}

    @sink.on_plan
    def plan(docs):
        return docs

    sink.on_finalize(len)
    sink.on_session(dict)
    assert (sink.plan, sink.finalize, sink.session) == (plan, len, dict)


def test_one_name_cannot_be_taken_by_two_modules():
    def impostor(query: Query) -> list[Ranking]:
        return []

    impostor.__module__ = "somewhere.else"
    get_stage("fuse")
    with pytest.raises(ValueError, match=r"stage 'fuse' is already registered by ragline\.tasks\.retrieve\.fuse"):
        stage("fuse", produces="passages")(impostor)
    assert registry._REGISTRY["fuse"].fn.__module__ == "ragline.tasks.retrieve.fuse"


# ----------------------------------------------------------------------------- lookup and allowlist
def test_an_unknown_name_is_none_and_the_compile_error_names_it(make_project):
    assert get_stage("retreive_dense") is None
    path = make_project("""
        pipelines:
          search:
            kind: query
            steps:
              - {id: dense, task: retreive_dense}
    """)
    [error] = validate_file(path)
    assert error.line == 6 and error.field.endswith("task")
    assert error.message == "unknown task 'retreive_dense' (did you mean 'retrieve_dense'?)"


def test_a_dotted_name_outside_the_allowlist_is_refused_before_any_import():
    get_stage("fuse")
    assert "ragline.tasks.retrieve.fuse" in sys.modules
    with pytest.raises(PermissionError, match=r"module 'json\.decoder' is not allowed: set RAGLINE_ALLOW_MODULES"):
        get_stage("json.decoder.JSONDecoder")


def test_a_dotted_name_in_an_allowed_module_is_the_stage_or_none():
    assert get_stage("ragline.tasks.retrieve.fuse.fuse", ["ragline.tasks"]) is registry._REGISTRY["fuse"]
    assert get_stage("ragline.tasks.retrieve.fuse.Params", ["ragline.tasks"]) is None  # not a Stage
    with pytest.raises(ModuleNotFoundError):
        get_stage("ragline.tasks.no_such_module.x", ["ragline.tasks"])


def test_a_module_that_fails_on_import_is_reported_not_raised(tmp_path, monkeypatch):
    (tmp_path / "broken_stages_mod.py").write_text("raise RuntimeError('no config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"importing module 'broken_stages_mod' failed: RuntimeError: no config"):
        get_stage("broken_stages_mod.s", ["broken_stages_mod"])


@pytest.mark.parametrize("module, allowed", [
    ("pkg", True), ("pkg.sub", True), ("pkg.sub.deep", True), ("pkgx", False), ("pk", False), ("other", False),
    ("pkg..sub", False), ("pkg.sub/../x", False), ("", False),
])
def test_module_allowed_means_the_module_or_inside_its_package(module, allowed):
    assert module_allowed(module, ["pkg"]) is allowed


def test_the_allowlist_joins_environment_code_and_extra_once(monkeypatch):
    monkeypatch.setenv(registry.ALLOW_ENV, "env_mod,shared")
    set_allowed_modules(["code_mod", "shared"])
    assert allowed_modules(["extra_mod", "env_mod"]) == ("env_mod", "shared", "code_mod", "extra_mod")


@pytest.mark.parametrize("bad", [["ok", "not a module"], ["a/b"], ["1abc"]])
def test_a_bad_module_name_in_code_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"set_allowed_modules: not a dotted module name: '"):
        set_allowed_modules(bad)
