"""Shared fixtures: project folders, one packaged MiniLM embedder, a tiny cross-encoder and a vLLM server
per session (data and templates: tests/helpers/data.py)."""
from __future__ import annotations

import itertools
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling


def _cores_per_worker() -> int | None:
    """A pytest-xdist worker's share of the cores (None outside a worker: the defaults stay)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if "PYTEST_XDIST_WORKER" not in os.environ or not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


# Three workers on two cores, each with BLAS and torch thread pools as wide as the machine, spin for
# cores the others hold: a 1000x50 bootstrap matmul took 7.6 ms so, 0.23 ms on one thread. OpenBLAS
# reads its size when numpy loads it (nothing has imported numpy yet); torch's is set per test
# (pytest_runtest_setup), not through OMP_NUM_THREADS, which the servers tests start would inherit.
CORES_PER_WORKER = _cores_per_worker()
if CORES_PER_WORKER is not None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(CORES_PER_WORKER))

import ragline.flows  # noqa: E402, F401 - offline defaults before any heavy import

from tests.helpers.data import (BASE_RESOURCES, DATA, INDEX_AND_SEARCH, REPO, SCIFACT,  # noqa: F401 - for old imports
                                index_and_search_yaml, scifact_records, write_jsonl)
from tests.helpers.postgres import new_schema, postgres  # noqa: F401 - the session's PostgreSQL (index state tests)

# A command whose local LLM endpoint is down starts the packaged vLLM (issue 24.3): never in a test
# unless it asks for it (tests/fake_vllm.py, RAGLINE_VLLM_DEPLOY, RAGLINE_START_LLM unset for its child).
os.environ.setdefault("RAGLINE_START_LLM", "0")
# A command that starts ragline's local Prefect API stops it on exit (as before RAGLINE_PREFECT_IDLE_SECONDS):
# no test leaves a server behind; the tests of the shared server set their own timeout and stop what they start.
os.environ.setdefault("RAGLINE_PREFECT_IDLE_SECONDS", "0")

# The modules whose tests use the session's real vLLM server (~3 min to start on CPU, ~2.5 GB): under
# pytest-xdist (the README's `pytest -n 3`) they run on one worker, so it starts once. A test elsewhere
# that asks for `vllm_server` is refused at collection: add its module here.
VLLM_MODULES = frozenset({"tests/integration/test_vllm_server.py", "tests/integration/test_ask_vllm.py",
                          "tests/integration/test_ask_company_vllm.py", "tests/integration/test_quickstart_vllm.py"})


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def work_unit(nodeid: str) -> str:
    """What one worker runs in one go: a module (its module-scoped servers start once), and every
    vLLM module together."""
    module = _module(nodeid)
    return "vllm" if module in VLLM_MODULES else module


class ModuleScheduling(LoadScopeScheduling):
    """xdist's loadscope, with the vLLM modules as one unit (its own `loadgroup` marks test ids with
    `@group`, which pytest 9 no longer lets a plugin change)."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The vLLM users are where VLLM_MODULES says; under xdist the longest units go first (workers
    take the next unit as they finish one; `--no-loadscope-reorder` keeps this order): the vLLM
    modules, then the integration modules, the quick modules last."""
    strays = sorted({_module(i.nodeid) for i in items if "vllm_server" in i.fixturenames} - VLLM_MODULES)
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use the vllm_server fixture: add them to VLLM_MODULES "
                                f"in tests/conftest.py (one worker holds the session's vLLM)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # whole units move, each keeps its own order
        rank: dict[str, int] = {}
        for item in items:
            unit = work_unit(item.nodeid)
            own = 0 if unit == "vllm" else 1 if item.get_closest_marker("integration") else 2
            rank[unit] = min(rank.get(unit, 2), own)
        items.sort(key=lambda item: rank[work_unit(item.nodeid)])


def pytest_runtest_setup(item):
    """A worker's torch keeps to its share of the cores (see CORES_PER_WORKER), once a test loaded it."""
    torch = sys.modules.get("torch")
    if CORES_PER_WORKER is not None and torch is not None and torch.get_num_threads() != CORES_PER_WORKER:
        torch.set_num_threads(CORES_PER_WORKER)


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_ignore_collect(collection_path, config):
    """Under ``-m "not integration"`` tests/integration/ is not collected at all: importing its ~70
    modules cost each worker ~5 s for tests that were then deselected (all of them are marked
    integration: tests/integration/conftest.py)."""
    if collection_path == INTEGRATION and _deselects_integration(config.getoption("markexpr")):
        return True
    return None


def _deselects_integration(markexpr: str) -> bool:
    """Whether ``-m markexpr`` deselects a test marked integration whatever its other marks are."""
    from _pytest.mark.expression import Expression

    others = sorted(set(re.findall(r"[A-Za-z_]\w*", markexpr)) - {"and", "or", "not", "integration"})
    if not markexpr or len(others) > 8:
        return False
    try:
        expression = Expression.compile(markexpr)
    except SyntaxError:
        return False  # pytest reports it
    for present in itertools.product((False, True), repeat=len(others)):
        marks = {"integration", *(name for name, on in zip(others, present) if on)}
        if expression.evaluate(lambda name, /, **_: name in marks):
            return False
    return True


@pytest.fixture
def state_backend(request):
    """Where a test project's index state lives: the SQLite file (the default), or, for a test that
    parametrizes this fixture with "postgres" (``indirect=True``), a schema of its own on the session's
    PostgreSQL. Returns the pipelines.yaml text with its state line changed accordingly."""
    backend = getattr(request, "param", "sqlite")
    if backend == "sqlite":
        return lambda text: text
    url, schema = request.getfixturevalue("postgres").url, new_schema()
    return lambda text: re.sub(r"(state:\s*\{type: index_state[^}]*)\}", rf"\1, url: '{url}', schema_name: {schema}}}",
                               text)


@pytest.fixture
def make_project(tmp_path, state_backend):
    """Write a pipelines.yaml (and optional prompts) into tmp_path; returns its path."""

    def make(yaml_text: str, prompts: dict[str, str] | None = None, name: str = "pipelines.yaml") -> Path:
        (tmp_path / "prompts").mkdir(exist_ok=True)
        for prompt, body in (prompts or {}).items():
            (tmp_path / "prompts" / f"{prompt}.j2").write_text(body)
        path = tmp_path / name
        path.write_text(state_backend(textwrap.dedent(yaml_text)))
        return path

    return make


@pytest.fixture
def index_project(make_project):
    """A project with the standard index/search pipelines over tmp_path/docs."""

    def make(batch_size: int = 256, chunk_size: int = 128) -> Path:
        return make_project(index_and_search_yaml(batch_size, chunk_size))

    return make


@pytest.fixture(scope="session")
def minilm():
    """The packaged all-MiniLM-L6-v2 (offline), loaded once and shared by stage and resource tests."""
    from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec

    return Embedder(EmbedderSpec(type="sentence_transformer"))


@pytest.fixture(scope="session")
def vllm_server():
    """One real vLLM server (SmolLM2-135M on CPU) for the whole session. The first use installs
    .venv-vllm/ and converts the model (~3 min); starting takes ~45-120 s. Set
    RAGLINE_LLM_BASE_URL=http://HOST:PORT/v1 to test against a server that is already running."""
    from tests.llm_server import start_vllm

    server = start_vllm()
    try:
        yield server
    finally:
        server.stop()  # no-op for an external server


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory) -> Path:
    """A real but tiny, randomly initialised BERT cross-encoder with the MiniLM tokenizer, saved as
    a local model folder: no cross-encoder ships its weights offline (see MODELS.md)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ragline.flows.resources.models.embedder import resolve_model_path

    folder = tmp_path_factory.mktemp("cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def many_fds():
    """Room in the test process for a few thousand sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 8192) if hard != resource.RLIM_INFINITY else 8192
    if wanted < 4000:
        pytest.skip(f"the fd limit ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
