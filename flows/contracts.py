"""Typed data that flows between stages.

Stages exchange these small pydantic models; the compiler wires a step's inputs to the
outputs of its upstream steps by port name (see ``flows.registry``).
"""
from __future__ import annotations

import bisect
import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator

Metadata = dict[str, str | int | float | bool]


MEMBERS_KEY = "members"  # a community summary passage's metadata key: its member document ids, one per line
COLLECTION_KEY = "collection"  # the passage metadata key naming the named collection it came from
# a listed document's metadata key: read but listed without its text, read again in its batch by its source's
# ``read`` hook ('<root index>:<file path>'); never reaches a store
UNREAD_KEY = "_unread"
DEFAULT_MAX_QUESTION_CHARS = 10_000  # the longest question a query takes unless the API is told otherwise


def content_hash(text: str) -> str:
    """Stable hash of a text, used for change detection and chunk ids."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class PipelineKind(StrEnum):
    """What a pipeline does (its YAML ``kind``): a StrEnum, so it reads, prints and serialises as the word."""

    INGESTION = "ingestion"  # writes the index
    QUERY = "query"  # answers a request
    JOB = "job"  # no inputs: reads the index and writes something else (e.g. `tune`)


class Document(BaseModel):
    """One source document (a file, or one record of a JSONL corpus)."""

    # pydantic-core's JSON parser keeps every string of up to 64 characters it reads in a process-wide
    # cache (16,384 entries) unless told otherwise: a document's values (its id, path, metadata) are
    # its own, never read again, so only the field names are cached (the state's work list is read
    # back as JSON a page at a time: with "all", ~0.3 KB a document stayed in that cache, ~2 MB at most)
    model_config = ConfigDict(frozen=False, cache_strings="keys")

    source_id: str = Field(description="stable id: '<root name>/<path below the root>', with '#record-id' for JSONL "
                                       "records; never the server's absolute path, so a moved project keeps it")
    text: str
    title: str = ""
    format: str = Field("text", description="text, markdown, html or jsonl, else the file's extension (pdf, docx, "
                                            "eml, ...: converted by flows/formats)")
    path: str = Field("", description="where it is shown to be: its public URL (the root's url_prefix), else its id")
    modified: float = 0.0
    content_hash: str = ""
    metadata: Metadata = Field(default_factory=dict)
    groups: list[str] = Field(default_factory=list, description="groups allowed to read it (flows/access.py); "
                                                                 "empty: everyone. Its chunks carry them as metadata")
    signal: str | None = Field(None, description="the change signal of the item it was read from (size and mtime, "
                                                 "an ETag), recorded with it: an item whose signal is unchanged is "
                                                 "not read again")
    pages: list[int] = Field(default_factory=list,
                             description="where each page starts in `text` (page n at pages[n-1], an empty page where "
                                         "the next starts); empty for formats without pages. The chunker records "
                                         "each chunk's page range from it")

    def page_at(self, offset: int) -> int | None:
        """The page number (1-based) holding character ``offset`` of the text; None without pages."""
        return bisect.bisect_right(self.pages, offset) if self.pages else None


class Chunk(BaseModel):
    """A piece of a document, the unit that is embedded and indexed."""

    chunk_id: str
    source_id: str
    ordinal: int
    text: str
    title: str = ""
    metadata: Metadata = Field(default_factory=dict)
    embedding: list[float] | None = None
    context: str = Field("", description="document-level context the embedder sees before `text` (contextual "
                                         "retrieval, the `enrich` stage); neither stored nor shown")
    embedder_key: str = Field("", description="what made `embedding` (EmbedderSpec.vectors_key): the store "
                                              "records it, so retrieval can refuse another embedder's queries")
    embedder_model: str = Field("", description="that embedder's model, for messages")


class Failure(BaseModel):
    """A document (or a path) that could not be processed, reported and skipped.

    Whatever was indexed from the failed path is kept: a failure on a file protects its records
    (``path#id``), one on a folder protects everything under it, one on a JSONL line its file.
    """

    source_id: str
    stage: str
    reason: str
    root: bool = Field(False, description="a listed root could not be reached: the run deletes nothing and fails")
    skipped: bool = Field(False, description="left out on purpose (a link out of every root): whatever was indexed "
                                             "from it is removed like any source that is gone")

    def protects(self, source_id: str) -> bool:
        """Whether ``source_id`` keeps its indexed entries because of this failure."""
        if self.skipped:
            return False
        failed = self.source_id
        if source_id == failed or source_id.startswith((failed.rstrip("/") + "/", failed + "#")):
            return True
        file, _, line = failed.rpartition(":")  # "path:12": a bad JSONL line protects its file's records
        return bool(file) and line.isdigit() and source_id.startswith(file + "#")


class Coverage(BaseModel):
    """A root the source stage listed completely: only sources it covers may be deleted as gone."""

    kind: Literal["folder", "file", "glob"]
    path: str = Field(description="the root in source-id terms: its name ('.' for the pipelines file's folder), "
                                  "or its glob pattern below its name")

    def covers(self, source_id: str) -> bool:
        path = source_id.split("#", 1)[0]
        if self.kind == "file":
            return path == self.path
        if self.kind == "folder":
            if self.path == ".":  # the project's own folder: every relative id
                return not path.startswith(("/", "../"))
            return path.startswith(self.path.rstrip("/") + "/")
        return _glob_regex(self.path).match(path) is not None


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as the filesystem applies it: '*' and '?' stop at '/', '**' spans folders; a match
    that is a folder covers everything below it."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + re.escape(body[1:]) if body[:1] == "!" else re.escape(body)) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + "(?:/.*)?$")


class Feedback(BaseModel):
    """Pseudo-relevance feedback (``expand_prf``): terms of the top retrieved passages (RM3)."""

    model_config = ConfigDict(extra="forbid")

    terms: dict[str, float] = Field(description="BM25 index terms (stemmed) -> weight in the feedback model, "
                                                "summing to 1")
    query_weight: float = Field(0.5, ge=0, le=1, description="share of the original query in the keyword query "
                                                              "(RM3's lambda); the feedback terms get the rest")
    text: str = Field("", description="the request followed by the feedback terms as written: a second dense "
                                      "query (empty: dense retrieval is unchanged)")

    def weighted(self, query_terms: list[str]) -> dict[str, float]:
        """RM3's keyword query: the query's own term distribution and the feedback model, mixed."""
        mixed = {t: (1 - self.query_weight) * w for t, w in self.terms.items()}
        for term in query_terms:
            mixed[term] = mixed.get(term, 0.0) + self.query_weight / len(query_terms)
        return mixed


class Label(BaseModel):
    """What a ``classify`` step decided about a request (its step id is the key in ``Query.labels``)."""

    model_config = ConfigDict(extra="forbid")

    label: str
    score: float | None = Field(None, description="embedding: cosine similarity to the chosen label; llm: none")
    mode: str = Field("", description="embedding or llm; 'default' when the classifier fell back to the default")


class Query(BaseModel):
    """A search request as it moves through a query pipeline."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field ("filter") must not be ignored silently

    text: str
    history: list[dict[str, str]] = Field(default_factory=list, description="chat turns: {role, content}")
    filters: dict[str, Any] | None = Field(None, description="Chroma-style metadata `where` filter")
    variants: list[str] = Field(default_factory=list, description="rewritten search queries; empty means [text]")
    hypothetical: list[str] = Field(default_factory=list, description="HyDE documents, used as dense queries")
    instruction: str = Field("", description="how to answer (format, style), kept out of the search query")
    original: str = Field("", description="the request as the user wrote it, before any rewrite")
    conversation: list[dict[str, str]] | None = Field(
        None, description="chat turns {role, content} a `recall_history` step chose for the LLM: the recent ones "
                          "and the earlier ones relevant to the request, in conversation order; None: none chose")

    hyde_only: bool = Field(False, description="dense retrieval uses only the hypothetical documents")
    hypothetical_mean: bool = Field(False, description="dense retrieval searches once, with the mean embedding of "
                                    "the hypothetical documents (and of the search texts unless hyde_only), as "
                                    "HyDE with several samples does")
    keyword_texts: list[str] = Field(default_factory=list, description="BM25 search texts when they differ from "
                                     "the search texts (query2doc: the request repeated, then the pseudo-document)")
    feedback: Feedback | None = Field(None, description="pseudo-relevance feedback terms (expand_prf)")
    access: frozenset[str] | None = Field(None, description="set by the server, never by a client (flows/access.py): "
                                                            "the groups whose documents it may read besides public "
                                                            "ones; None: every document (an operator, the CLI)")
    collections: list[str] | None = Field(None, description="the named collections to search (pipelines.yaml "
                                                            "`collections`); None: all of them")
    labels: dict[str, Label] = Field(default_factory=dict, description="classify steps' decisions, by step id "
                                                                       "(a step's `when` reads them)")

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value

    def search_texts(self) -> list[str]:
        return self.variants or [self.text]

    def dense_texts(self) -> list[str]:
        """Texts to embed for dense retrieval: the search texts and any HyDE documents, then the
        feedback-expanded request (PRF's second dense query)."""
        texts = self.hypothetical if self.hyde_only and self.hypothetical else self.search_texts() + self.hypothetical
        return texts + [self.feedback.text] if self.feedback is not None and self.feedback.text else texts

    def keyword_search_texts(self) -> list[str]:
        """Texts BM25 searches: query2doc's expanded texts when a rewrite made them, else the search texts."""
        return self.keyword_texts or self.search_texts()


class Passage(BaseModel):
    """A retrieved chunk with its score and provenance."""

    chunk_id: str
    source_id: str
    text: str
    title: str = ""
    score: float = 0.0
    retriever: str = Field("", description="step id that produced the score")
    metadata: Metadata = Field(default_factory=dict)
    note: str = Field("", description="chain-of-note: what this passage contributes")
    original_text: str | None = Field(None, description="the text before refinement, if refined")


class Ranking(BaseModel):
    """Passages ranked for one search text by one retriever."""

    retriever: str
    query: str
    passages: list[Passage]


TRAIN_PAIRS = "train_pairs.jsonl"  # of a `ragline feedback export --qrels` folder: PseudoQuery lines, train split


class PseudoQuery(BaseModel):
    """A (query, relevant document) pair made from the corpus itself, for tuning without labels."""

    text: str = Field(description="the query")
    source_id: str = Field(description="the document it is relevant to")
    chunk_id: str = Field(description="the chunk it was made from")
    strategy: str = Field(description="inverse_cloze, title or llm")
    cut: str = Field("", description="text cut out of the source (inverse cloze, title): tuning scores the "
                                     "source without it, so the query does not find it by its own words")


class Candidate(BaseModel):
    """One retrieval setting the tuner tried, with its figures on the pseudo-queries."""

    name: str
    setting: dict[str, Any] = Field(description="fusion, retriever depth and BM25 parameters")
    scores: dict[str, float] = Field(default_factory=dict, description="ndcg@10, mrr@10, recall@100")


class GateCalibration(BaseModel):
    """The answerability gate's LLM check on pseudo-queries asked with and without their source."""

    pairs: int = Field(0, description="pseudo-queries asked (twice each)")
    threshold: float | None = Field(None, description="the P(answerable) gate_keep of them clear with their source")
    auc: float | None = Field(None, description="how well P(answerable) separates with-source from without")
    refused_unanswerable: float | None = Field(None, description="share refused at the threshold, without source")
    refused_answerable: float | None = Field(None, description="share refused at the threshold, with source")
    enabled: bool = Field(False, description="the threshold was set (it refuses enough without the source)")
    reason: str = ""


class TuneReport(BaseModel):
    """What `ragline tune` tried and chose; printed as the run summary."""

    metric: str
    pairs: int = Field(description="pseudo-queries the candidates were scored on")
    strategies: dict[str, int] = Field(default_factory=dict, description="pseudo-queries per strategy")
    chunks: int = Field(0, description="chunks in the index")
    candidates: list[Candidate] = Field(default_factory=list, description="every candidate, best first")
    baseline: Candidate | None = Field(None, description="the setting pipelines.yaml has")
    chosen: Candidate | None = None
    reason: str = ""
    rule: str = Field("", description="which rule decided: significant gain over the best single retriever, "
                                      "no significant gain (the best single retriever), recall guard, min_gain")
    single: Candidate | None = Field(None, description="the best single retriever, the setting to beat")
    gain_interval: list[float] | None = Field(None, description="paired-bootstrap 95 % interval of the chosen "
                                                                "(or best fused) candidate minus the best single "
                                                                "retriever on the metric, simultaneous over all "
                                                                "the fused candidates")
    by_strategy: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                   description="per pseudo-query generator: its pairs, the "
                                                               "chosen, best single and file's figures on them, "
                                                               "and its own best candidate")
    gate_floor: float | None = Field(None, description="similarity floor given to answerability gates (None: "
                                                       "none set)")
    gate_llm: GateCalibration | None = Field(None, description="how the gates' LLM check did on pseudo-queries "
                                                                 "(None: not calibrated)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="the overlay's resources and pipelines")
    overlay: str = Field("", description="the overlay file")
    written: bool = False
    write_requested: bool = Field(False, description="the stage asks the job runner to write the overlay")
    overlay_file: str | None = Field(None, description="where the job runner writes the overlay (None: the default)")
    generation: int | None = Field(None, description="the index generation the settings were tuned on")
    state_resource: str | None = Field(None, description="the index state the tuned BM25 is rebuilt under")
    sparse_resources: list[str] = Field(default_factory=list, description="BM25 indexes rebuilt with the tuned settings")
    seconds: float = 0.0
    timings: dict[str, float] = Field(default_factory=dict, description="seconds per phase")
    budget_exhausted: bool = False
    expansions: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                  description="per expansion stage (expand_prf, expand_terms) in the "
                                                              "tuned pipelines: on or off, why, its candidates")

    @computed_field
    @property
    def gate_probability_floor(self) -> float | None:
        """The P(answerable) threshold given to answerability gates (None: none set)."""
        return self.gate_llm.threshold if self.gate_llm is not None and self.gate_llm.enabled else None


class IndexReport(BaseModel):
    """What an ingestion run changed; printed as the run summary."""

    added: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0
    failed: int = 0
    migrated: int = Field(0, description="sources renamed to root-relative ids in place (an index from before "
                                         "them, a moved project, a renamed root): their vectors were kept")
    regranted: int = Field(0, description="unchanged sources whose access groups changed: their chunks' metadata "
                                          "was updated in place, nothing re-embedded")
    repaired: int = Field(0, description="sources re-indexed because a store had lost or garbled them (a deleted "
                                         "Chroma folder, a dropped collection): the run's repair forgot them first")
    chunks_written: int = 0
    chunks_deleted: int = 0
    failures: list[Failure] = Field(default_factory=list)
    roots: list[str] = Field(default_factory=list, description="the roots the source step listed")
    seconds: float = 0.0

    @property
    def incomplete(self) -> list[Failure]:
        """Roots that could not be reached: the run deleted nothing and must not count as a success."""
        return [f for f in self.failures if f.root]

    def merge(self, other: "IndexReport") -> "IndexReport":
        fields = ("added", "updated", "deleted", "unchanged", "failed", "migrated", "regranted", "repaired",
                  "chunks_written", "chunks_deleted")
        merged = {f: getattr(self, f) + getattr(other, f) for f in fields}
        return IndexReport(**merged, failures=self.failures + other.failures, roots=self.roots + other.roots,
                           seconds=self.seconds + other.seconds)

    def summary(self) -> str:
        return (f"added {self.added}, updated {self.updated}, deleted {self.deleted}, "
                f"unchanged {self.unchanged}, failed {self.failed} "
                f"({self.chunks_written} chunks written, {self.chunks_deleted} removed)"
                + (f"; {self.migrated} sources moved to root-relative ids without re-embedding"
                   if self.migrated else "")
                + (f"; {self.regranted} sources re-granted (access changed) without re-embedding"
                   if self.regranted else "")
                + (f"; {self.repaired} sources repaired (re-embedded: a store had lost them)"
                   if self.repaired else ""))


class ContextDocument(BaseModel):
    """A passage as it is inserted into the prompt, numbered for citation."""

    number: int
    passage: Passage
    tokens: int = 0


class Context(BaseModel):
    """The references given to the generator, in prompt order, within a token budget."""

    documents: list[ContextDocument] = Field(default_factory=list)
    tokens: int = 0
    dropped: int = Field(0, description="passages left out to respect the token budget")
    withheld: str = Field("", description="why an answerability gate emptied the context (generation refuses)")
    answerability: dict[str, float | None] | None = Field(None, description="the gate's signals, when one ran")

    def by_number(self) -> dict[int, ContextDocument]:
        return {d.number: d for d in self.documents}


class Source(BaseModel):
    """A cited reference, mapped back to its source document."""

    number: int
    chunk_id: str
    source_id: str
    title: str = ""
    path: str = Field("", description="the source below its root (or its public URL), never a server path")
    url: str = Field("", description="a link set by the loader from the root's url_prefix (with '#page=N' for a "
                                     "paged source); empty when none")
    passage: str = ""
    page_start: int | None = Field(None, description="the page the cited passage starts on (paged formats: PDF, slides)")
    page_end: int | None = Field(None, description="the page it ends on")
    section: str = Field("", description="the passage's section path, 'Heading > Subheading'")
    collection: str = Field("", description="the named collection it came from (pipelines.yaml `collections`); "
                                            "empty when the file declares none")
    documents: list[str] = Field(default_factory=list, description="a cited community summary's member documents "
                                                                   "(ask_global); empty for a passage")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def page(self) -> str:
        """'p. 12' or 'pp. 12-13' where the source has pages, else ''."""
        return page_label(self.page_start, self.page_end)

    @classmethod
    def of(cls, number: int, passage: "Passage") -> "Source":
        """The reference to a retrieved passage: where it is, its link (to its page) and its section."""
        meta = passage.metadata
        start, end = meta.get("page_start"), meta.get("page_end")
        start = start if isinstance(start, int) and not isinstance(start, bool) else None
        end = end if isinstance(end, int) and not isinstance(end, bool) else start
        url = str(meta.get("url", ""))
        return cls(number=number, chunk_id=passage.chunk_id, source_id=passage.source_id, title=passage.title,
                   path=str(meta.get("source", passage.source_id)),
                   url=f"{url}#page={start}" if url and start is not None and "#" not in url else url,
                   passage=passage.text, page_start=start, page_end=end, section=str(meta.get("section", "")),
                   collection=str(meta.get("collection", "")),
                   documents=[d for d in str(meta.get(MEMBERS_KEY, "")).split("\n") if d])


def page_label(start: int | None, end: int | None = None) -> str:
    """How a page range is shown next to a source: 'p. 12', 'pp. 12-13', or '' without pages."""
    if start is None:
        return ""
    return f"p. {start}" if end is None or end == start else f"pp. {start}-{end}"


class EvidenceSpan(BaseModel):
    """One cited sentence (or table row) of an evidence answer, located exactly in its passage."""

    number: int = Field(description="the [n] of the inserted passage it comes from (its Source's number)")
    chunk_id: str
    source_id: str
    start: int = Field(ge=0, description="character offset of the sentence in the passage text as inserted "
                                         "(Source.passage): passage[start:end] == text")
    end: int = Field(ge=0)
    text: str = Field(description="the sentence or table row, exactly as in the passage")
    value_start: int | None = Field(None, description="the answering value inside it (a number, date, name), as "
                                                      "offsets in the same passage text; None: the whole sentence")
    value_end: int | None = None
    score: float = Field(0.0, description="the sentence's answer score (what confidence is made of)")


class EvidenceAnswer(BaseModel):
    """The extractive answer (``extract_answer``): the sentence(s) of the inserted passages that
    answer the question, cited, with exact offsets, or a refusal with its reason. Computed for
    every question before any LLM call, in well under a second: what a surface shows first."""

    text: str = Field("", description="the answering sentence(s), each followed by its [n]; '' when refused")
    refused: bool = False
    reason: str = Field("", description="why it refuses (e.g. 'no sentence in the references mentions 3.13')")
    confidence: float = Field(0.0, ge=0, le=1, description="how sure the extractor is: its best sentence's score")
    value: str = Field("", description="the answering value of the first span (a number, date, name), '' if none")
    citations: list[int] = Field(default_factory=list, description="[n] markers in order of appearance")
    spans: list[EvidenceSpan] = Field(default_factory=list, description="the cited sentences, best first")
    sources: list[Source] = Field(default_factory=list, description="the cited references, as on Answer")
    key_terms: list[str] = Field(default_factory=list, description="the question's key terms the answer had to "
                                                                   "cover (numbers, dates, versions, names, rare "
                                                                   "words), as written in the question")
    seconds: float = Field(0.0, description="time the extractor took")


class Answer(BaseModel):
    """The final response of a query pipeline, with its evidence and its checks."""

    question: str
    text: str
    sources: list[Source] = Field(default_factory=list, description="the references cited in the text")
    citations: list[int] = Field(default_factory=list, description="[n] markers in order of appearance")
    invalid_citations: list[int] = Field(default_factory=list, description="[n] with no inserted document n")
    inferred_citations: list[int] = Field(default_factory=list,
                                          description="[n] added after generation by text overlap (the model gave none)")
    confidence: float | None = Field(None, description="geometric-mean token probability of the answer")
    verdict: str | None = Field(None, description="supported, contradicted or not_enough_information")
    refused: bool = False
    reason: str = Field("", description="why the answer was replaced by the refusal text (or, answered_by "
                                        "evidence, why the generated answer was replaced by the evidence answer)")
    draft: str = Field("", description="the generated text before a refusal replaced it")
    retrievals: int = Field(0, description="extra retrievals made during generation (FLARE)")
    skipped: dict[str, str] = Field(default_factory=dict, description="steps whose `when` left them out (or whose "
                                                                      "inputs came only from such steps): step -> why")
    evidence: EvidenceAnswer | None = Field(None, description="the extractive evidence answer computed before "
                                                                "generation (None: the pipeline has no "
                                                                "extract_answer step)")
    answered_by: Literal["llm", "evidence", ""] = Field(
        "", description="llm: the generated text, grounded in the evidence; evidence: the evidence answer's text "
                        "(no LLM, or the LLM's answer was replaced: `reason` says why, `draft` holds it); "
                        "'': a refusal, or a pipeline without evidence")


def to_json(value: Any) -> Any:
    """A stage output (models, lists of them, plain values) as JSON-ready data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


# ----------------------------------------------------------------------------- engine contracts
@dataclass
class IngestPlan:
    """The sink's decision: which documents to (re)index and which sources to delete."""

    to_index: list[Document]
    new: set[str] = field(default_factory=set)
    updated: set[str] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    migrated: int = 0  # sources renamed to root-relative ids, their vectors kept
    regranted: int = 0  # unchanged sources whose access changed: metadata updated in place
    queued: int = 0  # documents to index on the sink's work list, beside ``to_index`` (taken by ``pending``)


@dataclass
class WorkPage:
    """One batch of a sink's work list: the documents to index, each with the id of the source step
    that listed it (whose ``read`` hook reads it again), in source-id order."""

    documents: list[Document] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)


class StepResult:
    """A step's output with what it reported on the way (failures, listed roots, wall time).

    It travels back to the driver with the value, so a step runs the same in this thread, a
    worker thread or a Dask/Ray process. A plain class on purpose: Prefect walks dataclasses and
    pydantic models found in task parameters, and a batch holds thousands of them.
    """

    __slots__ = ("value", "failures", "covered", "seconds", "skipped")

    def __init__(self, value: Any, failures: list[Failure] | None = None, covered: list[Coverage] | None = None,
                 seconds: float = 0.0, skipped: str = ""):
        self.value = value
        self.failures = failures or []
        self.covered = covered or []
        self.seconds = seconds
        self.skipped = skipped  # why the step did not run (its `when`); "" when it ran

    def __getstate__(self) -> tuple:
        return self.value, self.failures, self.covered, self.seconds, self.skipped

    def __setstate__(self, state: tuple) -> None:
        self.value, self.failures, self.covered, self.seconds, self.skipped = state

    def __repr__(self) -> str:
        return f"StepResult({type(self.value).__name__}, {len(self.failures)} failures, {self.seconds:.3f} s)"


class Skipped:
    """The output of a skipped step that has none to give (not a list, no input of its own type to
    pass on): a consumer drops it from a fan-in, and a step left with no value for a required input
    is skipped too. A class, not a singleton: it crosses processes by pickle."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Skipped)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "Skipped()"


class AdaptReport(BaseModel):
    """What `adapt_embedder` trained and where it is; ``overlay`` points the embedder at it."""

    model_path: str = Field(description="the adapted model's folder (absolute)")
    base_model: str = Field(description="the model it was trained from (name or path)")
    embedder: str = Field("embedder", description="the embedder resource the overlay sets")
    key: str = Field(description="hash of base model, training rows and parameters (in the folder name)")
    pairs: int = Field(0, description="pseudo-query pairs trained on")
    strategies: dict[str, int] = Field(default_factory=dict)
    hard_negatives: int = Field(0, description="negatives per pair")
    mined_negatives: int = Field(0, description="negatives BM25 found (the rest were random chunks)")
    steps: int = 0
    epochs: float = 0.0
    loss: float | None = Field(None, description="mean training loss")
    stopped_early: bool = Field(False, description="max_seconds ran out before the last step")
    reused: bool = Field(False, description="a finished model with this key existed: nothing was trained")
    chunks: int = Field(0, description="chunks the next ingestion re-embeds with the adapted model")
    overlay: dict[str, Any] = Field(default_factory=dict, description="the overlay entries that point the "
                                                                      "embedder at the model")
    overlay_yaml: str = ""
    overlay_path: str = Field("", description="the overlay file written (empty: not written)")
    overlay_file: str | None = Field(None, description="where the job runner writes the overlay (None: the default)")
    write_requested: bool = Field(False, description="the stage asks the job runner to write the overlay")
    seconds: float = 0.0
    timings: dict[str, float] = Field(default_factory=dict, description="seconds per phase")
    created: str = ""



class Community(BaseModel):
    """One topic community of the summary index: its members, their hash and the LLM's summary."""

    id: str = Field(description="'L<level>-<n>': level 0 is the top, level 1 the fine communities")
    level: int = Field(ge=0)
    parent: str | None = Field(None, description="the top community a fine one belongs to")
    children: list[str] = Field(default_factory=list, description="the fine communities of a top one")
    chunk_ids: list[str] = Field(default_factory=list, description="member chunks, sorted")
    documents: list[str] = Field(default_factory=list, description="member documents (source ids), sorted")
    membership: str = Field(description="content hash of the membership: the sorted chunk ids (chunk ids are "
                                        "content hashes), or of the children's hashes for a top community")
    summary: str = ""
    embedding: list[float] = Field(default_factory=list, description="the summary's embedding (retrieval)")
    centroid: list[float] = Field(default_factory=list, description="the mean member vector (assignment)")
    read_chunks: list[str] = Field(default_factory=list, description="the central chunks the summary was made from")
    reused: bool = Field(False, description="the membership hash was unchanged: the previous summary was kept")


class SummaryReport(BaseModel):
    """What ``summarize_communities`` built; the job runner publishes it (``resources.summaries``)."""

    communities: list[Community] = Field(default_factory=list)
    generation: int = Field(0, description="the index generation the communities were built from")
    chunks: int = 0
    documents: int = 0
    embedder: str = Field("", description="the model the summary embeddings were made with")
    reclustered: bool = Field(True, description="k-means ran (else chunks were assigned to the kept centroids)")
    summarised: list[str] = Field(default_factory=list, description="communities whose summary was (re)written")
    reused: list[str] = Field(default_factory=list, description="communities whose summary was kept (same hash)")
    llm_calls: int = 0
    path: str = Field("", description="where the summaries are published: the file, or the database state's rows")
    state_resource: str = Field("", description="the index state resource they belong to (the job runner "
                                                "publishes them for it: beside it, or in its database)")
    written: bool = False
    write_requested: bool = Field(False, description="the stage asks the job runner to publish the summaries")
    seconds: float = 0.0
