"""Answerability gate: refuse before generation when the references do not bear on the question.

Generation is the most expensive call of a query and, with unrelated references, the one most
likely to produce a confident wrong answer. Two signals, cheapest first:

- ``similarity``: the best cosine similarity between the question and an inserted passage (the
  pipeline's embedder). It catches questions about something the collection does not cover at all;
  it cannot tell a passage *on* the topic from one that *answers* (RGB's negatives score as high
  as its positives), so its floor is set low, where pseudo-queries almost never fall.
- ``llm``: the LLM's probability that the documents contain the answer, asked with the answer
  prompt's own opening (instructions, documents, question), so vLLM's prefix cache reuses that
  prefill for the generation that follows: the check costs one output token.

A threshold of 0 turns a signal off. ``min_similarity: auto`` (the default) reads the floor that
ingestion computed for the index it published (``record_floor``, from the index sink's finalize:
a sample of inverse-cloze pseudo-queries scored against their own passage, the floor that 98 % of
them clear, kept in the index state's meta with the generation it was computed on, computed again
once the index changed size by a tenth or its embedder changed), so a question
the documents do not cover is refused out of the box; the query only reads it. ``ragline tune``
sets both thresholds from its own pseudo-queries (no labels): see ``tasks/jobs/tune_retrieval/gate.py``. The refusal is the generator's own text and an empty context, so
``generate`` returns it with the gate's reason and without calling the LLM.
"""
from __future__ import annotations

import itertools
import json
import random
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Context, ContextDocument, Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm_output import clip, option_probabilities
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.stores.state import IndexState, StoreMissing
from ragline.tasks.ingest.pseudo_queries import body, sentences_of, without

YES_NO = {"yes": ("yes",), "no": ("no",)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_similarity: Annotated[float, Field(ge=-1, le=1)] | Literal["auto"] = Field(
        "auto", description="refuse when no inserted passage is at least this similar to the question (embedder "
                            "cosine); 0: off; auto: the floor ingestion set for the index (off when there is none)")
    min_probability: float = Field(0.0, ge=0, le=1, description="refuse when the LLM gives the documents less than "
                                                               "this probability of containing the answer; 0: off")
    max_request_chars: int = Field(2000, ge=100, description="longer questions are clipped inside the prompt")


class Scores(BaseModel):
    """The gate's signals for one question and its references."""

    similarity: float | None = None
    probability: float | None = None


def reads_roles(params: Params) -> dict[str, tuple[str, str] | None]:
    """The embedder for a similarity floor (``auto``: only where the file has one; without it there is
    no floor to read), the LLM for ``min_probability``; a check set to 0 reads nothing."""
    reads: dict[str, tuple[str, str] | None] = {}
    if params.min_similarity == "auto":
        reads["embedder"] = None
    elif params.min_similarity > 0:
        reads["embedder"] = ("min_similarity", f"min_similarity: {params.min_similarity:g} compares the question "
                                               f"with the passages by the embedder's cosine")
    if params.min_probability > 0:
        reads["llm"] = ("min_probability", f"min_probability: {params.min_probability:g} asks the LLM whether the "
                                           f"documents answer")
    return reads


@stage("answerable", params=Params, produces="context", kind="query",
       uses={"embedder": ("sentence_transformer",), "llm": ("openai_compatible",)}, reads_roles=reads_roles,
       prompt="answerable", prompt_variables=("question", "documents"))
def answerable(query: Query, context: Context, params: Params, ctx: StepContext, embedder: Embedder | None = None,
               llm: LLMClient | None = None) -> Context:
    """The context unchanged when the question looks answerable from it; else an empty context
    that carries the reason, so generation refuses without a call."""
    if not context.documents:
        return context
    scores = Scores()
    for threshold, resource, kind in (("min_similarity", embedder, "sentence_transformer"),
                                      ("min_probability", llm, "openai_compatible")):
        if getattr(params, threshold) != "auto" and getattr(params, threshold) > 0 and resource is None:
            raise MissingResource(f"{threshold} needs a {kind} resource in the file (or set it to 0)")
    floor, origin = ((indexed_floor(ctx, embedder, query), ", the floor set at ingestion") if params.min_similarity == "auto"
                     else (params.min_similarity, ""))
    if floor is not None and floor > 0:
        scores.similarity = max_cosine(embedder.encode_queries([query.text])[0],
                                       passage_vectors(ctx, embedder, context.documents))
        if scores.similarity < floor:
            return withheld(context, scores, f"no reference is close to the question (similarity "
                                             f"{scores.similarity:.2f} < {floor:.2f}{origin})")
    if params.min_probability > 0:
        prompt = ctx.prompt(question=clip(query.text, params.max_request_chars), documents=context.documents)
        scores.probability = probability(llm, prompt)
        if scores.probability < params.min_probability:
            return withheld(context, scores, f"the references do not seem to contain the answer (P(answerable) "
                                             f"{scores.probability:.2f} < {params.min_probability:.2f})")
    return context.model_copy(update={"answerability": scores.model_dump()})


def similarity(embedder: Embedder, question: str, texts: list[str]) -> float:
    """The highest cosine similarity between the question and one of the texts."""
    return max_cosine(embedder.encode_queries([question])[0], embedder.encode_passages(texts))


def passage_vectors(ctx: StepContext, embedder: Embedder, documents: list[ContextDocument]) -> np.ndarray:
    """The inserted passages' vectors: as the pipeline's store holds them when it holds this
    embedder's (a read of a few ids, instead of encoding every passage again on each question),
    else encoded (a refined passage, no store, another embedder's store)."""
    stored: dict[str, np.ndarray] = {}
    store = _pipeline_store(ctx)
    if store is not None:
        try:
            if store.stored_embedder() == embedder.spec.vectors_key():
                stored = store.vectors([d.passage.chunk_id for d in documents if d.passage.original_text is None])
        except Exception as exc:  # noqa: BLE001 - the vectors are only a shortcut: encode instead
            ctx.logger.info("answerability: stored vectors unavailable (%s); encoding the passages", exc)
    missing = [d.passage.text for d in documents if d.passage.chunk_id not in stored]
    encoded = iter(embedder.encode_passages(missing) if missing else [])
    return np.stack([stored[d.passage.chunk_id] if d.passage.chunk_id in stored else next(encoded)
                     for d in documents])


def _pipeline_store(ctx: StepContext) -> Any:
    """The vector store a step of this pipeline reads (the dense retriever's), or None."""
    project = getattr(ctx, "project", None)
    if project is None:
        return None
    try:
        steps = project.pipeline(ctx.pipeline).steps
    except (KeyError, ValueError):
        return None
    name = next((s.resources["store"] for s in steps if "store" in s.resources), None)
    return project.resource(name) if name is not None else None


def max_cosine(query: np.ndarray, vectors: np.ndarray) -> float:
    """The highest cosine similarity between ``query`` and one of ``vectors`` (what the gate's floor
    is compared with; the tuner places the floor with the same measure)."""
    query, vectors = np.asarray(query, dtype=np.float32), np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
    return float(np.max(vectors @ query / np.maximum(norms, 1e-12)))


def probability(llm: LLMClient, prompt: str) -> float:
    """P(yes) of a yes/no question, from the first token's top logprobs (one output token)."""
    reply = llm.chat(prompt, max_tokens=1, logprobs=True, top_logprobs=10)
    return option_probabilities(reply, YES_NO).get("yes", 0.0)


def withheld(context: Context, scores: Scores, reason: str) -> Context:
    return Context(documents=[], tokens=0, dropped=len(context.documents) + context.dropped,
                   withheld=reason, answerability=scores.model_dump())


# ----------------------------------------------------------------------------- the floor set at ingestion
FLOOR_KEY = "answerable_floor"  # index state meta: the gate's similarity floor for this index


class Floor(BaseModel):
    """The similarity floor computed for one generation of the index, and how."""

    min_similarity: float | None  # None: too few pseudo-queries to place it (the gate stays off)
    generation: int
    chunks: int = 0  # the index's size then: the floor is computed again once it changed by a tenth
    pairs: int
    keep: float
    embedder: str  # the vectors key of the embedder it was computed with (another one: not used)


def record_floor(state: IndexState, embedder: Embedder, pairs: int = 48, keep: float = 0.98,
                 seed: int = 0) -> Floor:
    """Compute the floor for the index as published and keep it in the state's meta (ingestion
    only: a query never writes). The floor describes the collection, not one document: it is kept
    until the embedder changes or the index grows or shrinks by a tenth (encoding the pseudo-queries
    costs about a second, several on a loaded machine)."""
    generation, key, chunks = state.generation, embedder.spec.vectors_key(), state.counts()[1]
    current = read_floor(state)
    if current is not None and current.embedder == key and abs(chunks - current.chunks) * 10 <= current.chunks:
        return current
    floor = Floor(min_similarity=None, generation=generation, chunks=chunks, pairs=0, keep=keep, embedder=key)
    found = inverse_cloze(state, pairs, seed)
    if found:
        questions, rests = zip(*found)
        values = [max_cosine(q, d[None]) for q, d in zip(embedder.encode_queries(list(questions)),
                                                         embedder.encode_passages(list(rests)))]
        floor.pairs, floor.min_similarity = len(values), kept_floor(values, keep)
    state.set_meta(FLOOR_KEY, floor.model_dump_json())
    return floor


def read_floor(state: IndexState) -> Floor | None:
    """The recorded floor, or None (none recorded, no state, or an unreadable record). Read-only."""
    try:
        text = state.get_meta(FLOOR_KEY) if state.exists() else None
    except StoreMissing:
        return None
    try:
        return Floor.model_validate(json.loads(text)) if text else None
    except (ValueError, TypeError):
        return None


def indexed_floor(ctx: StepContext, embedder: Embedder | None, query: Query | None = None) -> float | None:
    """The floor ingestion recorded in the project's index state, if it was computed with this
    gate's embedder (a project with several index states: none, which one is meant is unknown).
    Over named collections: the lowest floor of those the query searches (none unless each has one)."""
    project = getattr(ctx, "project", None)
    if project is None or embedder is None:
        return None
    floors = [read_floor(project.resource(name)) for name in _floor_states(project, query)]
    if not floors or any(f is None or f.embedder != embedder.spec.vectors_key() for f in floors):
        return None
    values = [f.min_similarity for f in floors]
    return None if None in values else min(values)


def _floor_states(project: Any, query: Query | None) -> list[str]:
    """The index states whose floors apply: the searched collections' (pipelines.yaml `collections`),
    else the project's one state."""
    resources = project.spec.resources
    collections = getattr(project, "collections", None) or {}
    if collections:
        wanted = (query.collections if query is not None else None) or list(collections)
        return [name for c in wanted if c in collections for name in collections[c].resources.values()
                if resources[name].type == "index_state"]
    names = [n for n, spec in resources.items() if spec.type == "index_state"]
    return names if len(names) == 1 else []


def inverse_cloze(state: IndexState, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Up to ``n`` (sentence, its passage without it) pairs from chunks sampled with ``seed``: one
    sentence per chunk first, then a second one, and so on (``tasks/ingest/pseudo_queries.py``'s cut)."""

    rng = random.Random(seed)
    ids = sorted(state.chunk_ids())
    sampled = rng.sample(ids, min(len(ids), 4 * n))
    rows = state.chunks_by_id(sampled)
    per_chunk: list[list[tuple[str, str]]] = []
    for chunk_id in sampled:
        text = body(rows[chunk_id]["text"], rows[chunk_id]["title"])
        found = sentences_of(text)
        fitting = [s for s in found if 6 <= len(s.split()) <= 40] if len(found) > 1 else []
        rng.shuffle(fitting)
        per_chunk.append([(s, rest) for s in fitting if len((rest := without(text, s)).split()) >= 5])
    rounds = itertools.zip_longest(*per_chunk)
    return [pair for pair in itertools.chain.from_iterable(rounds) if pair is not None][:n]


def kept_floor(scores: list[float | None], keep: float | None) -> float | None:
    """The score (a gate's similarity or P(answerable)) that ``keep`` of the pseudo-queries clear
    with their own source: below it, a question is unlike anything answerable in this collection."""
    values = [v for v in scores if v is not None]
    if keep is None or len(values) < 20:  # too few to place a low quantile
        return None
    return round(float(np.quantile(values, 1.0 - keep)), 4)

