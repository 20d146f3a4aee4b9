"""The Python prelude of child processes that must not outlive ragline (the packaged vLLM server,
the local Prefect server): it arms the Linux parent-death signal and closes the fork/prctl race.

A wrapper run as ``python -c PRELUDE + script``, not ``preexec_fn`` (unsafe with threads); the
signal survives ``exec``, so a child that execs another program (serve.sh, then vLLM) keeps it.
"""
from __future__ import annotations

from ragline.flows.processes import parent_pid

PRELUDE = r"""
import os, signal, sys

def _arm_parent_death(parent, pdeathsig):
    # SIGTERM when the parent dies (Linux); exit now if it died before the signal was armed.
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent:
        os._exit(0)
"""


def die_with(parent: int, sig: int = 9) -> None:
    """In a direct child of ``parent``: arm the parent-death signal (``sig``, SIGKILL by default: a
    hung process never acts on SIGTERM), and exit now if the parent already died (the child was
    reparented before the signal was armed). In a child of ``parent``'s forkserver (a warm flow run,
    flows/serve/supervise/warm.py) the signal is armed on the forkserver, which exits when ``parent`` does. In
    ``parent`` itself, or in a process that is neither, nothing happens. Linux only (elsewhere
    nothing happens)."""
    import os
    import sys

    if not sys.platform.startswith("linux") or os.getpid() == parent:
        return
    if os.getppid() != parent and parent_pid(os.getppid()) == parent and is_forkserver(os.getppid()):
        parent = os.getppid()
    if os.getppid() == parent:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == parent:
            return
    try:
        os.kill(parent, 0)
    except ProcessLookupError:  # reparented: the parent died before the signal was armed
        os._exit(1)
    except PermissionError:
        pass


class DiesWith:
    """A marker that calls :func:`die_with` wherever it is unpickled. Attached to the flow that
    ``ragline serve`` runs, it arms the signal in each flow-run process as Prefect's runner starts
    it (``multiprocessing`` spawn: the flow is unpickled first thing in the child, before the engine
    starts), so that a ``kill -9`` of serve takes its flow runs with it. PR_SET_PDEATHSIG fires when
    the *thread* that started the child ends: serve's runner thread lives as long as its runs."""

    def __init__(self, parent: int):
        self.parent = parent

    def __reduce__(self):
        return _unpickle_dies_with, (self.parent,)


def _unpickle_dies_with(parent: int) -> DiesWith:
    die_with(parent)
    return DiesWith(parent)


def is_forkserver(pid: int) -> bool:
    """Whether ``pid`` runs multiprocessing's forkserver (its command line names it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.forkserver" in handle.read()
    except OSError:
        return False
