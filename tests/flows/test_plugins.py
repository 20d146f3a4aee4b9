"""Entry-point registries of pipelines.yaml types: a wrongly registered plugin fails with its name."""
from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from ragline.flows import plugins
from ragline.flows.resources.base import Resource
from ragline.flows.resources.models.embedder import Embedder


def _entry_points(monkeypatch, *entries: EntryPoint) -> None:
    monkeypatch.setattr(plugins, "entry_points", lambda group: [e for e in entries if e.group == group])


def test_types_are_found_by_their_spec_name(monkeypatch):
    _entry_points(monkeypatch, EntryPoint("sentence_transformer", "ragline.flows.resources.models.embedder:Embedder",
                                          "test.group"))
    assert plugins.registered_types("test.group", Resource, "resource") == {"sentence_transformer": Embedder}


def test_a_type_registered_under_another_name_is_refused_naming_both(monkeypatch):
    _entry_points(monkeypatch, EntryPoint("embedder", "ragline.flows.resources.models.embedder:Embedder", "test.group"))
    with pytest.raises(TypeError, match="embedder = .*says type 'sentence_transformer'"):
        plugins.registered_types("test.group", Resource, "resource")


def test_a_class_of_another_kind_is_refused(monkeypatch):
    _entry_points(monkeypatch, EntryPoint("path", "pathlib:Path", "test.group"))
    with pytest.raises(TypeError, match=r"path = pathlib:Path \(test.group\) is not a Resource subclass"):
        plugins.registered_types("test.group", Resource, "resource")


def test_an_empty_group_says_to_reinstall(monkeypatch):
    _entry_points(monkeypatch)
    with pytest.raises(RuntimeError, match="no resource types .*pip install -e"):
        plugins.registered_types("test.group", Resource, "resource")
