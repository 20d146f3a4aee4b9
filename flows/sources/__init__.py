"""Sources: where ``load`` lists items and fetches their bytes (``local`` folders, ``fsspec`` URLs,
``web`` crawls), one module per type.

Each type is registered by one entry point in the ``ragline.sources`` group (``<type> =
"package.module:SourceClass"``), its pydantic spec's ``type`` literal being the name used in
pipelines.yaml; a root without ``type`` is ``local``. See ``base`` for the protocol.

Sits at the resources layer: may import the base modules only; ``tasks.load`` imports it.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Union

from pydantic import Discriminator, GetCoreSchemaHandler, Tag

from ragline.flows.plugins import registered_types
from ragline.flows.sources.base import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
    cache_folder,
)

GROUP = "ragline.sources"
__all__ = ["GROUP", "Fetched", "Item", "ItemCache", "Listing", "DocumentSource", "SourceError", "SourceSpec",
           "cache_folder", "source_types"]


@functools.cache
def source_types() -> dict[str, type[DocumentSource]]:
    """Every registered source type by its ``type:`` name, read from the entry points on first use."""
    found = registered_types(GROUP, DocumentSource, "source")
    if "local" not in found:
        raise RuntimeError(f"the built-in source type 'local' is not registered in {GROUP}: reinstall ragline "
                           f"(pip install -e .) so its entry points are recorded")
    return found


def _type_of(value: Any) -> str:
    """A root's type: its ``type`` field, ``local`` when it has none."""
    if isinstance(value, dict):
        return str(value.get("type", "local"))
    return str(getattr(value, "type", "local"))


class SourceSpec:
    """The settings of any registered source type, told apart by ``type`` (default ``local``)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        tagged = tuple(Annotated[t.Spec, Tag(name)] for name, t in source_types().items())
        union = Annotated[Union[tagged], Discriminator(_type_of)]  # type: ignore[valid-type]
        return handler.generate_schema(union)
