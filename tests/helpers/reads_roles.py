"""The optional resources a step's configuration reads (``Stage.reads_roles``), checked through the real
compiler on a written pipelines.yaml: one the configuration reads and the file lacks is an error naming
the file, the line and the ``with`` field that makes the step read it; one it does not read is left
unbound (two of its type need no name)."""
from __future__ import annotations

from pathlib import Path

from ragline.flows.spec.compile import validate_file
from ragline.flows.spec.parse import SpecError

LLM = '  llm: {type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}\n'
TWO_LLMS = ('  llm_a: {type: openai_compatible, base_url: "http://127.0.0.1:9/v1"}\n'
            '  llm_b: {type: openai_compatible, base_url: "http://127.0.0.1:8/v1"}\n')
EMBEDDER = "  embedder: {type: sentence_transformer}\n"
TWO_EMBEDDERS = ("  emb_a: {type: sentence_transformer}\n"
                 "  emb_b: {type: sentence_transformer, model: sentence-transformers/all-MiniLM-L12-v2}\n")
BM25 = "  sparse: {type: bm25, path: idx/bm25}\n"
STATE = "  state: {type: index_state, path: idx/state.sqlite}\n"
TWO_BM25 = "  bm_a: {type: bm25, path: idx/a}\n  bm_b: {type: bm25, path: idx/b}\n"


def pipelines_file(resources: str, steps: str, kind: str = "query") -> str:
    """``resources`` (lines indented 2) and one pipeline ``p`` of ``kind`` with ``steps`` (list items
    indented 6)."""
    return f"resources:\n{resources}pipelines:\n  p:\n    kind: {kind}\n    steps:\n{steps}"


def error_at(path: Path, step: str, field: str, needle: str | None = None) -> SpecError:
    """The file's one validation error: at ``step``'s ``field``, on the line that holds ``needle``
    (default: the field's own key), naming the file."""
    errors = validate_file(path)
    assert len(errors) == 1, errors
    [error] = errors
    key = needle or f"{field.rsplit('.', 1)[-1]}:"
    lines = [number for number, text in enumerate(path.read_text().splitlines(), 1) if key in text]
    assert len(lines) == 1, f"{key!r} is on lines {lines}"
    assert (error.pipeline, error.step, error.field, error.line) == ("p", step, field, lines[0]), error
    assert str(error).startswith(f"{path}:{lines[0]}, pipeline 'p', step '{step}', field '{field}': "), str(error)
    assert "and the file has none" in error.message
    return error
