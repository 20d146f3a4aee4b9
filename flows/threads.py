"""Waiting for work on a thread of its own, for as long as the caller chooses.

Python cannot stop a thread: work given up on finishes in the background, unused, on a daemon
thread (so it never holds the process open). Used for a step's ``timeout_seconds`` and for an LLM
request watched while its server's health is checked.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str) -> Future:
    """``fn()`` started on a daemon thread named ``name``; its outcome, to wait for with a timeout."""
    outcome: Future = Future()

    def target() -> None:
        try:
            outcome.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            outcome.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return outcome


def call_with_timeout(fn: Callable[[], T], seconds: float, name: str) -> T:
    """``fn()``, or ``TimeoutError`` after ``seconds`` (``fn`` goes on in the background, unused)."""
    return on_own_thread(fn, name).result(timeout=seconds)
