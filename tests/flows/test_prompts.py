"""Prompt templates: StrictUndefined and a sandbox that refuses unsafe attribute access."""
from __future__ import annotations

import pytest
from jinja2 import UndefinedError
from jinja2.exceptions import SecurityError

from flows.prompts import PromptLibrary


def library(tmp_path, **templates):
    for name, body in templates.items():
        (tmp_path / f"{name}.j2").write_text(body)
    return PromptLibrary(tmp_path)


def test_render_and_names(tmp_path):
    lib = library(tmp_path, ask="Question: {{ question }}\n")
    assert lib.render("ask", question="why?") == "Question: why?" and lib.names() == ["ask"]


def test_missing_variable_is_an_error(tmp_path):
    with pytest.raises(UndefinedError, match="question"):
        library(tmp_path, ask="Q: {{ question }}").render("ask")


def test_sandbox_blocks_dunder_access(tmp_path):
    lib = library(tmp_path, evil="{{ x.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        lib.render("evil", x="")


def test_check_reports_missing_and_broken(tmp_path):
    lib = library(tmp_path, broken="{% if x %}")
    assert "not found" in lib.check("absent")
    assert "line 1" in lib.check("broken")
    assert lib.check("absent") and library(tmp_path, ok="hi").check("ok") is None
