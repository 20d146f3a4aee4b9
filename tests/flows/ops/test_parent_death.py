"""flows/ops/parent_death.py's DiesWith: what makes serve's flow-run processes die with it (issue 16.11)."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from tests.fake_vllm import REPO

# The parent starts a child, writes the child's pid, then waits or exits; the child unpickles the
# marker (as a flow-run process unpickles the served flow) and reports that it is still running.
PARENT = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
print(child.pid, flush=True)
if sys.argv[3] == "wait":
    time.sleep(60)
"""
CHILD = r"""
import os, pickle, sys, time
from ragline.flows.ops.parent_death import DiesWith
parent = int(sys.argv[2])
time.sleep(float(sys.argv[1]))  # the parent may be gone by now
pickle.loads(pickle.dumps(DiesWith(parent)))
print("armed", flush=True)
time.sleep(30)
"""


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _family(delay: float, parent_waits: bool) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(delay), "wait" if parent_waits else "exit"],
                              stdout=subprocess.PIPE, text=True, env=env)
    return parent, int(parent.stdout.readline())


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_child_dies_when_its_parent_is_killed():
    parent, child = _family(delay=0.0, parent_waits=True)
    assert parent.stdout.readline() == "armed\n"  # the child shares its parent's stdout: armed, not "by now"
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone_within(child, 5)


def test_a_child_whose_parent_died_before_it_was_armed_exits_at_once():
    parent, child = _family(delay=1.0, parent_waits=False)
    parent.wait()
    assert _gone_within(child, 5)  # it would sleep 30 s were the late arming not checked


def test_unpickled_in_the_parent_itself_nothing_happens():
    from ragline.flows.ops.parent_death import DiesWith

    assert isinstance(pickle.loads(pickle.dumps(DiesWith(os.getpid()))), DiesWith)  # and we are still here


# A serve-like parent whose child is forked by its forkserver (flows/serve/supervise/warm.py): the child's
# parent is the forkserver, which exits when the parent does; the child arms its signal on it.
WARM_PARENT = r"""
import os, pickle, sys, time
from ragline.flows.serve.supervise.warm import warm_flow_runs
import prefect.flow_engine as engine

def child(parent):
    from ragline.flows.ops.parent_death import DiesWith
    pickle.loads(pickle.dumps(DiesWith(parent)))
    time.sleep(30)

if __name__ == "__main__":
    with warm_flow_runs(["json"]) as warm:
        assert warm
        process = engine.multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),))
        process.start()
        print(process.pid, flush=True)
        time.sleep(60)
"""


@pytest.mark.integration  # a forkserver, a warm flow run and a killed serve: real processes
def test_a_warm_flow_run_forked_by_the_forkserver_dies_when_serve_is_killed(tmp_path):
    script, out = tmp_path / "warm_parent.py", tmp_path / "pids"
    script.write_text(WARM_PARENT)
    with open(out, "w") as handle:  # a file, not a pipe: nothing here may end the family but the kill
        parent = subprocess.Popen([sys.executable, str(script)], stdout=handle, stderr=subprocess.DEVNULL,
                                  env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 60
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(out.read_text())
    forkserver = _parent(child)
    assert forkserver != parent.pid and _parent(forkserver) == parent.pid
    time.sleep(1.5)  # armed by now
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone_within(forkserver, 5) and _gone_within(child, 5)


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_the_forkserver_prelude_arms_the_parent_death_signal_only_in_a_forkserver():
    """Multiprocessing's forkserver outlives its parent while any process it forked holds its pipe:
    the prelude it imports first arms its parent-death signal on its parent (serve). Imported in any
    other process (its command line does not run multiprocessing's forkserver), it does nothing."""
    probe = ("import ctypes; import ragline.flows.serve.supervise.forkserver_prelude; "
             "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)")

    def armed(code: str) -> int:
        return int(subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                                  capture_output=True, text=True, check=True).stdout)

    # a command line that names the forkserver, as multiprocessing's does ("from multiprocessing.forkserver import main")
    assert armed("import multiprocessing.forkserver; " + probe) == signal.SIGKILL
    assert armed(probe) == 0
