"""Few-shot examples retrieved by similarity (RELP, LLM-R): the operator's (request, good answer)
pairs most like the question, for ``generate`` to show before the references.

The examples file is JSONL, one ``{"request": ..., "answer": ...}`` object a line, its path relative
to the project's folder. It is read and embedded once per process and embedder (again only when the
file changes), with the pipeline's own embedder resource; each query then costs one dot product.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import ConfigError
from ragline.flows.files import json_lines
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.spec.registry import stage


class Example(BaseModel):
    """One worked example: a request and the answer the operator wants for it."""

    model_config = ConfigDict(extra="forbid")

    request: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    score: float | None = Field(None, description="cosine similarity to the question it was retrieved for")
    line: int | None = Field(None, description="its line in the examples file")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="JSONL of {request, answer} pairs, relative to the project's folder")
    k: int = Field(3, ge=0, le=20, description="examples shown, most similar first (0: none)")
    min_similarity: float | None = Field(None, ge=-1, le=1, description="leave out examples less similar than this")
    max_chars: int = Field(1000, ge=50, description="longer requests and answers are clipped in the prompt")


@stage("retrieve_examples", params=Params, produces="examples", kind="query",
       uses={"embedder": ("sentence_transformer",)})
def retrieve_examples(query: Query, params: Params, ctx: StepContext, embedder: Embedder) -> list[Example]:
    """The k examples whose requests are most similar (cosine) to the question, most similar first."""
    if params.k == 0:
        return []
    bank = examples_of(Path(ctx.base_dir) / params.path, embedder)
    if not bank.examples:
        return []
    question = _unit(embedder.encode_queries([query.original or query.text]))[0]
    scores = bank.vectors @ question
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: params.k]  # ties: file order
    kept = [i for i in order if params.min_similarity is None or scores[i] >= params.min_similarity]
    return [shown(bank.examples[i], float(scores[i]), params.max_chars) for i in kept]


def shown(example: Example, score: float, max_chars: int) -> Example:
    return example.model_copy(update={"score": score, "request": clip(example.request, max_chars),
                                      "answer": clip(example.answer, max_chars)})


@dataclass(frozen=True)
class Bank:
    examples: list[Example]
    vectors: np.ndarray  # unit rows, one per example


_BANKS: weakref.WeakKeyDictionary[Embedder, dict[tuple[str, int, int], Bank]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def examples_of(path: Path, embedder: Embedder) -> Bank:
    """The file's examples and their vectors: embedded on first use per embedder, and again only
    when the file changes (its size or modification time)."""
    path = path.resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"examples file {path}: {exc.strerror or exc}", file=str(path)) from exc
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    with _LOCK:  # one embedding per file, however many queries arrive at once
        banks = _BANKS.setdefault(embedder, {})
        if key not in banks:
            examples = read_examples(path)
            vectors = _unit(embedder.encode_passages([e.request for e in examples]))
            banks.clear()  # an older version of the file
            banks[key] = Bank(examples, vectors)
        return banks[key]


def read_examples(path: Path) -> list[Example]:
    """Every line an example; a bad line is an error naming the file and the line."""
    examples = []
    for number, record in json_lines(path):
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: expected an object with 'request' and 'answer'",
                              file=str(path), line=number)
        try:
            examples.append(Example.model_validate({"request": record.get("request"),
                                                    "answer": record.get("answer"), "line": number}))
        except ValidationError as exc:
            error = exc.errors()[0]
            raise ConfigError(f"{path}:{number}: field '{error['loc'][0]}': {error['msg']}",
                              file=str(path), line=number, field=str(error["loc"][0])) from None
    return examples


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)
