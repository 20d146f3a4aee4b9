"""bench/scale.py reads a process's CPU time and memory from /proc with one reader (``process_usage``):
the managed server's, and (``engine_usage``) every live child's, such as milvus-lite's engine."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from tests.helpers.bench import bench_module


@pytest.fixture(scope="module")
def scale():
    with bench_module("scale") as module:
        yield module


def test_process_usage_reads_this_process_as_the_kernel_counts_it(scale):
    before = time.process_time()
    while time.process_time() - before < 0.3:  # some CPU of our own
        pass
    cpu, rss = scale.process_usage(os.getpid())
    _, peak = scale.process_usage(os.getpid(), memory="VmHWM")
    assert cpu == pytest.approx(time.process_time(), abs=0.1) and cpu >= 0.3
    # the kernel batches each thread's page counts, so its two peak figures may differ by a few pages
    assert 0 < rss <= peak and abs(peak - resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024) <= 1
    with pytest.raises(OSError):
        scale.process_usage(2 ** 22 + 1)  # above pid_max: no such process


def test_engine_usage_counts_live_children_only(scale):
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(60)"
    others, others_rss = scale.engine_usage()  # children a session fixture may hold (servers)
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        deadline = time.monotonic() + 20
        while (usage := scale.engine_usage())[0] < others + 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        cpu, rss = usage
        assert cpu >= others + 0.3 and rss > others_rss
    finally:
        child.kill()
        child.wait()
    assert scale.engine_usage()[0] < cpu - 0.2  # the ended child counts no more


def test_the_words_stand_in_gives_texts_that_share_words_near_vectors():
    """bench/scale.py's stand-in embedder: HNSW needs neighbourhoods (random vectors make every insert
    near a scan), so texts that share words must be nearer each other than unrelated texts."""
    import numpy as np

    from tests.helpers.hash_embed import random_vector, words_vector

    base = "Vitamin D deficiency lowers bone density in older adults (12)."
    edited = "Vitamin D deficiency lowers bone density in older adults (13). Edited."
    other = "Antibiotic resistance genes spread between gut bacteria by plasmids."
    vectors = {text: words_vector(text, 384) for text in (base, edited, other)}
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 and v.dtype == np.float32 for v in vectors.values())
    assert np.array_equal(words_vector(base, 384), vectors[base])  # the same text, the same vector
    near, far = vectors[base] @ vectors[edited], vectors[base] @ vectors[other]
    assert near > 0.8 and abs(far) < 0.3
    assert abs(random_vector(base, 384) @ random_vector(edited, 384)) < 0.3  # random: nothing is near
    assert abs(np.linalg.norm(words_vector("", 8)) - 1) < 1e-5  # no words: still a unit vector
