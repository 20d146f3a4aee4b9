"""The cross-encoder resource under concurrent use: parallel query pipelines share one model, whose
fast tokenizer keeps truncation and padding as mutable state, so predict calls must not interleave."""
from __future__ import annotations

import threading
import time

from ragline.flows.resources.models.cross_encoder import CrossEncoderModel, CrossEncoderSpec


def fresh(folder) -> CrossEncoderModel:
    # a short max_length, so long passages are truncated and batches pad to different lengths
    return CrossEncoderModel(CrossEncoderSpec(type="cross_encoder", model=str(folder), max_length=24, batch_size=4))


def workload(n: int) -> list[tuple[str, list[str]]]:
    """Different queries with passages of very different lengths, some far past max_length."""
    return [(f"question {i} about topic {i % 3}",
             [" ".join(f"word{j}" for j in range(1 + (i * 7 + k * 13) % 60)) for k in range(3 + i % 5)])
            for i in range(n)]


def concurrently(model: CrossEncoderModel, jobs: list[tuple[str, list[str]]]) -> list:
    """Score every job in its own thread, all released at once; an exception is kept as the result."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        start.wait()
        try:
            results[i] = model.score(*jobs[i])
        except BaseException as exc:  # noqa: BLE001 - compared (and so reported) by the caller
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return results


def test_concurrent_scores_equal_sequential_scores(tiny_cross_encoder_dir):
    jobs = workload(8)
    expected = [fresh(tiny_cross_encoder_dir).score(query, texts) for query, texts in jobs]
    for _ in range(3):  # fresh models: their first calls are the ones that set the tokenizer's state
        assert concurrently(fresh(tiny_cross_encoder_dir), jobs) == expected


def test_predict_calls_never_overlap(tiny_cross_encoder_dir):
    model = fresh(tiny_cross_encoder_dir)
    predict, active, peak, lock = model.model.predict, [0], [0], threading.Lock()

    def watched(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)  # long enough that unserialised calls would overlap
            return predict(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    model.model.predict = watched
    jobs = workload(6)
    assert concurrently(model, jobs) == [fresh(tiny_cross_encoder_dir).score(*job) for job in jobs]
    assert peak[0] == 1


def test_empty_input_scores_nothing(tiny_cross_encoder_dir):
    assert fresh(tiny_cross_encoder_dir).score("anything", []) == []
