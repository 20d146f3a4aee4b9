"""Answer quality without labels (issue 20.4): an LLM judge, and a test set made from the index.

The judge asks the configured LLM three yes/no questions through Jinja prompts (``prompts/judge_*.j2``)
and reads each score as P(yes), from the first answer token's logprobs where the server sends them
(as the verify stage does), so scores rank and an AUC means something; a reply without logprobs
scores 0 or 1, an unreadable one None (counted, never guessed):

- faithfulness: the answer split into claims (sentences); each judged against the passages it cites
  ([n] markers). A claim without a marker is judged against every passage the answer cites; an answer
  citing none, against every retrieved passage. A claim citing only numbers no passage has scores 0.
- answer relevance: does the answer address the question (a refusal is not judged);
- context relevance: does each retrieved passage help answer the question; and, with no LLM call,
  the cosine of question and passage under the project's embedder (the second packaged model).

The test set: questions the pseudo-query stage writes from the team's own indexed documents
(doc2query by the LLM), each with the passage it came from, saved as JSONL and kept apart from
evaluation judgements: ``ragline eval --testset`` scores retrieval by whether the source document
comes back (hit@k, MRR@10) and, with ``--judge``, judges the answers.

How far to trust it: validated against RGB's labels by ``bench/judge_agreement.py`` (docs/evaluation.md).
With the packaged 135M model it is near chance; the same code with a capable model is the product.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from pydantic import BaseModel, Field, ValidationError

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, ContextDocument, Passage
from ragline.flows.evaluation.retrieval import document_id
from ragline.flows.spec.model import require_kinds
from ragline.flows.files import write_atomic
from ragline.flows.resources.models.llm import LLMClient
from ragline.flows.resources.models.llm_output import clip, option_probabilities, parse_citations, sentences, strip_citations
from ragline.flows.run import engine
from ragline.flows.spec.compile import Project
from ragline.tasks.ingest import pseudo_queries as pseudo

YES_NO = {"yes": ("yes",), "no": ("no",)}
PROMPTS = {"faithfulness": "judge_faithfulness", "answer_relevance": "judge_answer_relevance",
           "context_relevance": "judge_context_relevance"}
SCORES = ("faithfulness", "answer_relevance", "context_relevance", "context_relevance_cosine")
TESTSET_DIR = Path(".ragline") / "testsets"  # generated test sets, apart from labelled evaluation data
DEFAULT_TESTSET = TESTSET_DIR / "generated.jsonl"
_LEADING_MARKERS = re.compile(r"^(?:\s*\[\d+(?:\s*[,;]\s*\d+)*\]\s*[.!?]?)+")


# ----------------------------------------------------------------------------- results
class Claim(BaseModel):
    text: str
    citations: list[int] = Field(default_factory=list, description="the claim's own [n] markers")
    judged_against: list[int] = Field(default_factory=list, description="passage numbers shown to the judge")
    score: float | None = Field(None, description="P(supported); None: the judge's reply was unreadable")


class ItemJudgement(BaseModel):
    id: str
    question: str
    answer: str
    refused: bool = False
    faithfulness: float | None = Field(None, description="mean P(supported) of the answer's claims")
    answer_relevance: float | None = None
    context_relevance: float | None = Field(None, description="mean P(helps) of the retrieved passages")
    context_relevance_cosine: float | None = Field(None, description="mean question-passage cosine (embedder)")
    passage_relevance: list[float | None] = Field(default_factory=list)
    claims: list[Claim] = Field(default_factory=list)
    unreadable: int = Field(0, description="judge replies with no yes/no in them")


class JudgeSummary(BaseModel):
    items: int
    refused: int
    faithfulness: float | None
    answer_relevance: float | None
    context_relevance: float | None
    context_relevance_cosine: float | None
    supported_claims: float | None = Field(None, description="share of claims with P(supported) >= threshold")
    claims: int
    unreadable: int
    llm_calls: int
    seconds: float


# ----------------------------------------------------------------------------- claims
def split_claims(text: str) -> list[tuple[str, list[int]]]:
    """The answer's sentences with their own [n] markers; markers after a sentence's full stop
    ("Paris is in France. [1] It is big.") belong to that sentence, not to the next."""
    claims: list[tuple[str, list[int]]] = []
    for sentence in sentences(text):
        leading = _LEADING_MARKERS.match(sentence)
        if claims and leading:
            previous, cited = claims[-1]
            claims[-1] = (previous, cited + [m for m in parse_citations(leading.group(0)) if m not in cited])
            sentence = sentence[leading.end():].strip()
        if strip_citations(sentence).strip(" .!?"):
            claims.append((sentence, parse_citations(sentence)))
    return claims


def claim_passages(markers: list[int], answer_markers: list[int], passages: dict[int, str]) -> list[int]:
    """The passage numbers a claim is judged against: its own markers that name a passage; with none
    of its own, the answer's; with none in the whole answer, every passage. Empty: it cites only
    numbers no passage has."""
    if markers:
        return [m for m in markers if m in passages]
    cited = [m for m in answer_markers if m in passages]
    return cited if answer_markers else sorted(passages)


# ----------------------------------------------------------------------------- the judge
class Judge:
    """Yes/no questions to ``llm`` rendered by ``render(name, **variables)`` (a PromptLibrary's)."""

    def __init__(self, llm: LLMClient, render: Callable[..., str], threshold: float = 0.5,
                 max_passage_chars: int = 1200, embed: Callable[[str, list[str]], list[float]] | None = None):
        self.llm, self.render, self.threshold = llm, render, threshold
        self.max_passage_chars, self.embed = max_passage_chars, embed
        self.calls = 0

    def yes_probability(self, prompt: str) -> float | None:
        """P(yes) from the first token's top logprobs, normalised over yes and no; None: no verdict."""
        self.calls += 1
        completion = self.llm.chat(prompt, max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=10)
        return option_probabilities(completion, YES_NO).get("yes")

    def _passage(self, number: int, text: str) -> ContextDocument:
        return ContextDocument(number=number, passage=Passage(chunk_id=str(number), source_id=str(number),
                                                              text=clip(text, self.max_passage_chars)))

    def faithfulness(self, question: str, answer: str, passages: dict[int, str]) -> list[Claim]:
        answer_markers = parse_citations(answer)
        claims = []
        for text, markers in split_claims(answer):
            against = claim_passages(markers, answer_markers, passages)
            score = 0.0 if not against else self.yes_probability(self.render(
                PROMPTS["faithfulness"], question=clip(question, 1000), answer=clip(strip_citations(text), 1000),
                documents=[self._passage(n, passages[n]) for n in against]))
            claims.append(Claim(text=text, citations=markers, judged_against=against, score=score))
        return claims

    def answer_relevance(self, question: str, answer: str) -> float | None:
        return self.yes_probability(self.render(PROMPTS["answer_relevance"], question=clip(question, 1000),
                                                answer=clip(strip_citations(answer), 2000)))

    def context_relevance(self, question: str, passages: list[str]) -> list[float | None]:
        return [self.yes_probability(self.render(PROMPTS["context_relevance"], question=clip(question, 1000),
                                                 passage=self._passage(i, p).passage))
                for i, p in enumerate(passages, start=1)]

    def judge(self, item_id: str, answer: Answer, retrieved: list[str]) -> ItemJudgement:
        """One answer: its cited sources for faithfulness (the retrieved passages when it cites none),
        the retrieved passages for context relevance."""
        cited = {s.number: s.passage for s in answer.sources if s.passage}
        relevance = self.context_relevance(answer.question, retrieved)
        cosine = self.embed(answer.question, retrieved) if self.embed is not None and retrieved else []
        item = ItemJudgement(id=item_id, question=answer.question, answer=answer.text, refused=answer.refused,
                             passage_relevance=relevance, context_relevance=mean(relevance),
                             context_relevance_cosine=mean(cosine))
        if not answer.refused:
            passages = cited or dict(enumerate(retrieved, start=1))
            item.claims = self.faithfulness(answer.question, answer.text, passages)
            item.faithfulness = mean(c.score for c in item.claims)
            item.answer_relevance = self.answer_relevance(answer.question, answer.text)
        item.unreadable = sum(s is None for s in [*relevance, *(c.score for c in item.claims)]) + \
            (not answer.refused and item.answer_relevance is None)
        return item

    def summary(self, items: list[ItemJudgement], seconds: float) -> JudgeSummary:
        scored = [c.score for i in items for c in i.claims if c.score is not None]
        return JudgeSummary(
            items=len(items), refused=sum(i.refused for i in items),
            **{name: _round(mean(getattr(i, name) for i in items)) for name in SCORES},
            supported_claims=_round(mean(float(s >= self.threshold) for s in scored)),
            claims=sum(len(i.claims) for i in items), unreadable=sum(i.unreadable for i in items),
            llm_calls=self.calls, seconds=round(seconds, 2))


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def agreement(scores: list[float | None], labels: list[bool], threshold: float = 0.5) -> dict[str, Any]:
    """How a judge's scores agree with binary labels: accuracy and balanced accuracy at ``threshold``,
    ROC AUC (Mann-Whitney, ties count half); unreadable scores are left out and counted."""
    pairs = [(s, bool(y)) for s, y in zip(scores, labels) if s is not None]
    positives = [s for s, y in pairs if y]
    negatives = [s for s, y in pairs if not y]
    if not positives or not negatives:
        return {"n": len(pairs), "unreadable": len(scores) - len(pairs), "agreement": None,
                "balanced_accuracy": None, "auc": None}
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    true_positive = sum(s >= threshold for s in positives) / len(positives)
    true_negative = sum(s < threshold for s in negatives) / len(negatives)
    return {"n": len(pairs), "unreadable": len(scores) - len(pairs),
            "agreement": round(sum((s >= threshold) == y for s, y in pairs) / len(pairs), 4),
            "balanced_accuracy": round((true_positive + true_negative) / 2, 4),
            "auc": round(wins / (len(positives) * len(negatives)), 4)}


def cosine_scorer(embedder: Any) -> Callable[[str, list[str]], list[float]]:
    """Question-passage cosine under the project's embedder: a context relevance with no LLM."""
    def score(question: str, passages: list[str]) -> list[float]:
        query = embedder.encode_queries([question])[0]
        docs = embedder.encode_documents(passages)
        return [float(_cos(query, d)) for d in docs]
    return score


def _cos(a: Any, b: Any) -> float:
    dot = sum(float(x) * float(y) for x, y in zip(a, b))
    norm = math.sqrt(sum(float(x) ** 2 for x in a)) * math.sqrt(sum(float(y) ** 2 for y in b))
    return dot / norm if norm else 0.0


# ----------------------------------------------------------------------------- the test set
class TestQuestion(BaseModel):
    """One generated question with the passage it was written from (never a human judgement)."""

    __test__ = False  # not a pytest class
    id: str
    question: str
    source_id: str
    chunk_id: str
    passage: str
    title: str = ""
    strategy: str
    generated: Literal[True] = True


def _resource_of(project: Project, kind: str, pipeline: str | None = None, role: str | None = None) -> str:
    """The resource a pipeline's step uses as ``role``, else the file's first of type ``kind``."""
    if pipeline is not None and pipeline in project.pipelines:
        for step in project.pipeline(pipeline).steps:
            name = step.resources.get(role or "")
            if name and project.spec.resources[name].type == kind:
                return name
    name = next((n for n, spec in project.spec.resources.items() if spec.type == kind), None)
    if name is None:
        raise ValueError(f"{project.path.name}: no resource of type {kind} (the judge and the test set need one)")
    return name


def judge_llm(project: Project, pipeline: str = "ask") -> LLMClient:
    """The LLM the answering pipeline generates with (the judge is the configured model)."""
    return project.resource(_resource_of(project, "openai_compatible", pipeline, "llm"))


def generate_testset(project: Project, n: int, seed: int = 0, strategies: list[str] | None = None,
                     max_seconds: float | None = 600.0, pipeline: str = "ask") -> tuple[list[TestQuestion], dict]:
    """Questions from the index through the pseudo-query stage (LLM doc2query by default), each with
    its source passage; returns them and how long it took out of how many documents tried."""
    params = pseudo.Params(n=n, seed=seed, strategies=strategies or ["llm"], mask=False, max_seconds=max_seconds)
    llm = judge_llm(project, pipeline) if "llm" in params.strategies else None
    ctx = StepContext(pipeline="eval", step_id="testset", base_dir=str(project.base_dir),
                      prompt_name="pseudo_query", render_prompt=project.prompts.render)
    corpora = [(state, pseudo.corpus_documents(state)) for state in _index_states(project)]
    documents = {sid: chunks for _, found in corpora for sid, chunks in found.items()}
    if not documents:
        raise ValueError(f"the index of {project.path.name} is empty: run `ragline index` before making a test set")
    started = time.perf_counter()
    pairs = []
    for (state, found), share in zip(corpora, _shares(n, [len(found) for _, found in corpora])):
        left = None if max_seconds is None else max_seconds - (time.perf_counter() - started)
        if left is not None and left <= 0:
            break  # the time budget is the whole test set's
        if share:
            pairs += pseudo.pseudo_queries.fn(params.model_copy(update={"n": share, "max_seconds": left}), ctx, state, llm)
    seconds = time.perf_counter() - started
    chunks = {cid: (text, title) for chunks in documents.values() for cid, text, title in chunks}
    rows = [TestQuestion(id=f"g{i}", question=p.text, source_id=p.source_id, chunk_id=p.chunk_id,
                         passage=pseudo.body(*chunks[p.chunk_id]), title=chunks[p.chunk_id][1], strategy=p.strategy)
            for i, p in enumerate(pairs, start=1)]
    return rows, {"questions": len(rows), "documents": len(documents), "seconds": round(seconds, 2),
                  "strategies": params.strategies, "seed": seed}


def _index_states(project: Project) -> list[Any]:
    """The index states a test set is drawn from: each named collection's (the template's own is never
    written once pipelines.yaml declares collections), else the file's."""
    named = [own for c in project.collections.values() for own in c.resources.values()
             if project.spec.resources[own].type == "index_state"]
    return [project.resource(name) for name in named or [_resource_of(project, "index_state")]]


def _shares(n: int, sizes: list[int]) -> list[int]:
    """``n`` split in proportion to ``sizes`` (largest remainders), so each collection is sampled as
    much as it weighs in the whole."""
    total = sum(sizes)
    if not total:
        return [0] * len(sizes)
    exact = [n * size / total for size in sizes]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: -(exact[i] - shares[i]))[: n - sum(shares)]:
        shares[i] += 1
    return shares


def save_testset(path: Path, rows: list[TestQuestion]) -> Path:
    return write_atomic(Path(path), "".join(r.model_dump_json() + "\n" for r in rows))


def load_testset(path: str | Path) -> list[TestQuestion]:
    """A generated test set; a line that is not one is refused with its file and line."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    rows.append(TestQuestion.model_validate_json(line))
                except ValidationError as exc:
                    first = exc.errors()[0]
                    raise ValueError(f"{path}:{line_no}: not a generated test question "
                                     f"({'.'.join(map(str, first['loc'])) or 'line'}: {first['msg']})") from None
    return rows


def is_testset(path: str | Path) -> bool:
    """Whether a file is a generated test set (its first record says ``"generated": true``)."""
    try:
        with open(path, encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
        return json.loads(first).get("generated") is True
    except (OSError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------------- evaluating on it
def evaluate_testset(project: Project, path: str | Path, pipeline: str = "search", answer_pipeline: str = "ask",
                     judge: bool = False, limit: int | None = None, context_k: int = 3, k: int = 10,
                     ) -> dict[str, Any]:
    """Retrieval on the project's own index (does the source document come back: hit@k, MRR@10) and,
    with ``judge``, the answers of ``answer_pipeline`` judged; per-item judgements under ``items``."""
    rows = load_testset(path)[:limit]
    require_kinds(project, query=pipeline)
    if judge:
        require_kinds(project, query=answer_pipeline)
    search = project.pipeline(pipeline)
    started = time.perf_counter()
    ranked = [engine.run(search, {"query": row.question}, orchestrate=False) for row in rows]
    searched = time.perf_counter() - started
    ranks = [_rank(passages, row.source_id) for passages, row in zip(ranked, rows)]
    result: dict[str, Any] = {
        "dataset": Path(path).stem, "kind": "generated", "pipeline": pipeline, "queries": len(rows),
        f"hit@{k}": _round(mean(float(r is not None and r <= k) for r in ranks)),
        "mrr@10": _round(mean(1.0 / r if r is not None and r <= 10 else 0.0 for r in ranks)),
        "query_ms_mean": round(1000 * searched / max(1, len(rows)), 2), "per_query": {"rank": ranks}}
    if not judge:
        return result
    llm = judge_llm(project, answer_pipeline)
    embedder = _embedder(project, pipeline)
    judge_ = Judge(llm, project.prompts.render, embed=cosine_scorer(embedder) if embedder is not None else None)
    started = time.perf_counter()
    items = []
    for row, passages in zip(rows, ranked):
        answer = engine.run(project.pipeline(answer_pipeline), {"query": row.question}, orchestrate=False)
        items.append(judge_.judge(row.id, answer, [p.text for p in passages[:context_k]]))
    summary = judge_.summary(items, time.perf_counter() - started)
    return {**result, "answer_pipeline": answer_pipeline, "judge_model": llm.spec.model,
            **{name: getattr(summary, name) for name in SCORES}, "judge": summary.model_dump(),
            "items": [i.model_dump() for i in items]}


def _rank(passages: list[Passage], source_id: str) -> int | None:
    """The 1-based rank of the first passage of the source document (documents, not chunks, count)."""
    seen: list[str] = []
    for passage in passages:
        doc = document_id(passage) if passage.source_id != source_id else source_id
        if doc == source_id:
            return len(seen) + 1
        if doc not in seen:
            seen.append(doc)
    return None


def _embedder(project: Project, pipeline: str) -> Any:
    try:
        return project.resource(_resource_of(project, "sentence_transformer", pipeline, "embedder"))
    except ValueError:
        return None
