"""Resources: heavy shared objects (models, stores) configured in pipelines.yaml.

Each type is a ``Resource`` (``flows/resources/base.py``) registered in the ``ragline.resources``
entry-point group; each instance is created once per process (keyed by its configuration) and
shared by every stage that ``uses`` it; construction is cheap and the heavy part loads on first
use or at ``warm_up``. ``close_resources`` ends them all (process shutdown). By role: ``stores/``
(Chroma, Milvus, BM25, the index state, summaries, and what stores share: their role protocols,
filters, integrity) and ``models/`` (embedder, cross-encoder, tokenizer, the LLM client).

May import the base modules only (``contracts``, ``errors``, ``settings``, ``context``,
``failpoints``); every layer above may import it, stages included.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Iterable, Union

from pydantic import Field, GetCoreSchemaHandler

from ragline.flows.plugins import registered_types
from ragline.flows.resources.base import Health, Resource

log = logging.getLogger("ragline.resources")
GROUP = "ragline.resources"  # entry-point group: `<type> = "package.module:ResourceClass"`


@functools.cache
def resource_types() -> dict[str, type[Resource]]:
    """Every registered resource type by its pipelines.yaml ``type:`` name, read from the entry
    points on first use (not at import: a type's module imports ``resources.base``, which runs this
    package first)."""
    return registered_types(GROUP, Resource, "resource")


class ResourceSpec:
    """The settings of any registered resource type, told apart by ``type`` (a pydantic type: use
    it in a model or a ``TypeAdapter``). The union is built from the entry points when first used."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        specs = tuple(t.Spec for t in resource_types().values())
        return handler.generate_schema(Annotated[Union[specs], Field(discriminator="type")])  # type: ignore[valid-type]


_cache: dict[tuple[str, str, str], Resource] = {}
_lock = threading.Lock()


def resource_type(spec: Any) -> type[Resource]:
    """The registered type of a resource's settings."""
    return resource_types()[spec.type]


def get_resource(spec: Any, base_dir: Path) -> Any:
    """The process-wide instance for this configuration (created on first request). Models and
    clients are shared across data folders; located stores are per folder."""
    cls = resource_type(spec)
    key = (spec.type, spec.model_dump_json(), str(base_dir.resolve()) if cls.located else "")
    with _lock:
        if key not in _cache:
            _cache[key] = cls(spec, base_dir)
        return _cache[key]


def warm_up(resources: Iterable[tuple[str, Resource]]) -> dict[str, str]:
    """Warm each resource up; a failure is logged and returned (name -> error), never raised:
    readiness reports what is down, and the first query that needs it says why."""
    failed: dict[str, str] = {}
    for name, resource in resources:
        try:
            resource.warm_up()
        except Exception as exc:  # noqa: BLE001 - reported by /readyz and by the query that needs it
            failed[name] = f"{type(exc).__name__}: {exc}"
            log.warning("resource '%s' (%s) did not warm up: %s", name, resource.location, failed[name])
    return failed


def close_resources() -> None:
    """Close and forget every resource: the end of the process's use of them (API shutdown)."""
    with _lock:
        resources = list(_cache.values())
        _cache.clear()
    for resource in resources:
        try:
            resource.close()
        except Exception as exc:  # noqa: BLE001 - closing the others matters more
            log.warning("closing %s failed: %s: %s", resource.location, type(exc).__name__, exc)


def clear_cache() -> None:
    """Forget every resource, as a new process would see them (tests): closed, and Chroma's
    per-path systems dropped too."""
    close_resources()
    if "chromadb" in sys.modules:  # Chroma keeps one system per path; drop them too
        from chromadb.api.client import SharedSystemClient

        SharedSystemClient.clear_system_cache()


__all__ = ["GROUP", "Health", "Resource", "ResourceSpec", "clear_cache", "close_resources", "get_resource",
           "resource_type", "resource_types", "warm_up"]
