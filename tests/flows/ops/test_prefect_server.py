"""ragline's own local Prefect API (flows/ops/prefect_server.py): nothing started when an API is
configured; a started server never outlives ragline (kill -9 included) and Ctrl-C ends a flow run
within seconds. The server tests run real servers in child processes; they share one database
folder so Prefect's migrations run once."""
from __future__ import annotations

import json
import os
import shutil
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
    env = dict(isolated_env, PREFECT_PROFILES_PATH=str(profiles), RAGLINE_HOME=str(tmp_path / "ragline-home"))
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
    assert not (Path(isolated_env["RAGLINE_HOME"]) / "prefect" / "server.json").exists()  # idle 0: not shared
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


# ----------------------------------------------------------------------------- a shared server (idle timeout)
# The CLI's default: the first command that needs a Prefect API starts ragline's local server detached
# and records it in $RAGLINE_HOME/prefect/server.json; later commands reuse it; it stops itself once no
# command has held its lease for RAGLINE_PREFECT_IDLE_SECONDS. These tests stop what they start.
_STAGES = '''
from pydantic import BaseModel
from ragline.flows.contracts import Passage, Ranking
from ragline.flows.spec.registry import stage


class Params(BaseModel):
    pass


@stage("echo", params=Params, produces="rankings", kind="query")
def echo(query, params, ctx):
    return [Ranking(retriever=ctx.step_id, query=query.text,
                    passages=[Passage(chunk_id="c1", source_id="s1", text=query.text)])]
'''
_PIPELINES = """
pipelines:
  echo:
    kind: query
    steps:
      - {id: echo, task: echo_stages.echo}
      - {id: join, task: fuse}
"""
# The command, then the web framework it imported, if any (a flow run needs none: issue 22 item 5)
_CLI = ("import sys\nfrom ragline.flows.cli import main\ncode = main()\n"
        "print('fastapi imported' if 'fastapi' in sys.modules else 'no fastapi', file=sys.stderr)\nsys.exit(code)")


@pytest.fixture
def echo_project(tmp_path):
    """A project whose one query pipeline needs no model: `ragline run echo` is a cheap flow run."""
    (tmp_path / "echo_stages.py").write_text(_STAGES)
    (tmp_path / "pyproject.toml").write_text('[tool.ragline]\nallow_modules = ["echo_stages"]\n')
    (tmp_path / "pipelines.yaml").write_text(_PIPELINES)
    return tmp_path


@pytest.fixture
def shared_env(isolated_env, echo_project):
    """The module's environment with a shared server (idle timeout 600 s); whatever server the test
    left is stopped afterwards."""
    from ragline.flows.ops import prefect_server

    env = dict(isolated_env, RAGLINE_PREFECT_IDLE_SECONDS="600",
               PYTHONPATH=f"{echo_project}{os.pathsep}{isolated_env['PYTHONPATH']}")
    home = Path(env["RAGLINE_HOME"]) / "prefect"
    yield env
    record = prefect_server.read_record(home)
    prefect_server.stop_shared_server(home)
    if record is not None and _alive(record.pid):
        os.kill(record.pid, signal.SIGKILL)


def _ragline(env: dict[str, str], cwd: Path, *args: str, timeout: float = STARTUP + 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CLI, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _echo(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    done = _ragline(env, cwd, "run", "echo", "--input", '{"query": {"text": "hello"}}')
    assert done.returncode == 0, done.stderr[-4000:]
    assert '"text": "hello"' in done.stdout
    return done


def _record(env: dict[str, str]) -> dict:
    return json.loads((Path(env["RAGLINE_HOME"]) / "prefect" / "server.json").read_text())


def test_a_record_of_a_dead_process_is_not_reused(tmp_path):
    """A stale server.json (its server was killed) is never taken for a running server."""
    from ragline.flows.ops import prefect_server

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:9/api", "pid": gone.pid, "port": 9,
                                                      "started": time.time(), "database": "x"}))
    assert prefect_server.read_record(tmp_path).pid == gone.pid
    assert prefect_server.healthy_record(tmp_path, "x") is None
    assert prefect_server.stop_shared_server(tmp_path).startswith("no local Prefect server")
    assert not (tmp_path / "server.json").exists()


@pytest.mark.integration
def test_a_second_command_reuses_the_first_commands_server(shared_env, echo_project):
    first = _echo(shared_env, echo_project)
    record = _record(shared_env)
    assert "Prefect API: started ragline's local server at " + record["url"] in first.stderr
    assert _alive(record["pid"])  # it outlived the command that started it
    started = time.monotonic()
    second = _echo(shared_env, echo_project)
    reused_in = time.monotonic() - started
    assert f"Prefect API: reusing ragline's local server at {record['url']} (idle timeout 10 min)" in second.stderr
    assert _record(shared_env) == record  # the same server: no second start
    assert "no fastapi" in second.stderr  # a warm command imports only what its flow run needs
    db = Path(shared_env["RAGLINE_HOME"]) / "prefect" / "prefect.db"
    with sqlite3.connect(db) as conn:  # the dashboard's view of both runs: state, parameters, labels
        runs = conn.execute("SELECT fr.state_type, fr.parameters, fr.labels FROM flow_run fr JOIN flow f "
                            "ON f.id = fr.flow_id WHERE f.name = 'ragline' ORDER BY fr.created").fetchall()
    assert [state for state, _, _ in runs] == ["COMPLETED", "COMPLETED"]
    parameters, labels = json.loads(runs[-1][1]), json.loads(runs[-1][2])
    assert parameters["pipeline"] == "echo" and parameters["inputs"]["query"]["text"] == "hello"
    assert labels["ragline.access"] == "*"
    status = _ragline(shared_env, echo_project, "prefect", "status", timeout=60)
    assert status.returncode == 0 and f"pid {record['pid']}" in status.stdout, status.stderr
    stop = _ragline(shared_env, echo_project, "prefect", "stop", timeout=60)
    assert stop.returncode == 0 and f"stopped ragline's local Prefect server (pid {record['pid']}, {record['url']})" in stop.stdout
    assert _wait_gone(record["pid"], 5) is not None
    assert not (Path(shared_env["RAGLINE_HOME"]) / "prefect" / "server.json").exists()
    print(f"second command with a reused server: {reused_in:.1f} s")


@pytest.mark.integration
def test_an_idle_server_stops_only_once_no_command_holds_its_lease(shared_env, echo_project):
    import fcntl

    env = dict(shared_env, RAGLINE_PREFECT_IDLE_SECONDS="6")  # 3 s ran out between the command and the lease on a loaded CI
    _echo(env, echo_project)
    lease = Path(env["RAGLINE_HOME"]) / "prefect" / "lease"
    with open(lease, "a+") as handle:  # what a running command holds: the server waits for it
        fcntl.flock(handle, fcntl.LOCK_SH)
        pid = _record(env)["pid"]
        time.sleep(10)
        assert _alive(pid), "the server stopped while a command held its lease"
    took = _wait_gone(pid, 30)
    assert took is not None, "the idle server did not stop"
    assert not (Path(env["RAGLINE_HOME"]) / "prefect" / "server.json").exists()


@pytest.mark.integration
def test_a_killed_server_is_replaced_by_the_next_command(shared_env, echo_project):
    _echo(shared_env, echo_project)
    killed = _record(shared_env)["pid"]
    os.kill(killed, signal.SIGKILL)
    assert _wait_gone(killed, 10) is not None
    again = _echo(shared_env, echo_project)
    assert "Prefect API: started ragline's local server" in again.stderr
    assert _record(shared_env)["pid"] != killed and _alive(_record(shared_env)["pid"])


@pytest.mark.integration
def test_two_first_commands_at_once_start_one_server(shared_env, echo_project):
    commands = [subprocess.Popen([sys.executable, "-c", _CLI, "run", "echo", "--input", '{"query": {"text": "hello"}}'],
                                 cwd=echo_project, env=shared_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(2)]
    errors = []
    for command in commands:
        out, err = command.communicate(timeout=STARTUP + 120)
        assert command.returncode == 0, err[-4000:]
        errors.append(err)
    record = _record(shared_env)
    assert sum("Prefect API: started" in err for err in errors) == 1, errors
    assert sum(f"Prefect API: reusing ragline's local server at {record['url']}" in err for err in errors) == 1
    assert _alive(record["pid"])


@pytest.mark.integration
def test_the_shared_server_requires_its_secret_and_stops_when_its_folder_is_deleted(shared_env, echo_project,
                                                                                    tmp_path):
    """Issue 39 item 1: the shared server answers only a client with the secret kept 0600 beside its
    database (the CLI's flow run sent it). Issue 40 item 6: a project folder deleted under a running
    shared server (its lease and record gone) stops the server within seconds, not after hours."""
    import base64

    import httpx

    home = tmp_path / "project" / ".ragline-home"  # a bar-style script: the project holds ragline's home
    env = dict(shared_env, RAGLINE_HOME=str(home))
    _echo(env, echo_project)
    record = json.loads((home / "prefect" / "server.json").read_text())
    secret = home / "prefect" / "api-auth"
    assert secret.stat().st_mode & 0o777 == 0o600
    basic = base64.b64encode(secret.read_text().strip().encode()).decode()
    try:
        assert httpx.post(f"{record['url']}/flows/filter", json={}, timeout=30).status_code == 401
        assert httpx.post(f"{record['url']}/flows/filter", json={}, timeout=30,
                          headers={"Authorization": "Basic " + base64.b64encode(b"ragline:guess").decode()}
                          ).status_code == 401
        flows = httpx.post(f"{record['url']}/flows/filter", json={}, timeout=30,
                           headers={"Authorization": f"Basic {basic}"})
        assert flows.status_code == 200 and any(f["name"] == "ragline" for f in flows.json()), flows.text
        shutil.rmtree(tmp_path / "project")
        took = _wait_gone(record["pid"], 30)
    finally:
        if _alive(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)
    assert took is not None, "the shared Prefect server outlived its deleted folder"
