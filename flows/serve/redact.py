"""Paths never shown: what a client of the API may see of a message (errors, run states) with
the pipelines file, the data folder and any path outside the source roots replaced."""
from __future__ import annotations

import os
import re
from typing import Any

from ragline.flows.serve.layout import data_dir_of, results_dir
from ragline.flows.spec.compile import Project


class Redactor:
    """Replaces the pipelines file, the data dir (indexes, results) and any absolute path outside
    the configured source roots in a message."""

    PATH = re.compile(r"(?<![\w.~/])/(?!/)(?:[^\s'\"`,;:()\[\]{}<>]+)")  # not the //host of a URL

    def __init__(self, project: Project):
        self.roots = sorted(_source_roots(project), key=len, reverse=True)
        hidden: dict[str, str] = {str(project.path): "<pipelines file>", str(results_dir(project)): "<results>"}
        data_dir = data_dir_of(project)
        for spec_name, spec in project.spec.resources.items():
            path = getattr(spec, "path", None)
            if path:
                located = (data_dir / path).resolve()
                hidden[str(located)] = f"<data dir>/{spec_name}"
                parent = located.parent
                if parent != data_dir and not self._protected(str(parent)):
                    hidden.setdefault(str(parent), "<data dir>")
        if project.data_dir is not None or not self._protected(str(data_dir)):
            hidden.setdefault(str(data_dir), "<data dir>")
        self.hidden = sorted(hidden.items(), key=lambda item: len(item[0]), reverse=True)

    def _protected(self, path: str) -> bool:
        """Whether ``path`` is a source root or holds one (replacing it would mangle source paths)."""
        return any(root == path or root.startswith(path.rstrip("/") + "/") for root in self.roots)

    def _allowed(self, path: str) -> bool:
        return any(path == root or path.startswith((root.rstrip("/") + "/", root + "#")) for root in self.roots)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for path, label in self.hidden:
            text = text.replace(path, label)
        return self.PATH.sub(lambda m: m.group(0) if self._allowed(m.group(0)) else "<path>", text)

    def answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """An Answer's JSON as a client sees it: its reason (which may quote an error), its sources'
        and its evidence's names redacted; passage and answer text untouched (the evidence's
        offsets point into the passages)."""
        shown = {**answer, "reason": self(answer.get("reason")), "sources": self.sources(answer.get("sources"))}
        if isinstance(answer.get("evidence"), dict):
            shown["evidence"] = self.evidence(answer["evidence"])
        return shown

    def evidence(self, evidence: dict[str, Any]) -> dict[str, Any]:
        """An EvidenceAnswer's JSON with the same redaction as the answer's sources."""
        spans = [{**span, **self._names(span, ("chunk_id", "source_id"))} for span in evidence.get("spans") or []]
        return {**evidence, "reason": self(evidence.get("reason")), "sources": self.sources(evidence.get("sources")),
                "spans": spans}

    def sources(self, sources: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """Cited sources with any server path in their ids, title, path or member documents replaced."""
        return [{**s, **self._names(s, SOURCE_NAMES),
                 "documents": [self(d) for d in s.get("documents") or []]} for s in sources or []]

    def _names(self, item: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        return {name: self(item[name]) for name in fields if isinstance(item.get(name), str)}


SOURCE_NAMES = ("chunk_id", "source_id", "title", "path")


def _source_roots(project: Project) -> list[str]:
    """Absolute source roots of every ingestion pipeline (a glob's fixed prefix), as ``load``
    resolves them: relative to the pipelines file's folder."""
    roots: list[str] = []
    for pipeline in project.pipelines.values():
        for step in pipeline.steps:
            if step.stage.inputs or step.stage.produces != "documents":
                continue
            for given in getattr(step.params, "paths", None) or []:
                expanded = os.path.abspath(os.path.join(str(project.base_dir), os.path.expanduser(str(given))))
                fixed = re.split(r"[*?\[]", expanded, maxsplit=1)[0]
                roots.append(fixed.rstrip("/") if fixed != expanded else expanded)
    return [r for r in roots if r]
