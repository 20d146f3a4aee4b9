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
the two files (``flows/evaluation/feedback.py``).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from ragline.flows import settings
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.serve.query_log import BACKUPS, BoundedJsonl, now_iso
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
                          int(settings.get("feedback_max_mb") * 1024 * 1024), settings.get("query_log_text"))

    @router.post("/feedback", status_code=201, response_model=FeedbackCreated, responses={**ERRORS, 429: ERRORS[400]},
                 summary="Rate an answer (thumbs up or down), optionally naming the passages that answer it")
    async def feedback(body: FeedbackRequest) -> JSONResponse:
        known = None
        if service.query_log is not None:
            known = await asyncio.to_thread(service.query_log.knows, body.answer_id)
            if not known:
                raise ApiError(404, f"field 'answer_id': no answer {body.answer_id} in the query log (unknown, or "
                                    f"older than its retention)", param="answer_id", code="answer_not_found")
        store.admit(body.answer_id)
        rating = RATINGS[body.rating]
        record = {"feedback_id": uuid.uuid4().hex, "time": now_iso(), "answer_id": body.answer_id, "rating": rating,
                  "corrected_passage_ids": body.corrected_passage_ids}
        if store.text and body.comment:
            record["comment"] = body.comment
        await asyncio.to_thread(store.append, record)
        return JSONResponse(FeedbackCreated(feedback_id=record["feedback_id"], answer_id=body.answer_id, rating=rating,
                                            known_answer=known).model_dump(), 201)

    return router
