"""pipelines.yaml: parsing with line numbers, pydantic models, and whole-file validation.

Every problem becomes a ``SpecError`` naming file, line, pipeline, step and field, and all of
them are collected before anything runs (``validate_file``), so a user fixes a file in one pass:
an entry with structural errors is kept without its invalid fields (``_invalid``), so the stage,
parameter and prompt checks still run on the rest of it.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from croniter import croniter
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from ragline.flows.contracts import PipelineKind
from ragline.flows.errors import ConfigError
from ragline.flows.spec.registry import MODULE_PATTERN
from ragline.flows.resources import ResourceSpec, resource_types

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class SpecError:
    """One problem in a pipelines file, located as precisely as the YAML allows."""

    file: str
    line: int | None
    message: str
    pipeline: str | None = None
    step: str | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = [f"{self.file}:{self.line}" if self.line else self.file]
        if self.pipeline:
            where.append(f"pipeline '{self.pipeline}'")
        if self.step:
            where.append(f"step '{self.step}'")
        if self.field:
            where.append(f"field '{self.field}'")
        return ", ".join(where) + f": {self.message}"


class SpecValidationError(ConfigError):
    """Raised with every error found in a pipelines file (``file``, ``line``, ``field``: the first's)."""

    def __init__(self, errors: list[SpecError]):
        first = errors[0] if errors else None
        super().__init__("\n".join(str(e) for e in errors), file=first and first.file,
                         line=first and first.line, field=first and first.field)
        self.errors = errors


def suggest(name: str, choices: list[str]) -> str:
    """' (did you mean 'x'?)' for the nearest valid name, or ''."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ----------------------------------------------------------------------------- models
class ScheduleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cron: str | None = Field(None, description="cron expression, e.g. '0 * * * *'")
    interval_seconds: float | None = Field(None, gt=0, description="run every N seconds")
    timezone: str = Field("UTC", description="IANA time zone of the cron expression")

    # Checked here, so `ragline validate` reports them with their line; Prefect would only refuse
    # them when `ragline serve` registers the deployment.
    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        problem = cron_problem(value) if value is not None else None
        if problem:
            raise ValueError(f"invalid cron expression: {problem}")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        if value not in _timezones():
            raise ValueError(f"unknown time zone{suggest(value, sorted(_timezones()))}: use an IANA name such as "
                             f"'Europe/Berlin' or 'UTC'")
        return value


_CRON_MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# minute hour day-of-month month day-of-week [second [year]], named in messages: (name, lowest, highest)
_CRON_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7),
                ("second", 0, 59), ("year", 1970, 2099))


def cron_problem(expression: str) -> str | None:
    """What is wrong with a cron expression, or None. croniter decides (Prefect vendors the same
    parser, so this accepts what ``ragline serve`` can register, without importing Prefect); this
    only names the field and item it refuses."""
    if _prefect_accepts(expression):
        return None
    fields = expression.split()
    if not 5 <= len(fields) <= 7:
        return (f"{expression!r} has {len(fields)} fields; expected 5 (minute hour day-of-month month "
                f"day-of-week), e.g. '0 * * * *', or one of {', '.join(_CRON_MACROS)}")
    for i, (text, (name, low, high)) in enumerate(zip(fields, _CRON_FIELDS)):
        for item in text.split(","):
            if not item or not _prefect_accepts(" ".join(item if j == i else "*" for j in range(len(fields)))):
                return f"{item!r} is not a valid {name} (from {low} to {high}) in {expression!r}"
    return f"{expression!r} is not a valid cron expression"


def _prefect_accepts(expression: str) -> bool:
    """Prefect's own rule: what croniter parses, except its random and hashed fields (R, H)."""
    return croniter.is_valid(expression) and not any(f.casefold() in ("r", "h") for f in expression.split())


@lru_cache(maxsize=1)
def _timezones() -> frozenset[str]:
    """The IANA names Prefect accepts (it checks against the same list)."""
    import zoneinfo

    return frozenset(zoneinfo.available_timezones())


class WhenSpec(BaseModel):
    """A step's condition: it runs when an earlier ``classify`` step's label is (``label``) or is not
    (``not_label``) one of the values given; otherwise it is skipped (``flows.run.steps``). Declarative
    on purpose, never an expression: the checker knows every label a step can give, so it reports a
    misspelt label, proves alternative branches exclusive, and nothing in a YAML file is evaluated."""

    model_config = ConfigDict(extra="forbid")

    step: str = Field(min_length=1, description="the classify step whose label decides (it runs before this one)")
    label: list[str] | None = Field(None, min_length=1, description="run when the label is one of these")
    not_label: list[str] | None = Field(None, min_length=1, description="run when the label is none of these")

    @field_validator("label", "not_label", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_test(self) -> "WhenSpec":
        if (self.label is None) == (self.not_label is None):
            raise ValueError("give one of 'label' or 'not_label', e.g. {step: route, label: [retrieve]}")
        return self

    def allowed(self, labels: list[str]) -> set[str]:
        """The labels, out of all ``labels`` the step can give, under which the condition holds."""
        return set(self.label) if self.label is not None else set(labels) - set(self.not_label or [])

    def holds(self, label: str | None) -> bool:
        if label is None:
            return False
        return label in self.label if self.label is not None else label not in (self.not_label or [])

    def describe(self) -> str:
        values = self.label if self.label is not None else self.not_label
        return f"{self.step}.label {'in' if self.label is not None else 'not in'} [{', '.join(values or [])}]"


class StepSpec(BaseModel):
    """One step: a registered task with its parameters, resources, prompt and dependencies."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    task: str = Field(min_length=1)
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    uses: list[str] | dict[str, str] = Field(default_factory=list,
                                             description="resources by name, or {role: resource}")
    after: list[str] | None = Field(None, description="ids of the steps this one waits for")
    prompt: str | None = Field(None, description="prompt template name in prompts/ (without .j2)")
    retries: int = Field(0, ge=0, le=20)
    retry_delay_seconds: float = Field(1.0, ge=0)
    timeout_seconds: float | None = Field(None, gt=0)
    when: WhenSpec | None = Field(None, description="run only when an earlier classify step's label fits; "
                                                     "otherwise skipped")
    _invalid: set[str] = PrivateAttr(default_factory=set)  # fields left out for errors reported already

    @field_validator("after", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("uses", mode="before")
    @classmethod
    def _names_or_roles(cls, value: Any) -> Any:
        """One clear error for a value that fits neither form (not one per form of the union)."""
        names = isinstance(value, list) and all(isinstance(v, str) for v in value)
        roles = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        if not (names or roles):
            raise ValueError("must be a list of resource names, e.g. [store, embedder], or a mapping of roles to "
                             "resource names, e.g. {store: docs_store}")
        return value


class RunnerSpec(BaseModel):
    """Where an ingestion pipeline's steps run. Load, convert, chunk and embed go to the runner;
    the index sink (plan, batch writes, finalize) always stays in the process that runs the flow."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["thread", "dask", "ray"] = Field(
        "thread", description="thread: Prefect's thread pool in the flow's process; dask: prefect-dask "
                              "(pip install 'ragline[dask]'); ray: prefect-ray (pip install 'ragline[ray]')")
    address: str | None = Field(
        None, min_length=1, description="an existing cluster: a Dask scheduler ('tcp://host:8786') or a Ray "
                                        "cluster ('ray://host:10001', 'auto'); unset: a local cluster per run")
    n_workers: int | None = Field(None, ge=1, le=1024,
                                  description="local cluster: Dask worker processes, or the local Ray's CPUs")
    threads_per_worker: int | None = Field(None, ge=1, le=256, description="local Dask cluster: threads per worker")
    processes: bool | None = Field(None, description="local Dask cluster: workers are processes (default) or "
                                                     "threads of the flow's process")

    @field_validator("address", "n_workers")
    @classmethod
    def _cluster_only(cls, value: Any, info) -> Any:
        if info.data.get("type") == "thread":
            raise ValueError(f"'{info.field_name}' applies to a dask or ray runner, not 'thread'")
        if info.field_name == "n_workers" and info.data.get("address"):
            raise ValueError("'n_workers' configures a local cluster; the runner names an existing one ('address')")
        return value

    @field_validator("threads_per_worker", "processes")
    @classmethod
    def _local_dask_only(cls, value: Any, info) -> Any:
        if info.data.get("type") in ("thread", "ray"):
            raise ValueError(f"'{info.field_name}' applies to a dask runner only")
        if info.data.get("address"):
            raise ValueError(f"'{info.field_name}' configures a local cluster; the runner names an existing one "
                             f"('address')")
        return value


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: PipelineKind = Field(
        description="ingestion: writes the index; query: answers a request; job: no inputs, reads the index and "
                    "writes something else (e.g. `tune`), runnable and schedulable like an ingestion")
    description: str = ""
    schedule: ScheduleSpec | None = None
    batch_size: int = Field(256, ge=1, le=100_000, description="documents per ingestion batch")
    output: str | None = Field(None, description="step whose output is the result (default: last)")
    steps: list[StepSpec] = Field(min_length=1)
    runner: RunnerSpec = Field(default_factory=RunnerSpec,
                               description="task runner of an ingestion pipeline: thread (default), dask or ray")
    _invalid: set[str] = PrivateAttr(default_factory=set)  # non-empty: salvaged, checked but never compiled

    @field_validator("runner")
    @classmethod
    def _runner_fits_kind(cls, value: RunnerSpec, info) -> RunnerSpec:
        if info.data.get("kind") in ("query", "job") and value.type != "thread":
            raise ValueError(f"a {info.data['kind']} pipeline runs in the caller's process: runner '{value.type}' is for "
                             f"ingestion pipelines only (use type: thread, or leave 'runner' out)")
        return value


class ProjectSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts_dir: str = Field("prompts", description="folder of Jinja2 templates, relative to this file")
    deployment_prefix: str = Field("", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62})?$",
                                   description="prefix of this file's Prefect deployment names (ragline/<prefix>"
                                               "<pipeline>): each file served on one Prefect server needs its own")
    allow_modules: list[Annotated[str, Field(pattern=MODULE_PATTERN)]] | None = Field(
        None, description="narrows the external allowlist (RAGLINE_ALLOW_MODULES ...) for this file; never widens it")


COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{1,61}[A-Za-z0-9]$"  # also a valid Chroma collection name


class CollectionSpec(BaseModel):
    """One named collection (knowledge base): the ingestion template compiled over its own sources,
    schedule and index (``flows.spec.collections``)."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    template: str | None = Field(None, description="the ingestion pipeline compiled for this collection "
                                                   "(default: the file's only ingestion pipeline)")
    paths: list[Any] | None = Field(None, min_length=1, description="the template's source step `paths` "
                                                                    "(default: the template's own)")
    schedule: ScheduleSpec | None = Field(None, description="default: the template's schedule")
    resources: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="fields of the index resources to change, by the template's resource "
                                          "name, e.g. {sparse: {k1: 1.2}}")
    steps: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="parameters of the template's steps to change, by step id, e.g. "
                                          "{chunk: {overlap: 64}}")


class PipelinesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    settings: ProjectSettings = Field(default_factory=ProjectSettings)
    resources: dict[str, ResourceSpec] = Field(default_factory=dict)
    pipelines: dict[str, PipelineSpec] = Field(default_factory=dict)
    collections: dict[str, CollectionSpec] = Field(
        default_factory=dict, description="named collections, each its own index written by the ingestion "
                                          "template compiled as '<template>@<name>'")
    _invalid_resources: set[str] = PrivateAttr(default_factory=set)  # defined, but with errors


# ----------------------------------------------------------------------------- YAML with lines
class LocatedYaml:
    """A parsed YAML document plus the line of every mapping key and sequence item."""

    MAX_VALUES = 20_000  # a pipelines file holds hundreds; aliases of aliases can multiply them without end

    def __init__(self, text: str, file: str):
        self.file = file
        self.lines: dict[Loc, int] = {}
        self.problems: list[tuple[Loc, str]] = []  # values that are not YAML errors but still wrong
        self._open: set[int] = set()  # the collections being built: an alias to one of them is a cycle
        self._values = 0
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        self.data = self._build(node, ()) if node is not None else None

    def _build(self, node: yaml.Node, loc: Loc) -> Any:
        self._values += 1
        if self._values > self.MAX_VALUES:
            raise yaml.MarkedYAMLError(problem=f"the file expands to more than {self.MAX_VALUES} values (aliases "
                                               f"that repeat aliases?)", problem_mark=node.start_mark)
        self.lines.setdefault(loc, node.start_mark.line + 1)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if id(node) in self._open:
                raise yaml.MarkedYAMLError(problem="an alias refers to a collection that contains it (a recursive "
                                                   "alias)", problem_mark=node.start_mark)
            self._open.add(id(node))
            try:
                return self._collection(node, loc)
            finally:
                self._open.discard(id(node))
        value = yaml.SafeLoader("").construct_object(node, deep=True)
        try:
            return expand_env(value) if isinstance(value, str) else value
        except LookupError as exc:  # reported with its field by parse_file; the rest is still checked
            self.problems.append((loc, exc.args[0]))
            return value

    def _collection(self, node: yaml.MappingNode | yaml.SequenceNode, loc: Loc) -> Any:
        if isinstance(node, yaml.SequenceNode):
            return [self._build(item, loc + (i,)) for i, item in enumerate(node.value)]
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = yaml.SafeLoader(key_node.value).construct_object(key_node) \
                if not isinstance(key_node, yaml.ScalarNode) else key_node.value
            if key in out:
                raise yaml.MarkedYAMLError(problem=f"duplicate key '{key}'", problem_mark=key_node.start_mark)
            self.lines[loc + (key,)] = key_node.start_mark.line + 1
            out[key] = self._build(value_node, loc + (key,))
        return out

    def line(self, loc: Loc) -> int | None:
        """Line of the deepest known prefix of ``loc``."""
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.lines:
                return self.lines[loc[:end]]
        return None


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str) -> str:
    """${NAME} and ${NAME:-default} in string values, as in shell and Compose files."""
    def replace(match: re.Match) -> str:
        value = os.environ.get(match.group(1))
        if value is None and match.group(2) is None:
            raise LookupError(f"environment variable {match.group(1)} is not set and has no default")
        return value if value is not None else match.group(2)

    return _ENV.sub(replace, text)


def _read_yaml(path: Path, source: Path | None = None) -> tuple[LocatedYaml | None, list[SpecError]]:
    try:
        data = (source or path).read_bytes()
    except OSError as exc:
        return None, [SpecError(str(path), None, f"cannot read file: {exc.strerror or exc}")]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [SpecError(str(path), data.count(b"\n", 0, exc.start) + 1, f"not valid UTF-8: cannot decode "
                                f"byte 0x{data[exc.start]:02x} (save the file as UTF-8)")]
    try:
        doc = LocatedYaml(text, str(path))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        message = f"invalid YAML: {exc.problem or exc}"
        if "'\\t'" in str(exc.problem) and mark is not None:  # "found character '\t' that cannot start any token"
            message = f"invalid YAML: a tab at column {mark.column + 1}; YAML indents with spaces, never tabs"
        elif exc.context_mark is not None and exc.context_mark.line + 1 != line:
            message += f" ({exc.context} started at line {exc.context_mark.line + 1})"
        return None, [SpecError(str(path), line, message)]
    except yaml.reader.ReaderError as exc:  # a NUL or other control character: no mark, only a position
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return None, [SpecError(str(path), text.count("\n", 0, exc.position) + 1,
                                f"invalid YAML: control character #x{code:04x} is not allowed in a YAML file")]
    except yaml.YAMLError as exc:
        return None, [SpecError(str(path), None, f"invalid YAML: {exc}")]
    if not isinstance(doc.data, dict):
        return None, [SpecError(str(path), 1, "the file must be a mapping with 'resources' and 'pipelines'")]
    return doc, []


def _locate(doc: LocatedYaml, loc: Loc, message: str) -> SpecError:
    """Turn a location inside the file into an error naming pipeline, step and field."""
    pipeline = step = None
    field = ".".join(str(p) for p in loc[1:]) if loc else None
    data: Any = doc.data
    if len(loc) >= 2 and loc[0] == "pipelines":
        pipeline = str(loc[1])
        field = ".".join(str(p) for p in loc[2:]) or None
        if len(loc) >= 4 and loc[2] == "steps" and isinstance(loc[3], int):
            steps = (data.get("pipelines", {}).get(pipeline) or {}).get("steps") or []
            item = steps[loc[3]] if loc[3] < len(steps) else None
            step = str(item.get("id")) if isinstance(item, dict) and item.get("id") else f"#{loc[3] + 1}"
            field = ".".join(str(p) for p in loc[4:]) or None
    elif len(loc) >= 2 and loc[0] in ("resources", "settings", "collections"):
        field = ".".join(str(p) for p in loc)
    return SpecError(doc.file, doc.line(loc), message, pipeline, step, field)


def _structure_errors(doc: LocatedYaml, exc: ValidationError, prefix: Loc = ()) -> list[SpecError]:
    errors = []
    for err in exc.errors():
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and p in _UNION_TAGS))
        loc = tuple("with" if p == "with_" else p for p in loc)
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = f"unknown field '{loc[-1]}'"
        elif err["type"] == "union_tag_invalid":
            message = f"unknown resource type '{err['ctx']['tag']}'; valid types: {err['ctx']['expected_tags']}"
        elif err["type"] != "missing" and isinstance(err.get("input"), (str, int, float, bool)) \
                and not _SECRET_FIELD.search(str(loc[-1]) if loc else ""):  # an api_key: 12345 is not echoed
            message += f" (got {err['input']!r})"
        errors.append(_locate(doc, loc, message))
    return errors


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^@/\s]*@")
_UNION_TAGS: set[str] = set()  # filled by flows.resources with its discriminator tags
_SECRET_FIELD = re.compile(r"^(?:key|token)$|(?:^|_)(?:api_?key|secret|password|access_token|auth_token)$",
                           re.I)  # fields whose values are never shown in errors


def parse_file(path: str | Path, source: str | Path | None = None
               ) -> tuple[PipelinesFile | None, LocatedYaml | None, list[SpecError]]:
    """Parse and structurally validate each resource and pipeline on its own, so one bad entry
    does not hide the errors of the others; semantic checks are in ``flows.compile``. ``source``:
    read the text from there (a pinned copy), errors still name ``path``."""
    _UNION_TAGS.update(resource_types())
    path = Path(path)
    doc, errors = _read_yaml(path, Path(source) if source else None)
    if doc is None:
        return None, None, errors
    errors += [_locate(doc, loc, message) for loc, message in doc.problems]
    data = doc.data
    parts: dict[str, Any] = {}
    if "version" in data:
        parts["version"] = _validated(doc, TypeAdapter(int), data["version"], ("version",), errors, 1)
    if "settings" in data:
        parts["settings"] = _validated_settings(doc, data["settings"], errors)
    unknown = [k for k in data if k not in ("version", "settings", "resources", "pipelines", "collections")]
    errors += [_locate(doc, (k,), f"unknown top-level field '{k}'") for k in unknown]
    parts["resources"] = _valid_entries(doc, data, "resources", errors)
    parts["pipelines"] = _valid_entries(doc, data, "pipelines", errors)
    parts["collections"] = _valid_entries(doc, data, "collections", errors)
    try:
        spec = PipelinesFile.model_validate(parts)
    except ValidationError as exc:
        return None, doc, errors + _structure_errors(doc, exc)
    spec._invalid_resources = set(data.get("resources") or {}) - set(spec.resources)
    if not data.get("pipelines"):
        errors.append(_locate(doc, ("pipelines",), "the file defines no pipelines"))
    return spec, doc, errors


def _valid_entries(doc: LocatedYaml, data: dict[str, Any], key: str, errors: list[SpecError]) -> dict[str, Any]:
    """The entries of a mapping section that validate; the errors of the others are collected."""
    section = data.get(key)
    if section is None:
        return {}
    if not isinstance(section, dict):
        errors.append(_locate(doc, (key,), f"'{key}' must be a mapping of names to definitions"))
        return {}
    adapter = _entry_adapter(key)
    valid = {}
    for name, entry in section.items():
        if key == "collections" and not re.fullmatch(COLLECTION_PATTERN, str(name)):
            errors.append(_locate(doc, (key, name), f"collection name {name!r} must be 3-63 letters, digits, '_' "
                                                    f"or '-', starting and ending with a letter or digit (it names "
                                                    f"its Chroma collection)"))
            continue
        try:
            valid[name] = adapter.validate_python(entry)
        except ValidationError as exc:
            errors.extend(_structure_errors(doc, exc, prefix=(key, name)))
            salvaged = _salvage_pipeline(entry, exc) if key == "pipelines" else None
            if salvaged is not None:
                valid[name] = salvaged
    return valid


def _entry_adapter(key: str) -> TypeAdapter:
    return TypeAdapter({"resources": ResourceSpec, "collections": CollectionSpec}.get(key, PipelineSpec))


def _validated(doc: LocatedYaml, adapter: TypeAdapter, value: Any, loc: Loc, errors: list[SpecError],
               default: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        errors.extend(_structure_errors(doc, exc, prefix=loc))
        return default


def _validated_settings(doc: LocatedYaml, value: Any, errors: list[SpecError]) -> ProjectSettings:
    """The settings with each invalid field reported and left at its default, so one bad setting
    does not hide every pipeline's errors."""
    try:
        return ProjectSettings.model_validate(value)
    except ValidationError as exc:
        errors.extend(_structure_errors(doc, exc, prefix=("settings",)))
        valid = _without(value, _bad_fields(exc.errors())) if isinstance(value, dict) else {}
        try:
            return ProjectSettings.model_validate(valid)
        except ValidationError:
            return ProjectSettings()


# ----------------------------------------------------------------------------- salvage
def _bad_fields(errors: list[dict[str, Any]]) -> set[str]:
    """The top-level fields the errors are about ('with_' spelled as in the file)."""
    return {"with" if e["loc"][0] == "with_" else str(e["loc"][0]) for e in errors if e["loc"]}


def _without(data: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in fields}


def _salvage_pipeline(entry: Any, exc: ValidationError) -> PipelineSpec | None:
    """The pipeline without its invalid fields, so its steps are still checked in this pass; None
    when it has no list of steps. It is marked ``_invalid``: checked, never compiled."""
    if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list) or not entry["steps"]:
        return None
    errors = exc.errors()
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in errors:
        if len(e["loc"]) >= 2 and e["loc"][0] == "steps" and isinstance(e["loc"][1], int):
            by_step.setdefault(e["loc"][1], []).append({**e, "loc": e["loc"][2:]})
    steps = [_salvage_step(raw, i, by_step.get(i, [])) for i, raw in enumerate(entry["steps"])]
    kind = PipelineKind(entry["kind"]) if entry.get("kind") in tuple(PipelineKind) else None
    pipe = PipelineSpec.model_construct(kind=kind, steps=steps)
    pipe._invalid = _bad_fields(errors) or {"pipeline"}
    return pipe


def _salvage_step(raw: Any, index: int, errors: list[dict[str, Any]]) -> StepSpec:
    """A step without its invalid fields; ``_invalid`` names them so the checker skips what depends
    on them. A missing or invalid id becomes the one in the file, or '#n'."""
    if not isinstance(raw, dict):
        return _placeholder(f"#{index + 1}", {"task", "with", "uses", "prompt"})
    bad = _bad_fields(errors) | ({"task"} if "task" not in raw else set())
    clean = {**_without(raw, bad | {"id", "task"}), "id": "_", "task": "_" if "task" in bad else raw["task"]}
    try:
        step = StepSpec.model_validate(clean)
    except ValidationError:
        return _placeholder(_raw_id(raw, index), {"task", "with", "uses", "prompt"})
    step = step.model_copy(update={"id": _raw_id(raw, index)})
    step._invalid = bad
    return step


def _placeholder(step_id: str, invalid: set[str]) -> StepSpec:
    step = StepSpec.model_construct(id=step_id, task="", with_={}, uses=[], after=None, prompt=None)
    step._invalid = set(invalid)
    return step


def _raw_id(raw: dict[str, Any], index: int) -> str:
    value = raw.get("id")
    return str(value) if isinstance(value, (str, int, float)) and str(value) else f"#{index + 1}"


def locate(doc: LocatedYaml, loc: Loc, message: str) -> SpecError:
    return _locate(doc, loc, message)


def pydantic_message(err: dict[str, Any]) -> str:
    """A stage parameter's validation error in words, with the value that was given when it is a
    plain value and not a secret's (a mapping given whole may hold credentials: never echoed)."""
    if err["type"] == "extra_forbidden":
        return f"unknown parameter '{err['loc'][-1]}'"
    if err["type"] == "union_tag_invalid":
        return f"unknown type '{err['ctx']['tag']}'; valid types: {err['ctx']['expected_tags']}"
    value = err.get("input")
    if isinstance(value, (dict, list)) or (err["loc"] and _SECRET_FIELD.search(str(err["loc"][-1]))):
        return err["msg"]
    if isinstance(value, str):  # a URL's password ('sftp://user:pw@host') is blanked
        value = _URL_PASSWORD.sub(r"\1***@", value)
    return f"{err['msg']} (got {value!r})"
