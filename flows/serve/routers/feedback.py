"""``POST /v1/feedback``: a user's rating of one served answer, named by the ``answer_id`` every
answer carries (body and ``X-Answer-ID``).

Stored append-only as JSON lines in ``<data dir>/.ragline/feedback/feedback.jsonl``, rotated by
size (``feedback_max_mb`` for all files together: the oldest file goes first), written before the
201 is sent. With the query log on, an answer id it never logged (or no longer keeps) is a 404:
feedback that names nothing cannot become evaluation data. With the log off any well-formed id is
taken (the export then has no query to join it with). ``query_log_text`` off: the comment is not
stored. Limits: the body (``FEEDBACK_BODY_BYTES``), the comment's length, the corrected ids'
number and length, ``MAX_PER_ANSWER`` ratings per answer (the last one counts) and a token bucket
of ``RATE_PER_SECOND`` (429 with ``Retry-After`` beyond it). ``ragline feedback export`` joins
the two files (``joined``) and writes the rated answers as a BEIR-style folder (``export_qrels``).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from ragline.flows import settings
from ragline.flows.evaluation.retrieval import OWN_INDEX_MARKER
from ragline.flows.contracts import TRAIN_PAIRS
from ragline.flows.files import write_atomic
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.serve.auth.principals import principal_of
from ragline.flows.serve.query_log import BACKUPS, LOG_FOLDER, LOG_NAME, BoundedJsonl, now_iso, read_lines
from ragline.flows.serve.query_service import ERRORS, ApiError, QueryService

FEEDBACK_FOLDER = Path(".ragline") / "feedback"
FEEDBACK_NAME = "feedback.jsonl"
FEEDBACK_BODY_BYTES = 16 * 1024
MAX_COMMENT_CHARS = 2000
MAX_CORRECTED = 20
MAX_ID_CHARS = 512
MAX_PER_ANSWER = 10
RATE_PER_SECOND, BURST = 20.0, 100
RATINGS = {"up": "up", "down": "down", 1: "up", -1: "down"}

AnswerId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
PassageId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer_id: AnswerId = Field(description="the answer's id (`answer_id` / X-Answer-ID of its response)")
    rating: Literal["up", "down", 1, -1] = Field(description="up or down (or 1 / -1)")
    comment: str = Field("", max_length=MAX_COMMENT_CHARS, description="what was wrong or right")
    corrected_passage_ids: list[PassageId] = Field(
        default_factory=list, max_length=MAX_CORRECTED,
        description="passages (chunk ids, or document ids) that answer the question: relevant in the export")

    @field_validator("rating", mode="before")
    @classmethod
    def _no_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # True == 1 in Python: a boolean is not a rating
            raise ValueError("expected 'up', 'down', 1 or -1")
        return value


class FeedbackCreated(BaseModel):
    feedback_id: str
    answer_id: str
    rating: Literal["up", "down"]
    known_answer: bool | None = Field(description="the query log has this answer (null: the log is off)")


class FeedbackStore:
    """The feedback file of one data dir: append-only, bounded, one writer lock."""

    def __init__(self, folder: Path, max_bytes: int, text: bool):
        self.path, self.text = folder / FEEDBACK_NAME, text
        self.file = BoundedJsonl(self.path, max_bytes=max(1, max_bytes // (BACKUPS + 1)), backups=BACKUPS)
        self._per_answer: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens, self._refilled = float(BURST), time.monotonic()

    def admit(self, answer_id: str) -> None:
        """The rate and per-answer limits (429 beyond them)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(BURST, self._tokens + (now - self._refilled) * RATE_PER_SECOND)
            self._refilled = now
            if self._tokens < 1:
                raise ApiError(429, "too much feedback at once: retry in a second", code="rate_limited",
                               headers={"Retry-After": "1"})
            if self._per_answer.get(answer_id, 0) >= MAX_PER_ANSWER:
                raise ApiError(429, f"field 'answer_id': answer {answer_id} was rated {MAX_PER_ANSWER} times "
                                    f"already (the last rating counts)", param="answer_id", code="too_many_ratings")
            self._tokens -= 1
            self._per_answer[answer_id] = self._per_answer.get(answer_id, 0) + 1
            self._per_answer.move_to_end(answer_id)
            while len(self._per_answer) > 100_000:
                self._per_answer.popitem(last=False)

    def append(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def close(self) -> None:
        self.file.close()


def feedback_router(service: QueryService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["feedback"])
    store = FeedbackStore(data_dir_of(service.project) / FEEDBACK_FOLDER,
                          int(settings.query_log().feedback_max_mb * 1024 * 1024), settings.query_log().query_log_text)

    @router.post("/feedback", status_code=201, response_model=FeedbackCreated, responses={**ERRORS, 429: ERRORS[400]},
                 summary="Rate an answer (thumbs up or down), optionally naming the passages that answer it")
    async def feedback(body: FeedbackRequest, request: Request) -> JSONResponse:
        principal = principal_of(request)
        if not principal.may("query"):  # rating answers is for those who may ask
            raise ApiError(403, "this credential lacks scope 'query': it may not rate answers", code="forbidden")
        known = None
        if service.query_log is not None:
            try:
                known = await asyncio.to_thread(service.query_log.knows, body.answer_id)
            except TimeoutError:  # the log's writer is behind (a slow disk): the answer may not be written yet
                raise ApiError(503, "the query log is behind: retry in a few seconds", "service_unavailable_error",
                               code="query_log_busy", headers={"Retry-After": "5"}) from None
            if not known:
                raise ApiError(404, f"field 'answer_id': no answer {body.answer_id} in the query log (unknown, or "
                                    f"older than its retention)", param="answer_id", code="answer_not_found")
        store.admit(body.answer_id)
        rating = RATINGS[body.rating]
        record = {"feedback_id": uuid.uuid4().hex, "time": now_iso(), "principal": principal.id,
                  "answer_id": body.answer_id, "rating": rating,
                  "corrected_passage_ids": body.corrected_passage_ids}
        if store.text and body.comment:
            record["comment"] = body.comment
        await asyncio.to_thread(store.append, record)
        return JSONResponse(FeedbackCreated(feedback_id=record["feedback_id"], answer_id=body.answer_id, rating=rating,
                                            known_answer=known).model_dump(), 201)

    return router


# ----------------------------------------------------------------------------- ragline feedback export
def joined(data_dir: Path) -> Iterator[dict[str, Any]]:
    """Every feedback record, oldest first, with the query it rates (``query``: the logged entry,
    null when the log is off or no longer has it)."""
    logged = {e["answer_id"]: e for e in read_lines(data_dir / LOG_FOLDER / LOG_NAME) if "answer_id" in e}
    for record in read_lines(data_dir / FEEDBACK_FOLDER / FEEDBACK_NAME):
        if isinstance(record.get("answer_id"), str):
            yield {**record, "query": logged.get(record["answer_id"])}


def judgements(record: dict[str, Any]) -> dict[str, int]:
    """Document id -> relevance from one rated answer: an answer rated up makes its cited documents
    relevant (1); a corrected passage (its document, when the log retrieved or cited it; else the
    id as given) is relevant either way; the documents a down-rated answer cited are not (0)."""
    query = record.get("query") or {}
    answer = query.get("answer") or {}
    docs = {p["chunk_id"]: p["doc_id"] for p in [*query.get("retrieved", []), *answer.get("sources", [])]
            if isinstance(p, dict) and "chunk_id" in p and "doc_id" in p}
    cited = [s["doc_id"] for s in answer.get("sources", []) if isinstance(s, dict) and "doc_id" in s]
    grades = {doc: 1 if record["rating"] == "up" else 0 for doc in cited}
    for passage in record.get("corrected_passage_ids") or []:
        grades[docs.get(passage, passage)] = 1
    return grades


def located(record: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Document id -> (source id, chunk id) of the passages the logged query retrieved or cited."""
    query = record.get("query") or {}
    passages = [*query.get("retrieved", []), *(query.get("answer") or {}).get("sources", [])]
    return {p["doc_id"]: (p["source_id"], p["chunk_id"]) for p in passages
            if isinstance(p, dict) and {"doc_id", "source_id", "chunk_id"} <= p.keys()}


def export_qrels(data_dir: Path, out_dir: Path, test_share: float = 0.3) -> dict[str, int]:
    """A BEIR-style folder of the rated answers: queries.jsonl, qrels/train.tsv and qrels/test.tsv
    (for `ragline eval --split`), ``train_pairs.jsonl`` (the train split as the (question, relevant
    source) pairs `ragline tune --set pairs.labelled=DIR` trains on) and ``feedback.json`` (no
    corpus: the documents are the index's). Only each answer's last rating counts; the same
    question (case and spaces aside) is one query, its judgements merged, and lands wholly in one
    split (chosen by its hash), so tuning never sees an evaluation question."""
    last = {r["answer_id"]: r for r in joined(data_dir)}
    questions: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    where: dict[str, dict[str, tuple[str, str]]] = {}
    skipped = {"no_question": 0, "no_relevant": 0}
    for record in last.values():
        question = ((record.get("query") or {}).get("question") or "").strip()
        if not question:
            skipped["no_question"] += 1
            continue
        qid = hashlib.sha256(" ".join(question.lower().split()).encode()).hexdigest()[:16]
        questions.setdefault(qid, question)
        merged = qrels.setdefault(qid, {})
        for doc, grade in judgements(record).items():
            merged[doc] = max(grade, merged.get(doc, 0))
        where.setdefault(qid, {}).update(located(record))
    kept = {q: docs for q, docs in qrels.items() if any(docs.values())}
    skipped["no_relevant"] = len(qrels) - len(kept)
    splits: dict[str, dict[str, dict[str, int]]] = {"train": {}, "test": {}}
    for qid, docs in kept.items():
        splits["test" if int(qid, 16) % 1000 < test_share * 1000 else "train"][qid] = docs
    (out_dir / "qrels").mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "queries.jsonl", "".join(json.dumps({"_id": q, "text": questions[q]}, ensure_ascii=False)
                                                    + "\n" for q in kept))
    for split, judged in splits.items():
        rows = [f"{q}\t{doc}\t{grade}\n" for q, docs in judged.items() for doc, grade in sorted(docs.items())]
        write_atomic(out_dir / "qrels" / f"{split}.tsv", "query-id\tcorpus-id\tscore\n" + "".join(rows))
    pairs = [{"text": questions[q], "source_id": where[q][doc][0], "chunk_id": where[q][doc][1], "strategy": "feedback"}
             for q, docs in splits["train"].items() for doc, grade in sorted(docs.items())
             if grade and doc in where[q]]
    write_atomic(out_dir / TRAIN_PAIRS, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    summary = {"rated_answers": len(last), "queries": len(kept), "train": len(splits["train"]), "train_pairs": len(pairs),
               "test": len(splits["test"]), **{f"skipped_{k}": v for k, v in skipped.items()}}
    write_atomic(out_dir / OWN_INDEX_MARKER, json.dumps({"corpus": "index", "data_dir": str(data_dir),
                                                         "test_share": test_share, **summary}, indent=2) + "\n")
    return summary
