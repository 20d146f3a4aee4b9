"""``GET /metrics``: the Prometheus text format of ``flows/telemetry.py``'s registry, plus what is
read when scraped: per index (its collection, for each ingestion pipeline that writes it) the
documents and chunks its state DB holds, the age of its newest indexed change (ingestion lag),
and when each ingestion pipeline last succeeded, on its schedule and at all
(``entrypoints.record_success``).

Authentication: the same bearer token as ``/v1`` unless ``RAGLINE_METRICS_PUBLIC=1`` (a scraper can
send the token: Prometheus' ``authorization`` in its scrape config); without a token the loopback
Host rules of every route apply. ``RAGLINE_METRICS=0``: no route, nothing recorded.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ragline.flows import telemetry
from ragline.flows.run.check import indexes
from ragline.flows.run.entrypoints import LAST_SCHEDULED_SUCCESS, LAST_SUCCESS
from ragline.flows.spec.compile import Project

log = logging.getLogger("ragline.api")


class IndexCollector(Collector):
    """Index gauges of every project an app of this process serves, read from the state DBs at
    each scrape (a COUNT and a MAX on SQLite: milliseconds). Registered once per process."""

    def __init__(self) -> None:
        self.projects: dict[int, Project] = {}
        self._lock = threading.Lock()

    def watch(self, key: int, project: Project | None) -> None:
        with self._lock:
            if project is None:
                self.projects.pop(key, None)
            else:
                self.projects[key] = project

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["pipeline", "collection"]
        documents = GaugeMetricFamily("ragline_index_documents", "source documents in the index", labels=labels)
        chunks = GaugeMetricFamily("ragline_index_chunks", "chunks in the index", labels=labels)
        lag = GaugeMetricFamily("ragline_ingestion_lag_seconds", "age of the newest indexed change (the most "
                                "recently (re)indexed document)", labels=labels)
        last = GaugeMetricFamily("ragline_ingestion_last_success_timestamp_seconds", "when an ingestion pipeline last "
                                 "succeeded (trigger: scheduled, by its deployment's schedule; any)",
                                 labels=["pipeline", "trigger"])
        seen: set[tuple[str, ...]] = set()
        with self._lock:  # the newest app first: two apps of one process (tests) naming the same series
            projects = list(reversed(self.projects.values()))
        now = time.time()
        for project in projects:
            for index, collection, (n_docs, n_chunks), newest, meta in index_facts(project, "metrics"):
                for pipeline in index.pipelines:
                    if (pipeline, collection) in seen:
                        continue
                    seen.add((pipeline, collection))
                    documents.add_metric([pipeline, collection], n_docs)
                    chunks.add_metric([pipeline, collection], n_chunks)
                    if newest is not None:
                        lag.add_metric([pipeline, collection], max(0.0, now - newest))
                    for trigger, prefix in (("scheduled", LAST_SCHEDULED_SUCCESS), ("any", LAST_SUCCESS)):
                        if (value := meta.get(prefix + pipeline)) is not None:
                            last.add_metric([pipeline, trigger], value)
        yield from (documents, chunks, lag, last)

    def describe(self) -> list:
        return []  # read at scrape time only: never while registering


IndexFacts = tuple[Any, str, tuple[int, int], float | None, dict[str, float]]


def index_facts(project: Project, reader: str) -> Iterator[IndexFacts]:
    """(index, collection, (documents, chunks), newest change, last successes) of each of the
    project's indexes that has a state to read: a COUNT and a few keys. ``/metrics`` and ``ragline
    report`` show what they can: an index that cannot be read is left out (logged as ``reader``)."""
    for index in indexes(project):
        try:
            found = _read(project, index)
        except Exception as exc:  # noqa: BLE001 - a scrape or a page shows what it can
            log.debug("%s: could not read index %s: %s", reader, index.state, exc)
            continue
        if found is not None:
            yield (index, *found)


def _read(project: Project, index: Any) -> tuple[str, tuple[int, int], float | None, dict[str, float]] | None:
    state = project.resource(index.state)
    if not state.exists():
        return None
    collection = getattr(project.resource(index.store).spec, "collection", None) or index.store
    meta = {}
    for pipeline in index.pipelines:
        for prefix in (LAST_SUCCESS, LAST_SCHEDULED_SUCCESS):
            value = state.get_meta(prefix + pipeline)
            if value is not None:
                meta[prefix + pipeline] = float(value)
    return str(collection), state.counts(), state.newest_indexed_at(), meta


INDEXES = IndexCollector()
telemetry.REGISTRY.register(INDEXES)


def metrics_router() -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
    def metrics() -> Response:  # a plain def: the index reads run on a worker thread, not the event loop
        return Response(generate_latest(telemetry.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return router
