"""The Python prelude of child processes that must not outlive ragline (the packaged vLLM server,
the local Prefect server): it arms the Linux parent-death signal and closes the fork/prctl race.

A wrapper run as ``python -c PRELUDE + script``, not ``preexec_fn`` (unsafe with threads); the
signal survives ``exec``, so a child that execs another program (serve.sh, then vLLM) keeps it.
"""
from __future__ import annotations

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
