"""ragline's own local Prefect API (flows/ops/prefect_server.py): nothing started when an API is
configured; a started server never outlives ragline (kill -9 included) and Ctrl-C ends a flow run
within seconds. The server tests run real servers in child processes; they share one database
folder so Prefect's migrations run once."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.data import REPO

STARTUP = 240  # seconds a child may take to start its server (first start migrates; slow machine)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_gone(pid: int, seconds: float) -> float | None:
    """Seconds until ``pid`` was gone, or None if it still runs after ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not _alive(pid):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def isolated_env(tmp_path_factory):
    """Environment for child processes: ragline's Prefect folder and Prefect's own home and profiles
    in a temporary folder, no configured API (so the children must start their own server)."""
    root = tmp_path_factory.mktemp("prefect-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(RAGLINE_HOME=str(root / "ragline-home"), PREFECT_HOME=str(root / "prefect-home"),
               PREFECT_PROFILES_PATH=str(root / "profiles.toml"), PYTHONPATH=str(REPO),
               OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    return env


def _spawn(code: str, env: dict[str, str]) -> subprocess.Popen:
    # A session of its own, as a terminal's foreground job: killpg(SIGINT) is the terminal's Ctrl-C.
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _read_until(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"child never printed {prefix!r} (exit {proc.returncode}): {out[-2000:]} {err[-4000:]}")


# ----------------------------------------------------------------------------- (c) configured API
def test_configured_api_url_starts_nothing(monkeypatch):
    from ragline.flows.ops import prefect_server

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    before = _children(os.getpid())
    with prefect_server.local_api() as url:
        assert url == "http://127.0.0.1:9/api"
        assert prefect_server.active_server() is None
        assert _children(os.getpid()) == before
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"


def test_api_url_from_prefect_profile_starts_nothing(tmp_path, isolated_env):
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    env = dict(isolated_env, PREFECT_PROFILES_PATH=str(profiles))
    code = """
        from ragline.flows.ops import prefect_server
        with prefect_server.local_api() as url:
            print(url, prefect_server.active_server())
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("http://127.0.0.1:9/api None"), done.stdout
    assert not (Path(env["RAGLINE_HOME"]) / "prefect").exists()  # no server, no database


def test_database_and_dashboard_follow_ragline_home(monkeypatch, tmp_path):
    from ragline.flows.ops import prefect_server

    monkeypatch.setenv("RAGLINE_HOME", str(tmp_path / "home"))
    assert prefect_server.prefect_home() == tmp_path / "home" / "prefect"
    assert prefect_server.database_url() == f"sqlite+aiosqlite:///{tmp_path}/home/prefect/prefect.db"
    assert prefect_server.database_url() in prefect_server.dashboard_command()


def test_interrupted_exit_prints_one_line(capfd, monkeypatch):
    from ragline.flows.ops import prefect_server

    monkeypatch.setattr(prefect_server, "_interrupt_reported", False)
    assert prefect_server.interrupted_exit() == 130
    assert prefect_server.interrupted_exit() == 130
    assert capfd.readouterr().err == "interrupted\n"


def test_interrupt_guard_restores_the_sigint_handler():
    from ragline.flows.ops import prefect_server

    before = signal.getsignal(signal.SIGINT)
    with prefect_server.interrupt_guard():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


# ----------------------------------------------------------------------------- started servers
@pytest.mark.integration
def test_flow_runs_are_recorded_in_raglines_database(isolated_env):
    """The client talks to ragline's server (Prefect's own temporary server never starts), the run
    is kept in $RAGLINE_HOME/prefect/prefect.db, and the server is gone after a normal exit."""
    proc = _spawn("""
        import os
        from prefect import flow, task
        from prefect.settings import PREFECT_API_URL
        from ragline.flows.ops import prefect_server

        @task
        def double(x):
            return 2 * x

        @flow(name="ragline-test-recorded")
        def small():
            return double.submit(21).result()

        with prefect_server.local_api() as url:
            server = prefect_server.active_server()
            print("SERVER", server.pid, url, PREFECT_API_URL.value(), os.environ["PREFECT_API_URL"], flush=True)
            print("RESULT", small(), flush=True)
        print("AFTER", os.environ.get("PREFECT_API_URL"), PREFECT_API_URL.value(), flush=True)
    """, isolated_env)
    out, err = proc.communicate(timeout=STARTUP + 120)
    assert proc.returncode == 0, err[-4000:]
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    pid, url, setting, environ = lines["SERVER"]
    assert url == setting == environ and url.startswith("http://127.0.0.1:")
    assert lines["RESULT"] == ["42"]
    assert lines["AFTER"] == ["None", "None"]  # settings restored
    assert "Starting temporary server" not in err
    assert _wait_gone(int(pid), 5) is not None
    db = Path(isolated_env["RAGLINE_HOME"]) / "prefect" / "prefect.db"
    with sqlite3.connect(db) as conn:
        states = conn.execute("SELECT fr.state_type FROM flow_run fr JOIN flow f ON f.id = fr.flow_id "
                              "WHERE f.name = 'ragline-test-recorded'").fetchall()
    assert states == [("COMPLETED",)]


@pytest.mark.integration
def test_a_server_that_misses_its_start_up_timeout_is_stopped(tmp_path):
    from ragline.flows.ops import prefect_server

    before = _children(os.getpid())
    server = prefect_server.LocalPrefectServer(home=tmp_path)
    with pytest.raises(prefect_server.ServerStartError, match="did not answer"):
        server.start(timeout=0.5)
    assert server.process is None and _children(os.getpid()) == before


@pytest.mark.integration
@pytest.mark.parametrize("where", ["main-thread", "other-thread"])
def test_server_dies_with_a_sigkilled_parent(isolated_env, where):
    """kill -9 of ragline: the parent-death signal (main thread) or the watchdog (entered from
    another thread, where PR_SET_PDEATHSIG is not armed) stops the server within seconds."""
    proc = _spawn(f"""
        import threading, time
        from ragline.flows.ops import prefect_server

        def hold():
            with prefect_server.local_api():
                print("SERVER", prefect_server.active_server().pid, flush=True)
                time.sleep(600)

        if {where!r} == "main-thread":
            hold()
        else:
            threading.Thread(target=hold, daemon=True).start()
            time.sleep(600)
    """, isolated_env)
    server_pid = int(_read_until(proc, "SERVER", STARTUP).split()[1])
    assert _alive(server_pid)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job, as `kill -9`; the server is in its own session
    proc.communicate(timeout=30)
    took = _wait_gone(server_pid, 15)
    if took is None:
        os.kill(server_pid, signal.SIGKILL)
    assert took is not None, f"the Prefect server {server_pid} outlived its SIGKILLed parent"


_INTERRUPTIBLE_CLI = """
    import sys, time
    from prefect import flow, task
    from ragline.flows.ops import prefect_server

    STEP_SECONDS = float(sys.argv[1])

    @task
    def step(i):
        time.sleep(STEP_SECONDS)  # in a worker thread: SIGINT cannot stop it
        return i

    @flow(name=sys.argv[2])
    def long_flow():
        print("RUNNING", flush=True)
        return [step.submit(i).result() for i in range(1000)]

    def main():  # what flows/cli.py does
        with prefect_server.interrupt_guard():
            try:
                with prefect_server.local_api():
                    print("SERVER", prefect_server.active_server().pid, flush=True)
                    long_flow()
            except KeyboardInterrupt:
                return prefect_server.interrupted_exit()
        return 0

    sys.exit(main())
"""


@pytest.mark.integration
@pytest.mark.parametrize("step_seconds", [0.3, 120.0], ids=["short-steps", "stuck-step"])
def test_ctrl_c_during_a_flow_run_exits_promptly(isolated_env, step_seconds):
    """SIGINT to the job's process group mid-run (the terminal's Ctrl-C): the server survives it
    (own session) and records the run as Crashed; the process prints one `interrupted` line and
    exits 130 within seconds, also when a task thread is stuck (Prefect's task runner would join
    it for its full two minutes), and no server is left."""
    name = f"ragline-test-interrupted-{int(step_seconds)}"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_INTERRUPTIBLE_CLI), str(step_seconds), name],
                            cwd=REPO, env=isolated_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    server_pid = int(_read_until(proc, "SERVER", STARTUP).split()[1])
    _read_until(proc, "RUNNING", 120)
    time.sleep(1.5)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running 60 s after SIGINT: {err[-4000:]}")
    took = time.monotonic() - start
    assert proc.returncode == 130, err[-4000:]
    assert took < 10, f"{took:.1f} s to exit after SIGINT: {err[-4000:]}"
    assert err.rstrip().splitlines()[-1] == "interrupted"
    assert err.count("interrupted\n") == 1 and "Crash detected" not in err, err[-4000:]
    assert "Connection refused" not in err and "All connection attempts failed" not in err, err[-4000:]
    assert _wait_gone(server_pid, 5) is not None
    db = Path(isolated_env["RAGLINE_HOME"]) / "prefect" / "prefect.db"
    with sqlite3.connect(db) as conn:
        states = conn.execute("SELECT fr.state_type FROM flow_run fr JOIN flow f ON f.id = fr.flow_id "
                              "WHERE f.name = ?", (name,)).fetchall()
    assert states == [("CRASHED",)]  # the crash report reached the (still running) server
