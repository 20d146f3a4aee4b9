"""Jinja2 prompt templates from prompts/: sandboxed, StrictUndefined (a missing variable is an error).

Validation checks each template (and those it includes or imports) against the variables its
stage declares, so an undefined variable is reported by ``ragline validate``, not at ``ask`` time.
"""
from __future__ import annotations

import html
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from jinja2 import FileSystemLoader, StrictUndefined, TemplateNotFound, TemplateSyntaxError, UndefinedError, meta, \
    nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ragline.flows.errors import RaglineError
from ragline.flows.spec.parse import suggest

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ragline.flows.spec.registry import Stage

SUFFIX = ".j2"
BUILTIN = Path(str(resources.files("ragline.prompts"))).resolve()  # shipped with the package


class PromptUndefinedError(RaglineError, UndefinedError):
    """A variable missing while rendering, with the template and line that read it."""


class PromptLibrary:
    """Templates of one prompts folder; rendering never executes template-supplied code."""

    def __init__(self, folder: Path):
        self.folder = folder
        folders = [str(folder)] + ([str(BUILTIN)] if folder.resolve() != BUILTIN else [])
        # the project's folder first; the builtin templates fill in what it does not define
        self.env = ImmutableSandboxedEnvironment(loader=FileSystemLoader(folders), undefined=StrictUndefined,
                                                 autoescape=False, keep_trailing_newline=False,
                                                 trim_blocks=True, lstrip_blocks=True, finalize=_fenced)
        self.env.filters["fence"] = fence
        self.env.filters["attribute"] = attribute

    def names(self) -> list[str]:
        return sorted({name[: -len(SUFFIX)] for name in self.env.loader.list_templates() if name.endswith(SUFFIX)})

    def text(self, file: str) -> str | None:
        """A template file's source, from the project's folder or the builtins; None if neither has it."""
        try:
            return self.env.loader.get_source(self.env, file)[0]
        except TemplateNotFound:
            return None

    @property
    def where(self) -> str:
        return f"{self.folder}" + (" or the builtin prompts" if self.folder.resolve() != BUILTIN else "")

    def check(self, name: str) -> str | None:
        """None when the template exists and parses, else the reason it cannot be used."""
        try:
            self.env.get_template(name + SUFFIX)
        except TemplateNotFound:
            return f"prompt template '{name}{SUFFIX}' not found in {self.where}"
        except TemplateSyntaxError as exc:
            return f"prompt template '{name}{SUFFIX}' line {exc.lineno}: {exc.message}"
        return None

    def check_variables(self, name: str, provided: Iterable[str]) -> list[str]:
        """One problem per variable that the template, or one it includes, reads but that neither
        the stage (``provided``) nor the template itself defines."""
        provided = tuple(sorted(set(provided)))
        return list(self._undefined(name + SUFFIX, frozenset(provided) | set(self.env.globals), (), "", provided))

    def _undefined(self, file: str, available: frozenset[str], chain: tuple[str, ...], via: str,
                   provided: tuple[str, ...]) -> Iterator[str]:
        if file in chain:  # a recursive include: already being checked
            return
        where = f"prompt template '{file}'{via}"
        try:
            ast = self.env.parse(self.env.loader.get_source(self.env, file)[0], file)
        except TemplateNotFound:
            yield f"{where} not found in {self.where}"
            return
        except TemplateSyntaxError as exc:
            yield f"{where} line {exc.lineno}: {exc.message}"
            return
        for variable in sorted(meta.find_undeclared_variables(ast) - available):
            yield (f"{where} uses undefined variable '{variable}' on line {_first_read(ast, variable)} "
                   f"(the stage provides: {', '.join(provided) or 'nothing'})")
        bound = available | {n.name for n in ast.find_all(nodes.Name) if n.ctx in ("store", "param")}
        for target, shared, how in _referenced(ast):
            scope = bound if shared else frozenset(self.env.globals)
            yield from self._undefined(target, scope, chain + (file,), f" ({how} '{file}')", provided)

    def files(self, name: str) -> list[str]:
        """The template and every template it includes or imports (for fingerprints)."""
        found: list[str] = []
        pending = [name + SUFFIX]
        while pending:
            file = pending.pop()
            source = None if file in found else self.text(file)
            if source is None:
                continue
            found.append(file)
            ast = self.env.parse(source)
            pending.extend(target for target, _, _ in _referenced(ast))
        return found

    def source(self, name: str) -> str:
        return self.text(name + SUFFIX) or ""

    def render(self, name: str, **variables: Any) -> str:
        try:
            return self.env.get_template(name + SUFFIX).render(**variables).strip()
        except UndefinedError as exc:
            file, line = _template_frame(exc.__traceback__, self.folder, name + SUFFIX)
            where = f"prompt template '{file}'" + (f" line {line}" if line else "")
            via = f" (rendering '{name}{SUFFIX}')" if file != name + SUFFIX else ""
            raise PromptUndefinedError(f"{where}{via}: {exc.message}; "
                                       f"variables given: {', '.join(sorted(variables)) or 'none'}") from exc


def _referenced(ast: nodes.Template) -> Iterator[tuple[str, bool, str]]:
    """(template, whether it sees the caller's variables, how it is used) for each extends, include
    or import with a constant name (Jinja's rule: imports see them only ``with context``)."""
    for node in ast.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        if isinstance(node.template, nodes.Const) and isinstance(node.template.value, str):
            if isinstance(node, (nodes.Extends, nodes.Include)):
                yield node.template.value, True, "extended by" if isinstance(node, nodes.Extends) else "included from"
            else:
                shared = bool(node.with_context)
                yield node.template.value, shared, "imported by" if shared else "imported without context by"


def _first_read(ast: nodes.Template, variable: str) -> int | None:
    return next((n.lineno for n in ast.find_all(nodes.Name) if n.name == variable and n.ctx == "load"), None)


def _template_frame(tb: TracebackType | None, folder: Path, default: str) -> tuple[str, int | None]:
    """The innermost template file and line in a rendering traceback (Jinja maps frames to them)."""
    file, line = default, None
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if path.suffix == SUFFIX:
            file, line = _relative(path, folder), tb.tb_lineno
        tb = tb.tb_next
    return file, line


def _relative(path: Path, folder: Path) -> str:
    try:
        return path.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        return path.name


# What a model could read as one of the prompts' delimiters: an angle bracket or a look-alike,
# blanks or invisible characters, an optional slash, the name in any case (``< / Document\t>``).
_INVISIBLE = "\\s\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff"
DELIMITER = re.compile(f"[<\uff1c\ufe64][{_INVISIBLE}]*[/\uff0f]?[{_INVISIBLE}]*"
                       f"(?:document|references|examples?|conversation|turn)(?![a-z])",
                       re.IGNORECASE)
_ATTRIBUTE_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def fence(text: object) -> str:
    """Keep retrieved (or asked) text inside its <document> delimiters: any spelling of one of
    them in it has its bracket written ``&lt;``, so it can neither open nor close one."""
    return DELIMITER.sub(lambda m: "&lt;" + m.group(0)[1:], str(text))


def attribute(value: object) -> str:
    """A value for a quoted attribute of a delimiter tag (``title="..."``): quotes and brackets
    escaped, line breaks made spaces, so it cannot end its quotes or its tag."""
    return html.escape(_ATTRIBUTE_BREAKS.sub(" ", str(value)), quote=True)


def _fenced(value: object) -> object:
    """Every ``{{ }}`` output is fenced, also in a project's own templates that forget ``| fence``."""
    return value if value is None or isinstance(value, (int, float)) else fence(value)


@lru_cache(maxsize=16)
def library(folder: str) -> PromptLibrary:
    return PromptLibrary(Path(folder))


def prompt_problems(prompts: PromptLibrary, stage: "Stage", params: "BaseModel | None", name: str | None) -> list[str]:
    """What is wrong with the templates a step renders: its own (``name``) and the fixed ones the
    stage also renders, each missing, broken, or reading a variable the stage does not pass."""
    return [problem for _, problem in template_problems(prompts, stage, params, name)]


def template_problems(prompts: PromptLibrary, stage: "Stage", params: "BaseModel | None",
                      name: str | None) -> list[tuple[str, str]]:
    """``prompt_problems`` as (template, problem), so a template a parameter names is located there."""
    templates = [(name, stage.variables(params) if params is not None else None)] if name else []
    if params is not None:
        templates += sorted(stage.extra_prompts(params).items())
    problems = []
    for template, variables in templates:
        problem = prompts.check(template)
        if problem:
            missing = prompts.text(template + SUFFIX) is None  # a broken template needs no other name
            problems.append((template, problem + (suggest(template, prompts.names()) if missing else "")))
        elif variables is not None:
            problems += [(template, p) for p in prompts.check_variables(template, variables)]
    return problems
