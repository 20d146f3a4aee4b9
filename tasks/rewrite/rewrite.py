"""Request rewriting (RETA-LLM and the RAG literature): conversational rewrite, multi-query
(RAG-fusion), HyDE (with ``keyword``, query2doc: its pseudo-document also expands the BM25 query),
decomposition, and separating an answer-format instruction from the search.

HyDE and query2doc with self-consistency (``samples`` > 1): one request asks the LLM for ``samples``
pseudo-documents at ``temperature`` (OpenAI ``n``: vLLM decodes them as one batch, so N samples cost
far less than N calls). A single pseudo-document from a small model carries its own inventions (a
wrong year, a made-up drug) as much as the answer's vocabulary; what several independent samples
agree on is more likely the topic's real vocabulary. So:

- the BM25 side (``keyword: true``, "query2doc2keyword with self-consistency") appends only the terms
  found in at least ``min_agreement`` of the samples, each once (counted with the BM25 index's own
  tokenizer, so a term is what the index searches; the request's own terms are left out: the request
  opens the query ``query_repeats`` times already), written as in the first sample that has it;
- the dense side searches with the mean of the embeddings of the request and the samples, as the HyDE
  paper does (``Query.hypothetical_mean``): averaging cancels what each sample invented, and it is one
  dense search, not N.

The samples use the resource's seed, so the same request gets the same samples (and the same
ranking) again. ``samples: 1`` is the single greedy pseudo-document, exactly as before.
"""
from __future__ import annotations

import re
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm_output import clip, parse_json, parse_lines
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import MAX_SAMPLES, LLMClient
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.tasks.generate.verify import content, stems, tokens

Mode = Literal["conversational", "multi_query", "hyde", "decompose", "instruction"]
SAMPLE_TEMPERATURE = 0.7  # several samples' temperature when the step sets none (the HyDE paper's)
EDGES = re.compile(r"^\W+|\W+$")  # the punctuation around a whitespace-separated piece


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: the query passes unchanged (a query2doc step `ragline tune` "
                                            "turns on or off)")
    mode: Mode = Field("conversational", description="which rewrite this step performs")
    n: int = Field(3, ge=1, le=10, description="multi_query: variants; decompose: at most this many sub-questions")
    include_original: bool = Field(True, description="also search with the request itself")
    max_tokens: int = Field(128, ge=8, le=2048, description="length of the LLM's reply")
    max_request_chars: int = Field(2000, ge=100, description="longer requests are clipped inside the prompt")
    history_turns: int = Field(6, ge=1, description="conversational: turns of history shown to the LLM (after "
                                                    "recall_history: the turns it chose instead)")
    min_kept: float = Field(0.5, ge=0, le=1, description="conversational: the share of the request's content words "
                                                         "the rewrite must keep; below it (a model that answered an "
                                                         "earlier turn's question instead, or echoed its prompt) "
                                                         "the request is searched as written")
    keyword: bool = Field(False, description="hyde: also append the pseudo-document to the BM25 query (query2doc)")
    query_repeats: int = Field(5, ge=1, le=20, description="hyde with keyword: times the request opens the BM25 "
                                                          "query, so its own terms outweigh the pseudo-document's")

    samples: int = Field(1, ge=1, le=MAX_SAMPLES,
                         description="hyde: pseudo-documents asked for in one call (self-consistency); 1: one, "
                                     "greedy, as without it")
    temperature: float | None = Field(None, ge=0, le=2, description="hyde: the pseudo-documents' sampling "
                                      "temperature; unset: the llm resource's for one sample, 0.7 for several")
    min_agreement: float = Field(0.6, gt=0, le=1, description="hyde with keyword and samples > 1: a term joins the "
                                                              "BM25 query when at least this share of the samples "
                                                              "holds it")

    @model_validator(mode="after")
    def _keyword_needs_hyde(self) -> "Params":
        if self.keyword and self.mode != "hyde":
            raise ValueError(f"keyword (query2doc) appends the HyDE pseudo-document; mode is {self.mode!r}, "
                             f"not 'hyde'")
        for name in ("samples", "temperature"):
            if name in self.model_fields_set and self.mode != "hyde" and getattr(self, name) not in (None, 1):
                raise ValueError(f"{name} applies to the HyDE pseudo-documents; mode is {self.mode!r}, not 'hyde'")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"samples: {self.samples} at temperature 0 are {self.samples} copies of one "
                             f"pseudo-document: give temperature > 0 (e.g. 0.7) or samples: 1")
        if "min_agreement" in self.model_fields_set and (self.samples == 1 or not self.keyword):
            raise ValueError("min_agreement filters the terms of several pseudo-documents for the BM25 query: it "
                             "needs samples > 1 and keyword: true")
        return self


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The BM25 index is read only by self-consistent query2doc (hyde, ``keyword: true``, ``samples`` > 1),
    to count the samples' terms, when the step is on (``--set`` or the tuned overlay that turns it on
    binds it then, or says the file has none): every other mode, and a step that is off, validates
    without one (and with several, names none)."""
    if params.enabled and params.mode == "hyde" and params.keyword and params.samples > 1:
        return {"sparse": ("keyword", f"keyword: true with samples: {params.samples} counts the samples' terms "
                                      f"with the BM25 index's own tokenizer")}
    return {}


@stage("rewrite", params=Params, produces="query", kind="query",
       uses={"llm": ("openai_compatible",), "sparse": ("bm25", "milvus")}, reads_roles=reads_roles,
       prompt=lambda p: f"rewrite_{p.mode}",
       prompt_variables=lambda p: ("question", "history") if p.mode == "conversational" else ("question", "n"))
def rewrite(query: Query, params: Params, ctx: StepContext, llm: LLMClient, sparse: SparseIndex | None = None) -> Query:
    """Rewrite the request for retrieval; the result says what to search and how to answer."""
    if not params.enabled:
        return query
    query = query if query.original else query.model_copy(update={"original": query.text})
    question = clip(query.text, params.max_request_chars)
    if params.mode == "conversational":
        return _conversational(query, question, params, ctx, llm)
    if params.mode == "hyde" and params.samples > 1:
        return _self_consistent(query, question, params, ctx, llm, sparse)
    reply = llm.chat(ctx.prompt(question=question, n=params.n), max_tokens=params.max_tokens,
                     temperature=params.temperature).text
    if params.mode in ("multi_query", "decompose"):
        found = [q for q in parse_lines(reply, params.n) if q.lower() != query.text.lower()]
        variants = ([query.text] if params.include_original else []) + found
        return query.model_copy(update={"variants": variants or [query.text]})
    if params.mode == "hyde":
        document = reply.strip()
        keyword = [query2doc(t, document, params.query_repeats) for t in query.search_texts()] \
            if params.keyword and document else []
        return query.model_copy(update={"hypothetical": [document] if document else [],
                                        "hyde_only": not params.include_original, "keyword_texts": keyword})
    return _instruction(query, reply, ctx)


def _self_consistent(query: Query, question: str, params: Params, ctx: StepContext, llm: LLMClient,
                     sparse: SparseIndex | None) -> Query:
    """HyDE / query2doc over ``samples`` pseudo-documents of one call (see the module's docstring)."""
    if params.keyword and sparse is None:
        raise MissingResource("rewrite with keyword: true and samples > 1 counts the samples' terms with the BM25 "
                         "index's tokenizer: the pipelines file needs a bm25 (or milvus) resource for it")
    temperature = SAMPLE_TEMPERATURE if params.temperature is None else params.temperature
    replies = llm.samples(ctx.prompt(question=question, n=params.n), params.samples, max_tokens=params.max_tokens,
                          temperature=temperature)
    documents = [r.text.strip() for r in replies if r.text.strip()]
    if not documents:
        ctx.logger.warning("the LLM wrote %d empty pseudo-documents; searching with the request as written",
                           params.samples)
        return query
    keyword = []
    if params.keyword:
        own = {t for terms in sparse.terms(query.search_texts()) for t in terms}
        words = agreed_terms(documents, sparse.terms, params.min_agreement, own, params.samples)
        ctx.logger.info("%d of %d samples agree on: %s", len(documents), params.samples, " ".join(words) or "nothing")
        keyword = [query2doc(t, " ".join(words), params.query_repeats) if words else t for t in query.search_texts()]
    return query.model_copy(update={"hypothetical": documents, "hypothetical_mean": True,
                                    "hyde_only": not params.include_original, "keyword_texts": keyword})


def agreed_terms(documents: list[str], terms_of: Callable[[list[str]], list[list[str]]], min_agreement: float,
                 exclude: set[str], samples: int | None = None) -> list[str]:
    """The words whose index term occurs in at least ``min_agreement`` of the ``samples`` pseudo-documents
    (default: as many as there are; an empty sample counts against every term), one word per term (as
    the first sample that has the term writes it), most agreed first, then in order of first
    appearance; terms in ``exclude`` (the request's own) are left out. Deterministic given the samples.
    A sample holds the terms ``terms_of`` (the BM25 index's own tokenizer) makes of it, so a term is
    counted exactly as the index counts it, whatever it does with hyphens, apostrophes or digits."""
    total = samples or len(documents)
    held = [list(dict.fromkeys(terms)) for terms in terms_of(documents)] if documents else []
    count: dict[str, int] = {}
    for terms in held:
        for term in terms:
            count[term] = count.get(term, 0) + 1
    order = {t: i for i, t in enumerate(dict.fromkeys(t for terms in held for t in terms))}
    kept = sorted((t for t in order if t not in exclude and count[t] >= min_agreement * total - 1e-9),
                  key=lambda t: (-count[t], order[t]))
    written = _written(documents, held, set(kept), terms_of)
    return [written.get(t, t) for t in kept]


def _written(documents: list[str], held: list[list[str]], wanted: set[str],
             terms_of: Callable[[list[str]], list[list[str]]]) -> dict[str, str]:
    """Each wanted term as the first document holding it writes it: the first of its pieces (a
    whitespace-separated piece without the punctuation around it, then that piece's runs of word
    characters) of which the index makes exactly that one term, so the BM25 query it joins searches
    just that term. (A term no piece makes alone, from an index that reads words in context, is
    written as the term.)"""
    pieces = [[p for chunk in d.split() if (word := EDGES.sub("", chunk))
               for p in (word, *re.findall(r"\w+", word))] for d in documents]
    vocabulary = list(dict.fromkeys(p for ps in pieces for p in ps))
    term_of = {p: ts[0] for p, ts in zip(vocabulary, terms_of(vocabulary) if vocabulary else []) if len(ts) == 1}
    written: dict[str, str] = {}
    for ps, terms in zip(pieces, map(set, held)):
        for piece in ps:
            term = term_of.get(piece)
            if term in wanted and term in terms:
                written.setdefault(term, piece)
    return written


def query2doc(text: str, document: str, repeats: int) -> str:
    """Query2doc's sparse query (Wang et al., 2023): the request ``repeats`` times, then the pseudo-document."""
    return " ".join([text] * repeats + [document])


def _conversational(query: Query, question: str, params: Params, ctx: StepContext, llm: LLMClient) -> Query:
    """'How about the School of Economics?' after a question on another school becomes a full request.
    The conversation a recall_history step chose, when one ran; else the last ``history_turns`` messages."""
    turns = query.conversation if query.conversation is not None else query.history[-params.history_turns:]
    if not turns:
        return query
    history = [{"role": t.get("role", "user"), "content": clip(t.get("content", ""), params.max_request_chars)}
               for t in turns]
    reply = llm.chat(ctx.prompt(question=question, history=history), max_tokens=params.max_tokens).text
    rewritten = next(iter(parse_lines(reply, 1)), "")
    if not rewritten:
        ctx.logger.warning("empty conversational rewrite; searching with the request as written")
        return query
    if (kept := kept_share(question, rewritten)) < params.min_kept:
        ctx.logger.warning("conversational rewrite %r keeps %.0f%% of the request's words (min_kept %.2f); "
                           "searching with the request as written", rewritten[:120], 100 * kept, params.min_kept)
        return query
    searched = [rewritten] + ([query.text] if params.include_original and rewritten != query.text else [])
    return query.model_copy(update={"text": rewritten, "variants": query.variants or searched})


def kept_share(request: str, rewritten: str) -> float:
    """The share of the request's content words (stems) the rewrite still has: a follow-up ('How about the
    School of Economics?') keeps its few words and gains the subject; the 135M model, shown ten unrelated
    turns, answered 'Who directed The Avengers?' for six of eight RGB questions (0%). A request with no
    content word ('and then?') keeps everything."""
    asked = set(stems(content(tokens(request))))
    return len(asked & set(stems(content(tokens(rewritten))))) / len(asked) if asked else 1.0


def _instruction(query: Query, reply: str, ctx: StepContext) -> Query:
    """Split {"search": ..., "format": ...}; a reply that is not that JSON falls back to
    'SEARCH: ... / FORMAT: ...' lines, and then to the request unchanged (logged)."""
    parsed = parse_json(reply, None)
    if isinstance(parsed, dict) and str(parsed.get("search", "")).strip():
        search, instruction = str(parsed["search"]).strip(), str(parsed.get("format") or "").strip()
    else:
        found = re.search(r"search\s*:\s*(.+)", reply, re.I)
        fmt = re.search(r"format\s*:\s*(.+)", reply, re.I)
        if not found:
            ctx.logger.warning("the LLM did not separate search and format (%r); unchanged", reply[:120])
            return query
        search, instruction = found.group(1).strip(), fmt.group(1).strip() if fmt else ""
    instruction = "" if instruction.upper().startswith("NONE") else instruction
    return query.model_copy(update={"text": search, "instruction": query.instruction or instruction})
