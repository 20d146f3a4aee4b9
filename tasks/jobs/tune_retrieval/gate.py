"""Answerability gates' thresholds from the pseudo-queries (answerable by construction) and the gate's
own LLM check."""
from __future__ import annotations

from typing import Any

import numpy as np

from ragline.flows.contracts import GateCalibration, PseudoQuery
from ragline.flows.resources.models.llm import LLMClient
from ragline.tasks.generate.answerable import kept_floor, probability
from ragline.tasks.ingest.pseudo_queries import without
from ragline.flows.contracts import ContextDocument, Passage
from ragline.flows.resources.models.llm_output import clip
from ragline.tasks.jobs.tune_retrieval.params import GATE_DOCUMENTS
from ragline.tasks.jobs.tune_retrieval.rankings import Corpus, Rankings
from ragline.tasks.jobs.tune_retrieval.targets import Target


def gate_similarities(pairs: list[PseudoQuery], similarity: list[float | None]) -> list[float | None]:
    """The source similarities the gate's floor comes from: of the pairs worded like a question or
    a sentence (keyword queries are terse, so their similarities are far lower than a real
    question's: with them the floor refused nothing off-topic); all when too few are left."""
    worded = [s for p, s in zip(pairs, similarity) if p.strategy != "keywords"]
    return worded if sum(s is not None for s in worded) >= 20 else similarity


def calibrate_gate(probabilities: tuple[list[float], list[float]], keep: float, min_refusal: float) -> GateCalibration:
    """The threshold ``keep`` of the answerable pseudo-queries clear, what it refuses of the
    unanswerable ones, the check's AUC, and whether that is worth a call per question."""
    answerable, unanswerable = probabilities
    threshold = kept_floor(answerable, keep)
    calibration = GateCalibration(pairs=len(answerable), threshold=threshold, auc=auc(answerable, unanswerable))
    if threshold is None:
        calibration.reason = f"too few pseudo-queries ({len(answerable)}; 20 or more place the threshold)"
        return calibration
    calibration.refused_unanswerable = round(float(np.mean([u < threshold for u in unanswerable])), 4)
    calibration.refused_answerable = round(float(np.mean([a < threshold for a in answerable])), 4)
    calibration.enabled = calibration.refused_unanswerable >= min_refusal
    calibration.reason = (f"at {threshold:.3f} the check refuses {calibration.refused_unanswerable:.0%} of the "
                          f"pseudo-queries asked without their source and {calibration.refused_answerable:.0%} with it "
                          f"(AUC {calibration.auc:.2f}): "
                          + ("set" if calibration.enabled else f"left off (under {min_refusal:.0%})"))
    return calibration


def auc(positive: list[float], negative: list[float]) -> float | None:
    """The chance that a positive scores above a negative (ties count half): 1.0 separates them
    perfectly, 0.5 is chance; None without both."""
    pairs = [(p > n) + 0.5 * (p == n) for p in positive for n in negative]
    return round(sum(pairs) / len(pairs), 4) if pairs else None


def gate_probabilities(pairs: list[PseudoQuery], corpus: "Corpus", cache: "Rankings", llm: LLMClient,
                       project: Any, target: Target, n: int) -> tuple[list[float], list[float]]:
    """P(answerable) from ``target``'s gate, asked exactly as it asks (its prompt, its clipping) for
    up to ``n`` pseudo-queries, questions first (LLM-written, then titles, then inverse cloze): with
    the query's source chunk (without the cut) among the closest chunks of other documents (its
    place varies, so a model's position bias does not set the threshold), and with those only."""

    step = project.pipeline(target.pipeline).step(target.gate)
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    rank = {"llm": 0, "title": 1}

    def prompt(question: str, texts: list[str]) -> str:
        documents = [ContextDocument(number=k, passage=Passage(chunk_id=str(k), source_id=str(k), text=t))
                     for k, t in enumerate(texts, start=1)]
        return project.prompts.render(step.prompt, question=clip(question, step.params.max_request_chars),
                                      documents=documents)

    with_source, without_source = [], []
    for i in sorted(range(len(pairs)), key=lambda i: rank.get(pairs[i].strategy, 2))[:n]:
        pair = pairs[i]
        source = corpus.doc_index[pair.source_id]
        own = position.get(pair.chunk_id, corpus.chunks_of[source][0])
        texts = [corpus.texts[c] for c in closest_of_other_documents(cache.dense[i], corpus.docs, source)]
        without_source.append(prompt(pair.text, texts))
        texts = texts[:GATE_DOCUMENTS - 1]
        texts.insert(i % (len(texts) + 1), without(corpus.texts[own], pair.cut))
        with_source.append(prompt(pair.text, texts))
    values = llm.map(lambda text: probability(llm, text), with_source + without_source)
    return values[:len(with_source)], values[len(with_source):]


def closest_of_other_documents(ranking: list[tuple[int, float]], docs: np.ndarray, source: int,
                               n: int = GATE_DOCUMENTS) -> list[int]:
    """The best-ranked chunk of each of the first ``n`` documents in ``ranking`` other than ``source``."""
    seen, chunks = {source}, []
    for chunk, _ in ranking:
        doc = int(docs[chunk])
        if doc not in seen:
            seen.add(doc)
            chunks.append(chunk)
            if len(chunks) == n:
                break
    return chunks
