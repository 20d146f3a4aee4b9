"""Request classification and routing: a label for the request (its type, topic or urgency), read
by later steps' ``when`` (pipelines.yaml) to take a branch, and optionally the collections it
searches (the guide's request classification; the book's "deciding when to retrieve").

Two modes. ``embedding``: the labelled examples (in the file, or a JSONL file of ``{"text",
"label"}`` lines) are embedded once per process with the pipeline's embedder; a request then costs
one query embedding and a dot product (nearest examples voting, or nearest label centroid); no
LLM. ``llm``: the LLM picks one of the declared labels (held to them by a JSON schema where the
server supports it, then parsed leniently); a reply naming no label falls back to ``default`` with
a warning, never a failed query. Either way the label is one of the declared ones, so every
``when`` on it is decided.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Label, Query
from ragline.flows.errors import ConfigError, MissingResource
from ragline.flows.files import json_lines
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, parse_json
from ragline.flows.spec.registry import stage

LABEL_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,39}$"


class LabelSpec(BaseModel):
    """One class of request."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field("", description="llm: what requests of this class are, shown to the LLM")
    examples: list[str] = Field(default_factory=list, description="embedding: requests of this class")
    collections: list[str] | None = Field(None, min_length=1, description="route requests of this class to these "
                                                                          "collections (narrows the query's own)")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["embedding", "llm"] = Field("embedding", description="embedding: nearest labelled examples with "
                                                                       "the embedder (no LLM); llm: the LLM picks")
    labels: dict[str, LabelSpec] = Field(..., min_length=2, description="the classes, by name")
    default: str | None = Field(None, description="the label when the classifier cannot decide (default: the "
                                                  "first label)")
    examples_file: str | None = Field(None, min_length=1, description="embedding: JSONL of {text, label} lines, "
                                                                      "relative to the project's folder, added "
                                                                      "to the labels' own examples")
    method: Literal["knn", "centroid"] = Field("knn", description="embedding: the k nearest examples vote "
                                                                  "(weighted by similarity), or the nearest "
                                                                  "label centroid")
    k: int = Field(5, ge=1, le=100, description="embedding, knn: examples that vote")
    min_similarity: float | None = Field(None, ge=-1, le=1, description="embedding: below this similarity to "
                                                                        "the winning label, the default")
    max_tokens: int = Field(16, ge=1, le=256, description="llm: length of the reply")
    max_request_chars: int = Field(1000, ge=50, description="llm: longer requests are clipped in the prompt")

    @model_validator(mode="after")
    def _consistent(self) -> "Params":
        bad = [name for name in self.labels if not re.fullmatch(LABEL_PATTERN, name)]
        if bad:
            raise ValueError(f"labels: {', '.join(map(repr, bad))}: a label is a letter then up to 39 letters, "
                             f"digits or '_'")
        if self.default is not None and self.default not in self.labels:
            raise ValueError(f"default {self.default!r} is not one of the labels ({', '.join(self.labels)})")
        if self.mode == "embedding" and self.examples_file is None:
            bare = [name for name, spec in self.labels.items() if not spec.examples]
            if bare:
                raise ValueError(f"mode 'embedding' needs examples for every label; none for "
                                 f"{', '.join(map(repr, bare))} (add `examples`, or an `examples_file`)")
        return self

    @property
    def fallback(self) -> str:
        return self.default or next(iter(self.labels))


def declared_labels(params: Params) -> list[str]:
    return list(params.labels)


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """Each mode reads one resource: the examples' embedder, or the LLM that picks (the other is left
    unbound, so a file with two of its type need not name one)."""
    if params.mode == "llm":
        return {"llm": ("mode", "mode 'llm' asks the LLM for the label")}
    return {"embedder": ("mode", "mode 'embedding' embeds the labels' examples and the request")}


@stage("classify", params=Params, produces="query", kind="query",
       uses={"embedder": ("sentence_transformer",), "llm": ("openai_compatible",)},
       prompt=lambda p: "classify" if p is not None and p.mode == "llm" else None,
       prompt_variables=("question", "labels", "default"), labels=declared_labels, reads_roles=reads_roles,
       routes=lambda p: {name: spec.collections for name, spec in p.labels.items() if spec.collections})
def classify(query: Query, params: Params, ctx: StepContext, embedder: Embedder | None = None,
             llm: LLMClient | None = None) -> Query:
    """Label the request (``Query.labels[step id]``) and, when its label routes to collections, narrow
    the collections it searches."""
    text = query.original or query.text
    if params.mode == "llm":
        if llm is None:
            raise MissingResource("mode 'llm' needs an openai_compatible resource: add one and name it in `uses`")
        label = by_llm(text, params, ctx, llm)
    else:
        if embedder is None:
            raise MissingResource("mode 'embedding' needs a sentence_transformer resource: add one and name it in `uses`")
        label = by_embedding(text, params, ctx, embedder)
    ctx.logger.info("classified as %r (%s)", label.label, label.mode)
    update: dict = {"labels": {**query.labels, ctx.step_id: label}}
    routed = params.labels[label.label].collections
    if routed is not None:
        update["collections"] = _narrowed(query.collections, routed, ctx)
    return query.model_copy(update=update)


def _narrowed(asked: list[str] | None, routed: list[str], ctx: StepContext) -> list[str] | None:
    """The label's collections within those the request asked for (never wider); when they share
    none, the request's own, with a warning."""
    known = list(getattr(ctx.project, "collections", {}) or {})
    unknown = [name for name in routed if known and name not in known]
    if unknown:
        raise ConfigError(f"step '{ctx.step_id}': routes to unknown collection{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))}; the file declares {', '.join(known)}",
                          field="with.labels.collections")
    if asked is None:
        return list(routed)
    kept = [name for name in routed if name in asked]
    if not kept:
        ctx.logger.warning("the label's collections %s are none of the request's %s; searching the request's",
                           routed, asked)
        return asked
    return kept


# ----------------------------------------------------------------------------- embedding
@dataclass(frozen=True)
class LabelBank:
    """The labelled examples, embedded: unit rows, each row's label index, and each label's centroid."""

    labels: list[str]
    vectors: np.ndarray
    owner: np.ndarray
    centroids: np.ndarray


_BANKS: weakref.WeakKeyDictionary[Embedder, dict[str, LabelBank]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def by_embedding(text: str, params: Params, ctx: StepContext, embedder: Embedder) -> Label:
    bank = bank_of(params, Path(ctx.base_dir), embedder)
    vector = _unit(embedder.encode_queries([text]))[0]
    index, score = nearest(bank, vector, params)
    if params.min_similarity is not None and score < params.min_similarity:
        return Label(label=params.fallback, score=score, mode="default")
    return Label(label=bank.labels[index], score=score, mode="embedding")


def nearest(bank: LabelBank, vector: np.ndarray, params: Params) -> tuple[int, float]:
    """The winning label's index and its similarity (the centroid's, or the best example's)."""
    if params.method == "centroid":
        scores = bank.centroids @ vector
        best = int(np.argmax(scores))
        return best, float(scores[best])
    scores = bank.vectors @ vector
    top = np.argsort(-scores, kind="stable")[: params.k]
    votes = np.zeros(len(bank.labels))
    np.add.at(votes, bank.owner[top], np.maximum(scores[top], 0.0))
    best = int(np.argmax(votes))
    return best, float(max(scores[i] for i in top if bank.owner[i] == best)) if votes[best] > 0 else 0.0


def bank_of(params: Params, base_dir: Path, embedder: Embedder) -> LabelBank:
    """The examples embedded once per embedder and configuration (again when the file changes)."""
    path = (base_dir / params.examples_file).resolve() if params.examples_file else None
    stamp = _stamp(path) if path is not None else None
    key = json.dumps([{n: s.examples for n, s in params.labels.items()}, str(path), stamp])
    with _LOCK:
        banks = _BANKS.setdefault(embedder, {})
        if key not in banks:
            examples = labelled_examples(params, path)
            labels = list(params.labels)
            vectors = _unit(embedder.encode_queries([t for t, _ in examples]))  # requests, like the one asked
            owner = np.array([labels.index(label) for _, label in examples])
            centroids = _unit(np.stack([vectors[owner == i].mean(axis=0) for i in range(len(labels))]))
            if len(banks) >= 8:
                banks.clear()
            banks[key] = LabelBank(labels, vectors, owner, centroids)
        return banks[key]


def labelled_examples(params: Params, path: Path | None) -> list[tuple[str, str]]:
    """(text, label) pairs: the labels' own, then the file's; every label needs at least one."""
    pairs = [(text, name) for name, spec in params.labels.items() for text in spec.examples if text.strip()]
    if path is not None:
        pairs += read_examples(path, list(params.labels))
    missing = [name for name in params.labels if not any(label == name for _, label in pairs)]
    if missing:
        raise ConfigError(f"classify: no example for label{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(repr, missing))}" + (f" (in the step's labels or {path})" if path else ""),
                          file=str(path) if path else None)
    return pairs


def read_examples(path: Path, labels: list[str]) -> list[tuple[str, str]]:
    """A JSONL file's {text, label} lines; a bad line is an error naming the file and the line."""
    try:
        records = list(json_lines(path))
    except OSError as exc:
        raise ConfigError(f"examples file {path}: {exc.strerror or exc}", file=str(path)) from exc
    pairs = []
    for number, record in records:
        text = record.get("text") if isinstance(record, dict) else None
        label = record.get("label") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip() or not isinstance(label, str):
            raise ConfigError(f"{path}:{number}: expected an object with a non-empty 'text' and a 'label'",
                              file=str(path), line=number)
        if label not in labels:
            raise ConfigError(f"{path}:{number}: label {label!r} is not one of the step's labels "
                              f"({', '.join(labels)})", file=str(path), line=number, field="label")
        pairs.append((text, label))
    return pairs


def _stamp(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"examples file {path}: {exc.strerror or exc}", file=str(path)) from exc
    return stat.st_mtime_ns, stat.st_size


def _unit(matrix: np.ndarray) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=-1, keepdims=True)
    return matrix / np.where(norms == 0, 1.0, norms)


# ----------------------------------------------------------------------------- llm
def by_llm(text: str, params: Params, ctx: StepContext, llm: LLMClient) -> Label:
    labels = [{"name": name, "description": spec.description} for name, spec in params.labels.items()]
    prompt = ctx.prompt(question=clip(text, params.max_request_chars), labels=labels, default=params.fallback)
    schema = {"type": "object", "additionalProperties": False, "required": ["label"],
              "properties": {"label": {"enum": list(params.labels)}}}
    reply = llm.chat(prompt, max_tokens=params.max_tokens, temperature=0.0, json_schema=schema).text
    label = parse_label(reply, list(params.labels))
    if label is None:
        ctx.logger.warning("classify: the LLM's reply names no label (%r); using the default %r", reply[:200],
                           params.fallback)
        return Label(label=params.fallback, mode="default")
    return Label(label=label, mode="llm")


def parse_label(reply: str, labels: list[str]) -> str | None:
    """The label a reply names: {"label": ...} JSON, else the label that appears first as a word
    (case, spaces and hyphens for '_' aside); None when it names none."""
    parsed = parse_json(reply, None)
    if isinstance(parsed, dict) and isinstance(parsed.get("label"), str):
        reply = parsed["label"]
    said = _words(reply)
    exact = [name for name in labels if _words(name).replace(" ", "") == said.replace(" ", "")]
    if exact:
        return exact[0]
    found = [(m.start(), name) for name in labels
             if (m := re.search(rf"(?<![a-z0-9]){re.escape(_words(name))}(?![a-z0-9])", said))]
    return min(found)[1] if found else None


def _words(text: str) -> str:
    return " ".join(re.split(r"[\s_\-]+", text.strip().lower())).strip(" .\"'`:")
