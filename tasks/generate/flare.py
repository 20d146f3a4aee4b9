"""FLARE-style active retrieval (Jiang et al., 2023), in its two forms.

``mode: direct`` (FLARE-Direct): generate a sentence at a time; when a token's probability falls
below the threshold, retrieve with that sentence (uncertain tokens masked) and write it again.
``mode: instruct`` (FLARE-Instruct): the model is told to write ``[Search(query)]`` where it needs
information (``prompts/flare_instruct.j2``); the stage retrieves with that query, keeps the text
before the token and lets the model go on with the new documents. Both retrieve the same way (the
pipeline's embedder and store, within the query's filters and access) and at most
``max_retrievals`` times; a token past that bound, or one that cannot be read, is dropped from the
text and generation simply goes on."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, ContextDocument, Query
from ragline.flows.resources.models.llm_output import clip
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import Completion, LLMClient
from ragline.flows.resources.stores.protocols import DenseStore
from ragline.tasks.generate.generate import REFUSAL, SystemPrompt, answer_from, refusal, system_message, system_templates, \
    with_system
from ragline.tasks.ingest.collection_index import COLLECTION_KEY, by_collection
from ragline.tasks.retrieve.dense import combined_filter

_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.S)
_SEARCH = re.compile(r"\[\s*Search\s*\(([^()\[\]]*)\)\s*\]", re.I)  # [Search(query)]
# a token cut short or malformed ("[Search(q", "[Search q]"): dropped up to its line's next bracket
_SEARCH_LEFTOVER = re.compile(r"\[\s*Search\b[^()\[\]\n]*\(?[^()\[\]\n]*[)\]]*", re.I)
INSTRUCT_PROMPT = "flare_instruct"


class Params(SystemPrompt):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["direct", "instruct"] = Field("direct", description="direct: retrieve when a sentence's tokens "
                                                                      "are uncertain; instruct: when the model "
                                                                      "writes [Search(query)]")
    threshold: float = Field(0.4, gt=0, lt=1, description="retrieve when a token's probability is below this")
    max_sentences: int = Field(6, ge=1, le=50, description="look-aheads generated (instruct: continuations)")
    max_retrievals: int = Field(3, ge=0, le=20)
    k: int = Field(3, ge=1, le=50, description="passages per active retrieval")
    max_documents: int = Field(12, ge=1, le=100, description="cap on references in the prompt")
    max_tokens: int = Field(64, ge=8, le=1024, description="tokens generated per look-ahead")
    refusal: str = Field(REFUSAL)


@stage("generate_flare", params=Params, produces="answer", kind="query",
       prompt=lambda p: INSTRUCT_PROMPT if p is not None and p.mode == "instruct" else "flare_continue",
       prompt_variables=("question", "instruction", "documents", "refusal", "draft"), other_prompts=system_templates,
       uses={"llm": ("openai_compatible",), "store": ("chroma", "milvus"), "embedder": ("sentence_transformer",)})
def generate_flare(query: Query, context: Context, params: Params, ctx: StepContext, llm: LLMClient,
                   store: DenseStore, embedder: Embedder) -> Answer:
    """Active retrieval (Jiang et al., 2023): uncertain sentences, or the model's own search requests,
    trigger retrieval before the answer goes on."""
    if params.mode == "instruct":
        return _instruct(query, context, params, ctx, llm, store, embedder)
    documents = list(context.documents)
    draft, retrievals, tokens = "", 0, []
    system = system_message(params, ctx)
    for _ in range(params.max_sentences):
        step = _look_ahead(query, documents, draft, params, ctx, llm, system)
        sentence, confident = _first_sentence(step, params.threshold)
        if not sentence:
            break
        if not confident and retrievals < params.max_retrievals:
            added = _retrieve(query, _masked(step, sentence, params.threshold), documents, params, ctx, store, embedder)
            retrievals += 1
            if added:
                step = _look_ahead(query, documents, draft, params, ctx, llm, system)
                sentence, _ = _first_sentence(step, params.threshold)
        draft = f"{draft} {sentence}".strip()
        tokens.extend(step.tokens)
        if sentence.strip() == step.text.strip() and step.finish_reason == "stop":
            break
    return _finished(query, draft, tokens, documents, context, params, retrievals)


def _instruct(query: Query, context: Context, params: Params, ctx: StepContext, llm: LLMClient,
              store: DenseStore, embedder: Embedder) -> Answer:
    """FLARE-Instruct: the text up to a [Search(query)] token is kept, the query retrieved, and the
    model continues from the kept text with the new documents in its prompt."""
    documents = list(context.documents)
    draft, retrievals, tokens = "", 0, []
    system = system_message(params, ctx)
    for _ in range(params.max_sentences):
        step = _look_ahead(query, documents, draft, params, ctx, llm, system)
        search = _SEARCH.search(step.text)
        wanted = search.group(1).strip() if search else ""
        if search and wanted and retrievals < params.max_retrievals:
            draft = _joined(draft, _without_tokens(step.text[: search.start()]))
            _retrieve(query, wanted, documents, params, ctx, store, embedder)
            retrievals += 1
            ctx.logger.info("the model searched for %r (retrieval %d)", wanted, retrievals)
            continue
        draft = _joined(draft, _without_tokens(step.text))
        tokens.extend(step.tokens)
        if step.finish_reason != "length":
            break
    return _finished(query, draft, tokens, documents, context, params, retrievals)


def _finished(query: Query, draft: str, tokens: list, documents: list, context: Context, params: Params,
              retrievals: int) -> Answer:
    """The answer of either mode: its draft over every document it retrieved, or a refusal if it wrote nothing."""
    if not draft:
        return refusal(query, params.refusal, "no answer was generated")
    final = Context(documents=documents, tokens=context.tokens, dropped=context.dropped)
    answer = answer_from(query, Completion(text=draft, tokens=tokens), final, params.refusal)
    return answer.model_copy(update={"retrievals": retrievals})


def _without_tokens(text: str) -> str:
    """Generated text without search tokens: those past the bound, empty or malformed ones."""
    return " ".join(_SEARCH_LEFTOVER.sub(" ", _SEARCH.sub(" ", text)).split())


def _joined(draft: str, more: str) -> str:
    return f"{draft} {more}".strip()


def _look_ahead(query, documents, draft, params, ctx, llm, system) -> Completion:
    prompt = ctx.prompt(question=clip(query.text, 2000), instruction=query.instruction, documents=documents,
                        refusal=params.refusal, draft=draft)
    return llm.chat(with_system(prompt, system), max_tokens=params.max_tokens, logprobs=True)


def _first_sentence(step: Completion, threshold: float) -> tuple[str, bool]:
    """The first sentence of the look-ahead and whether all its tokens were confident enough."""
    text = step.text.strip()
    match = _SENTENCE.match(text)
    sentence = match.group(1).strip() if match else text
    covered, confident = 0, True
    for token in step.tokens:
        if covered >= len(sentence):
            break
        covered += len(token.token)
        confident = confident and token.prob >= threshold
    return sentence, confident


def _masked(step: Completion, sentence: str, threshold: float) -> str:
    """The sentence as a query, without its uncertain tokens (FLARE's masked query)."""
    kept, covered = [], 0
    for token in step.tokens:
        if covered >= len(sentence):
            break
        covered += len(token.token)
        if token.prob >= threshold:
            kept.append(token.token)
    return "".join(kept).strip() or sentence


def _retrieve(query, text, documents, params, ctx, store, embedder) -> bool:
    """Search for ``text`` in the step's store or, over named collections, in each one the query
    searches (the nearest ``k`` of them all: one embedder, comparable similarities)."""
    known = {d.passage.chunk_id for d in documents}
    vector = embedder.encode_queries([f"{query.text} {text}"])
    where = combined_filter(None, query.filters, query.access)  # re-retrieval reads only what the query may
    found = []
    for collection, searched in by_collection(ctx, "store", store, query.collections).items():
        searched.check_embedder(embedder.spec.vectors_key(), embedder.spec.model)
        passages = searched.query(vector, params.k, where=where, retriever="flare")[0]
        found += passages if collection is None else [
            p.model_copy(update={"metadata": {**p.metadata, COLLECTION_KEY: collection}}) for p in passages]
    found = sorted(found, key=lambda p: -p.score)[: params.k]
    new = [p for p in found if p.chunk_id not in known][: max(0, params.max_documents - len(documents))]
    for passage in new:
        documents.append(ContextDocument(number=len(documents) + 1, passage=passage))
    return bool(new)
