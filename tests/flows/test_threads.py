"""The one thread-timeout helper (steps' timeout_seconds, watched LLM requests)."""
import threading

import pytest

from ragline.flows.threads import call_with_timeout, on_own_thread


def test_a_result_or_an_error_is_handed_back():
    assert call_with_timeout(lambda: 42, 5, "t") == 42
    with pytest.raises(KeyError, match="gone"):
        call_with_timeout(lambda: {}["gone"], 5, "t")


def test_a_late_call_times_out_and_finishes_in_the_background():
    """Event order, not wall time: the timeout is raised while the call is still held."""
    release, finished = threading.Event(), threading.Event()

    def slow():
        release.wait(30)
        finished.set()

    with pytest.raises(TimeoutError):
        call_with_timeout(slow, 0.1, "ragline-slow")
    assert not finished.is_set()
    release.set()
    assert finished.wait(5)  # left to run, on a daemon thread that never holds the process open


def test_the_thread_is_a_named_daemon():
    seen = on_own_thread(lambda: (threading.current_thread().name, threading.current_thread().daemon), "ragline-x")
    assert seen.result(5) == ("ragline-x", True)
