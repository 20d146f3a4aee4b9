"""Typed errors: one base, statuses and exit codes declared on the classes, mapped by type."""
from __future__ import annotations

import argparse
import ast
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from ragline.flows import cli
from ragline.flows.serve.query_service import ApiError, QueryService
from ragline.flows.errors import EX_USAGE, ConfigError, DependencyUnavailable, MissingResource, RaglineError, exit_code_of
from ragline.flows.resources.stores.chroma import ChromaUnavailable, EmbedderMismatch
from ragline.flows.resources.stores.filters import FilterError
from ragline.flows.resources.models.llm import LLMUnavailable
from ragline.flows.resources.stores.state import IndexBusy, StorageError, StoreMissing
from ragline.flows.run.steps import StepFailed, StepTimedOut
from tests.helpers.data import REPO

CONTROL_FLOW = {"_StreamCut", "_NoTokenizeEndpoint", "Stopped", "UnreadableHtml"}  # caught where raised


def _exception_classes() -> list[tuple[str, str]]:
    """(module path, class name) of every exception class defined in flows/ and tasks/."""
    found = []
    for path in sorted([*(REPO / "flows").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).endswith(("Error", "Exception", "Unavailable", "Busy", "Missing", "Damaged",
                                             "Failed", "Mismatch", "Problem")) for b in node.bases):
                found.append((str(path.relative_to(REPO)), node.name))
    return found


def test_every_exception_class_derives_from_ragline_error():
    import importlib

    classes = _exception_classes()
    assert len(classes) >= 20
    orphans = []
    for path, name in classes:
        module = importlib.import_module("ragline." + path.removesuffix(".py").replace("/", "."))
        if name not in CONTROL_FLOW and not issubclass(getattr(module, name), RaglineError):
            orphans.append(f"{path}:{name}")
    assert orphans == []


def _failure(exc: BaseException) -> ApiError:
    return QueryService.failure(SimpleNamespace(redact=lambda text: text), exc, "r1")


def _step_failed(cause: BaseException, step: str = "answer") -> StepFailed:
    try:
        raise StepFailed("ask", step, "generate", cause) from cause
    except StepFailed as exc:
        return exc


@pytest.mark.parametrize("cause, status, code", [
    (LLMUnavailable("llm at http://x: refused"), 503, "dependency_unavailable"),
    (ChromaUnavailable("chroma down"), 503, "dependency_unavailable"),
    (EmbedderMismatch("re-embed"), 503, "index_needs_reembedding"),
    (StoreMissing("gone"), 503, "index_damaged"),
    (RuntimeError("a bug"), 500, "step_failed"),
    (MissingResource("mode 'llm' needs an openai_compatible resource"), 500, "step_failed"),  # the operator's file
    (StorageError(28, "disk full"), 500, "step_failed"),
])
def test_a_step_failure_answers_by_its_cause_class(cause, status, code):
    error = _failure(_step_failed(cause))
    assert (error.status, error.code) == (status, code)
    if status == 500:
        assert error.message == "pipeline 'ask', step 'answer' (task 'generate') failed (request id r1; details in " \
                                "the server log)"
        assert "a bug" not in error.message and "disk" not in error.message


def test_a_subclass_of_a_dependency_error_is_classified_like_its_base():
    """The old code compared class names: a subclass (a user stage's own) was a 500."""
    class VectorDbUnavailable(ChromaUnavailable):
        pass

    class OddFilter(FilterError):
        pass

    assert _failure(_step_failed(VectorDbUnavailable("down"))).status == 503
    error = _failure(_step_failed(OddFilter("$foo is not an operator")))
    assert (error.status, error.code, error.param, error.message) == (
        422, "invalid_filter", "filters", "field 'filters': $foo is not an operator")


def test_the_status_never_depends_on_the_message_text():
    """A stage whose error says 'timed out after' is not a timeout; a step named 'x failed: y' keeps its name."""
    error = _failure(_step_failed(RuntimeError("upstream timed out after 3 s"), "fetch failed: now"))
    assert (error.status, error.code) == (500, "step_failed")
    assert error.message.startswith("pipeline 'ask', step 'fetch failed: now' (task 'generate') failed (request id")
    assert _failure(StepFailed("ask", "wait timed out after 3 s", "generate")).status == 500  # no cause
    timed_out = _failure(StepTimedOut(None, "answer", "generate", 2.5))
    assert (timed_out.status, timed_out.code, timed_out.message, timed_out.headers) == (
        504, "step_timeout", "step 'answer' (task 'generate') timed out after 2.5 s", {"x-should-retry": "false"})


def test_a_dependency_error_outside_any_step_answers_by_its_class():
    error = _failure(LLMUnavailable("the LLM at http://127.0.0.1:9 did not answer"))
    assert (error.status, error.type, error.code) == (503, "service_unavailable_error", "dependency_unavailable")
    assert _failure(KeyError("not ours")).code == "internal_error"
    refused = _failure(ValueError("pipeline 'ask': invalid query (text: too short)"))  # engine.run's own kind
    assert (refused.status, refused.code, refused.param) == (422, "invalid_value", "question")


def test_errors_keep_their_fields_across_processes():
    restored = pickle.loads(pickle.dumps(_step_failed(ValueError("x"))))
    assert (restored.pipeline, restored.step, restored.stage, str(restored)) == (
        "ask", "answer", "generate", "pipeline 'ask', step 'answer' (task 'generate') failed: ValueError: x")
    disk = pickle.loads(pickle.dumps(StorageError(28, "store 'bm25' at /d: no space left on device")))
    assert (disk.errno, str(disk), isinstance(disk, OSError)) == (28, "store 'bm25' at /d: no space left on device",
                                                                 True)


class _Throttled(DependencyUnavailable):
    exit_code = 69  # EX_UNAVAILABLE


@pytest.mark.parametrize("exc, code, line", [
    (IndexBusy("the index is being written by run 7"), 75, "error: the index is being written by run 7"),
    (_Throttled("the LLM is rate limited"), 69, "error: the LLM is rate limited"),
    (FilterError("$foo is not an operator"), 2, "error: $foo is not an operator"),
    (StoreMissing("store 'chroma' at /d is missing"), 1, "error: store 'chroma' at /d is missing"),
])
def test_the_cli_exit_status_is_the_error_class(exc, code, line, capsys):
    def handler(args):
        raise exc

    assert cli._dispatch(argparse.Namespace(handler=handler, verbose=False)) == code
    assert capsys.readouterr().err == line + "\n"


def test_a_verbose_cli_keeps_the_traceback_of_our_failures_only():
    def handler(args):
        raise StoreMissing("gone")

    with pytest.raises(StoreMissing):
        cli._dispatch(argparse.Namespace(handler=handler, verbose=True))
    assert not any("return 75" in path.read_text() for path in Path(cli.__file__).parent.glob("*.py"))  # on the classes


def test_a_missing_resource_is_the_pipelines_files_to_fix_and_still_a_value_error():
    """A stage's "mode 'llm' needs an openai_compatible resource" is typed (before: a bare ValueError):
    a configuration error, the CLI's usage status, and a ValueError for the handlers that caught it."""
    error = MissingResource("mode 'llm' needs an openai_compatible resource: add one and name it in `uses`")
    assert isinstance(error, ConfigError) and isinstance(error, ValueError)
    assert exit_code_of(error) == EX_USAGE and error.error_code == "invalid_configuration"
