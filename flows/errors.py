"""ragline's exceptions: one ``RaglineError`` base, each kind with its HTTP status, error code and
CLI exit code declared once, on the class.

Why: the API and the CLI decide what a failure means by its type (``http_status``, ``error_code``,
``exit_code``), never by reading its message. Every layer may import this module; it imports
nothing of ragline's. The concrete classes live where they are raised (``StepFailed`` in
``steps``, ``FilterError`` in ``resources.filters``, ...) and derive from the kinds below, keeping
their builtin bases (``ValueError``, ``RuntimeError``, ``OSError``) so existing handlers still apply.
"""
from __future__ import annotations

from typing import Any, ClassVar

EX_USAGE = 2  # a bad command line, file or value: fix the input
EX_TEMPFAIL = 75  # sysexits: try again later


class RaglineError(Exception):
    """Base of every error ragline raises on purpose. A 500 with this class's defaults means
    "ours, details in the log": the API answers without the message."""

    http_status: ClassVar[int] = 500
    error_code: ClassVar[str] = "internal_error"
    error_type: ClassVar[str | None] = None  # the API's ``type``; None: server_error or invalid_request_error
    exit_code: ClassVar[int] = 1
    field: str | None = None  # the request field or setting at fault, when there is one

    def client_message(self) -> str:
        """What a client is told (before redaction): the message, naming the field when one is at fault."""
        return str(self)

    def api_type(self) -> str:
        return self.error_type or ("server_error" if self.http_status >= 500 else "invalid_request_error")

    def __reduce__(self) -> Any:
        """Pickle (Prefect and cluster workers send errors between processes) by the message and
        attributes, whatever ``__init__`` takes; the cause stays behind, as for any exception."""
        return _restore, (type(self), self.args, dict(self.__dict__))


def _restore(cls: type[RaglineError], args: tuple, state: dict[str, Any]) -> RaglineError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(RaglineError):
    """A pipelines file, setting or server option that cannot work as given; names the file,
    line and field when they are known."""

    error_code = "invalid_configuration"
    exit_code = EX_USAGE

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.file, self.line, self.field = file, line, field


class MissingResource(ConfigError, ValueError):
    """A step whose settings need a resource its ``uses`` does not give it (mode 'llm' without an
    LLM, keyword counts without a BM25 index): the pipelines file's to fix, found when the step runs.
    A ValueError too, as these were before they were typed."""


class InputError(RaglineError, ValueError):
    """A request or query the pipeline cannot take: the client's to fix; ``field`` names it."""

    http_status = 422
    error_code = "invalid_value"
    exit_code = EX_USAGE

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        if field is not None:
            self.field = field


class DependencyUnavailable(RaglineError, RuntimeError):
    """A service ragline needs (the LLM, Chroma, Prefect) did not answer within its retry budget."""

    http_status = 503
    error_code = "dependency_unavailable"
    error_type = "service_unavailable_error"
    dependency: ClassVar[str] = "a dependency"

    def __init__(self, message: str, *, dependency: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        if dependency is not None:
            self.dependency = dependency  # type: ignore[misc]
        self.retry_after = retry_after


class IndexUnavailable(RaglineError, RuntimeError):
    """An index that cannot serve now: damaged, missing, or embedded by another model; the
    message names the store and the remedy."""

    http_status = 503
    error_code = "index_unavailable"
    error_type = "service_unavailable_error"


def exit_code_of(exc: BaseException) -> int:
    """The CLI's exit status for a failure: its class's, else 1."""
    return exc.exit_code if isinstance(exc, RaglineError) else 1
