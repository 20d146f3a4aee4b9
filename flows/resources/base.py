"""What every resource type is: the ``Resource`` base, its ``Health``, and the lazy-load helper.

A resource type is one module holding a pydantic settings model (its ``type:`` literal is the
name used in pipelines.yaml) and a ``Resource`` subclass, registered by one entry point in the
``ragline.resources`` group. The engine asks the type, never a list of type names: whether it
lives under the data folder (``located``), what of its settings shapes indexed content
(``fingerprint_fields``), how to get it ready before the first query (``warm_up``), whether it
can serve (``health``) and how to let it go (``close``).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Generic, Literal, TypeVar, get_args

from pydantic import BaseModel, Field

T = TypeVar("T")
_UNSET: Any = object()


class Health(BaseModel):
    """One resource's answer to "can you serve?". ``degraded``: it serves, not at full speed or
    not with everything (a model not loaded yet, an index never built); only ``down`` makes the
    API unready."""

    status: Literal["up", "degraded", "down"]
    error: str | None = Field(None, description="why it is not up, in one line")
    detail: dict[str, Any] = Field(default_factory=dict, description="what was checked (counts, endpoint)")

    @classmethod
    def up(cls, **detail: Any) -> Health:
        return cls(status="up", detail=detail)

    @classmethod
    def degraded(cls, error: str, **detail: Any) -> Health:
        return cls(status="degraded", error=error, detail=detail)

    @classmethod
    def down(cls, error: str, **detail: Any) -> Health:
        return cls(status="down", error=error, detail=detail)


class Lazy(Generic[T]):
    """A value built on first use, once, under a lock; ``reset`` forgets it so the next use
    builds it again (after a fault, or at ``close``). ``None`` is a value like any other."""

    def __init__(self, build: Callable[[], T], lock: threading.Lock | threading.RLock | None = None):
        self._build = build
        self._value: Any = _UNSET
        self._lock = lock or threading.Lock()

    def get(self) -> T:
        value = self._value
        if value is _UNSET:
            with self._lock:
                if self._value is _UNSET:
                    self._value = self._build()
                value = self._value
        return value

    @property
    def loaded(self) -> bool:
        return self._value is not _UNSET

    def reset(self) -> T | None:
        """Forget the value; returns it (None if there was none) so the caller can close it."""
        with self._lock:
            value, self._value = self._value, _UNSET
        return None if value is _UNSET else value


class Resource(ABC):
    """A heavy shared object configured in pipelines.yaml: created once per process (cheaply; the
    heavy part loads on first use or at ``warm_up``) and shared by every stage that ``uses`` it."""

    Spec: ClassVar[type[BaseModel]]  # its settings; the ``type`` literal names it in pipelines.yaml
    located: ClassVar[bool] = False  # stored under the data folder: relocated with it, one instance per folder
    # libraries it imports to work, which ``ragline serve`` imports once before its flow runs fork
    # (flows/serve/supervise/warm.py) instead of in every run: names only, imported there, never used there
    preload: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: Any, base_dir: Path | None = None):
        self.spec = spec
        self.base_dir = base_dir or Path.cwd()

    @classmethod
    def type_name(cls) -> str:
        """The ``type:`` value of this resource in pipelines.yaml (its spec's literal)."""
        annotation = cls.Spec.model_fields["type"].annotation
        names = get_args(annotation)
        if len(names) != 1:
            raise TypeError(f"{cls.__qualname__}.Spec.type must be a Literal of one name, not {annotation}")
        return names[0]

    @classmethod
    def fingerprint_fields(cls, spec: Any) -> Any:
        """The settings that change indexed content (``flows.fingerprint``); by default all of them."""
        return spec.model_dump(mode="json")

    @classmethod
    def relocated(cls, spec: Any, name: str) -> Any:
        """The settings with the store moved under another data folder (``Project.relocated``):
        a relative ``path`` moves with the folder, an absolute one (or a server: ``host``)
        becomes ``<data folder>/<name>``. Unlocated types are returned unchanged."""
        if not cls.located:
            return spec
        fields = spec.model_dump()
        if Path(fields["path"]).is_absolute() or fields.get("host"):
            fields.update(path=name, **({"host": None} if "host" in fields else {}))
        return cls.Spec.model_validate(fields)

    @property
    def location(self) -> str:
        return self.type_name()

    @abstractmethod
    def warm_up(self) -> None:
        """Load what the first query would (models, connections, the published index), so it does
        not pay for it; creates nothing on disk. Raises what loading raises."""

    @abstractmethod
    def health(self, index_state: Any = None) -> Health:
        """Whether it can serve now, cheaply (a readiness probe asks it). ``index_state``: the
        ``IndexState`` a store's content must agree with, when the resource is part of an index."""

    def close(self) -> None:
        """Let go of what it holds (connections, models); a later use loads it again."""
