"""Plugin types from entry points: one check for every registry of classes named in pipelines.yaml
(resources, sources), so a type registered under the wrong name fails the same clear way in each."""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import TypeVar

T = TypeVar("T")


def registered_types(group: str, base: type[T], what: str) -> dict[str, type[T]]:
    """Every class registered in ``group`` by its ``type:`` name. Each must subclass ``base`` and
    be registered under the name its spec's ``type`` literal says (``type_name()``); the first
    registration of a name wins. Raises when the group is empty: ragline's own entry points are
    missing, which means the package was not installed (``pip install -e .``)."""
    found: dict[str, type[T]] = {}
    for entry in entry_points(group=group):
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"entry point {entry.name} = {entry.value} ({group}) is not a {base.__name__} subclass")
        if cls.type_name() != entry.name:
            raise TypeError(f"entry point {entry.name} = {entry.value} ({group}) names a {what} whose spec says "
                            f"type '{cls.type_name()}': use that name for the entry point")
        found.setdefault(entry.name, cls)
    if not found:
        raise RuntimeError(f"no {what} types are registered in the entry-point group {group}: reinstall ragline "
                           f"(pip install -e .) so its entry points are recorded")
    return found
