"""Jinja2 prompt templates from prompts/: sandboxed, StrictUndefined (a missing variable is an error)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import FileSystemLoader, StrictUndefined, TemplateNotFound, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

SUFFIX = ".j2"


class PromptLibrary:
    """Templates of one prompts folder; rendering never executes template-supplied code."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.env = ImmutableSandboxedEnvironment(loader=FileSystemLoader(str(folder)), undefined=StrictUndefined,
                                                 autoescape=False, keep_trailing_newline=False,
                                                 trim_blocks=True, lstrip_blocks=True)
        self.env.filters["fence"] = fence

    def names(self) -> list[str]:
        return sorted(p.name[: -len(SUFFIX)] for p in self.folder.glob(f"*{SUFFIX}")) if self.folder.is_dir() else []

    def check(self, name: str) -> str | None:
        """None when the template exists and parses, else the reason it cannot be used."""
        try:
            self.env.get_template(name + SUFFIX)
        except TemplateNotFound:
            return f"prompt template '{name}{SUFFIX}' not found in {self.folder}"
        except TemplateSyntaxError as exc:
            return f"prompt template '{name}{SUFFIX}' line {exc.lineno}: {exc.message}"
        return None

    def source(self, name: str) -> str:
        return (self.folder / (name + SUFFIX)).read_text(encoding="utf-8")

    def render(self, name: str, **variables: Any) -> str:
        return self.env.get_template(name + SUFFIX).render(**variables).strip()


def fence(text: object) -> str:
    """Keep retrieved text inside its <document> delimiters: it cannot open or close one itself."""
    return (str(text).replace("<document", "<\u200bdocument").replace("</document", "<\u200b/document")
            .replace("<references", "<\u200breferences").replace("</references", "<\u200b/references"))


@lru_cache(maxsize=16)
def library(folder: str) -> PromptLibrary:
    return PromptLibrary(Path(folder))
