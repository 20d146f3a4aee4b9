"""Issue 24 items 3-5 as a user meets them, through the console script: one LLM story for every
command (the packaged LLM started when the local endpoint is down, else one line saying how to
start one), one line on failure in both run modes (no traceback, no Prefect records, no
"Loading weights" bars, each progress line once), and commands that load only what they need.
The LLM is tests/fake_vllm.py: a real child process serving like vLLM (no real vLLM)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ragline.flows.ops.llm_server import free_port, port_free
from tests.helpers.data import REPO
from tests.fake_vllm import fake_deploy
from tests.helpers.api_harness import QUESTION, write_project

SCRIPT = shutil.which("ragline", path=os.path.dirname(sys.executable))
HEAVY = ("torch", "sentence_transformers", "transformers", "chromadb", "prefect", "fastapi", "uvicorn", "openai")


def ragline(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def broken_llm(tmp_path_factory):
    """A fake vLLM that answers /health and /v1/models but fails every completion (HTTP 500); it
    keeps no state, so one serves the module."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("broken-llm") / "fake-vllm.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "tests.fake_vllm", str(port), "smollm2"], cwd=REPO,
                              env={**os.environ, "FAKE_VLLM_BROKEN": "1", "PYTHONPATH": str(REPO)},
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "the fake vLLM did not start"
            time.sleep(0.1)
    try:
        yield f"{url}/v1"
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def retrying(project: Path) -> Path:
    """The project with the LLM client's default retries (the harness sets none)."""
    project.write_text(project.read_text().replace("max_retries: 0, ", ""))
    return project


# ----------------------------------------------------------------------------- item 4: one line on failure
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["--no-prefect", "--prefect"])
def test_a_failing_ask_is_one_line_without_traceback_in_both_modes(api_project, broken_llm, tmp_path, mode):
    """The LLM answers every completion 500: in Prefect mode the failed task and flow run logged their
    chained tracebacks (~340 lines, twice) and every retry was an INFO line per parallel call."""
    project = retrying(write_project(api_project.parent, broken_llm, name=f"broken{mode}.yaml"))
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": ""}
    result = ragline("ask", QUESTION, "-f", str(project), mode, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    where = f"LLM endpoint {broken_llm} (model 'smollm2')"
    assert result.stderr == (
        f"… {where}: InternalServerError; retrying in 0.5 s (attempt 2 of 4)\n"
        f"… {where}: InternalServerError; retrying in 1.0 s (attempt 3 of 4)\n"
        f"… {where}: InternalServerError; retrying in 2.0 s (attempt 4 of 4)\n"
        f"error: pipeline 'ask', step 'insert' (task 'insert') failed: LLMUnavailable: {where} did not answer "
        f"after 4 attempts (POST {broken_llm.removesuffix('/v1')}/tokenize): InternalServerError: Error code: 500 - "
        f"engine dead\n"), result.stderr[-3000:]
    assert result.stdout == ""


@pytest.mark.integration
def test_a_failing_quickstart_is_one_line_without_traceback(tmp_path, broken_llm):
    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    shutil.copytree(REPO / "samples", tmp_path / "samples")
    shutil.copytree(REPO / "prompts", tmp_path / "prompts")
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "", "RAGLINE_LLM_BASE_URL": broken_llm}
    result = ragline("quickstart", "--no-start-llm", env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    where = f"LLM endpoint {broken_llm} (model 'smollm2')"
    assert result.stderr == (
        "indexing (index): 4/4 documents, 5 chunks\n"
        f"sources: {tmp_path / 'samples' / 'docs'}\n"
        f"… {where}: InternalServerError; retrying in 0.5 s (attempt 2 of 4)\n"
        f"… {where}: InternalServerError; retrying in 1.0 s (attempt 3 of 4)\n"
        f"… {where}: InternalServerError; retrying in 2.0 s (attempt 4 of 4)\n"
        f"error: pipeline 'ask', step 'insert' (task 'insert') failed: LLMUnavailable: {where} did not answer "
        f"after 4 attempts (POST {broken_llm.removesuffix('/v1')}/tokenize): InternalServerError: Error code: 500 - "
        f"engine dead\n"), result.stderr[-3000:]
    assert "index: added 4" in result.stdout and "search: " in result.stdout
    # the evidence answer needs no LLM: printed before the broken one is asked
    assert "evidence: A document that cannot be read is reported by path with the reason and skipped; the run goes " \
           "on. [1]\n  [1] observability — samples/docs/observability.txt\n" in result.stdout, result.stdout[-2000:]


# ----------------------------------------------------------------------------- item 3: one LLM story
@pytest.mark.integration
def test_ask_starts_the_packaged_llm_when_its_local_endpoint_is_down(api_project, tmp_path):
    """As quickstart and serve do: deploy/vllm/ is the fake; it is stopped when the command ends."""
    port = free_port()
    project = write_project(api_project.parent, f"http://127.0.0.1:{port}/v1", name="start_llm.yaml")
    project.write_text(project.read_text().replace("max_retries: 0,", "chars_per_token: 4, max_retries: 0,"))
    env = {"RAGLINE_VLLM_DEPLOY": str(fake_deploy(tmp_path)), "RAGLINE_START_LLM": "1"}
    result = ragline("ask", QUESTION, "-f", str(project), "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"starting the packaged LLM (smollm2 on vLLM, CPU) at http://127.0.0.1:{port}/v1" in result.stderr
    assert re.search(r"LLM ready in \d+ s \(pid \d+\); it stops when this command ends", result.stderr)
    assert "text" in json.loads(result.stdout)
    assert port_free(port)  # stopped with the command


def test_a_down_endpoint_is_one_line_naming_it_and_the_command_that_starts_one(api_project, capsys):
    from ragline.flows.cli import main

    port = free_port()
    local = write_project(api_project.parent, f"http://127.0.0.1:{port}/v1", name="down_local.yaml")
    assert main(["ask", QUESTION, "-f", str(local), "--no-start-llm"]) == 1
    assert capsys.readouterr().err == (
        f"error: the LLM endpoint http://127.0.0.1:{port}/v1 (model 'smollm2') did not answer: nothing accepts "
        f"connections there; start it with `VLLM_PORT={port} bash deploy/vllm/serve.sh`, or let ragline start it "
        f"(without --no-start-llm and RAGLINE_START_LLM=0)\n")
    other = write_project(api_project.parent, f"http://127.0.0.1:{port}/v1", name="down_other.yaml")
    other.write_text(other.read_text().replace("max_retries: 0,", "model: mistral-7b, max_retries: 0,"))
    assert main(["ask", QUESTION, "-f", str(other)]) == 1
    assert capsys.readouterr().err == (
        f"error: the LLM endpoint http://127.0.0.1:{port}/v1 (model 'mistral-7b') did not answer: nothing accepts "
        f"connections there; start your server for 'mistral-7b' on port {port} (ragline starts only the packaged "
        f"model, 'smollm2')\n")
    remote = write_project(api_project.parent, f"http://192.0.2.1:{port}/v1", name="down_remote.yaml")  # TEST-NET-1: not loopback
    assert main(["ask", QUESTION, "-f", str(remote)]) == 1
    assert capsys.readouterr().err == (
        f"error: the LLM endpoint http://192.0.2.1:{port}/v1 (model 'smollm2') did not answer: nothing accepts "
        f"connections there; start that server, or point RAGLINE_LLM_BASE_URL at one that runs (the packaged "
        f"model runs here with `ragline serve`)\n")


def test_eval_of_answers_says_the_same_line_before_any_work(api_project, tmp_path, capsys):
    from ragline.flows.cli import main

    port = free_port()
    project = write_project(api_project.parent, f"http://127.0.0.1:{port}/v1", name="down_eval.yaml")
    rgb = tmp_path / "rgb.json"
    rgb.write_text(json.dumps({"id": 0, "query": "q?", "answer": ["a"], "positive": ["a"], "negative": ["b"]}) + "\n")
    assert main(["eval", "--dataset", str(rgb), "-f", str(project), "--no-start-llm"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: the LLM endpoint http://127.0.0.1:{port}/v1 ")


# ----------------------------------------------------------------------------- exit codes and labels
def test_validate_exits_2_on_a_bad_file(tmp_path):
    """README: 2 is bad configuration (errors.ConfigError's exit code); validate said 1."""
    (tmp_path / "pipelines.yaml").write_text("pipelines: [")
    result = ragline("validate", str(tmp_path / "pipelines.yaml"))
    assert result.returncode == 2 and "invalid YAML" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- item 5: only what is needed
@pytest.mark.parametrize("command", [["--help"], ["validate"], ["index", "--help"]])
def test_help_and_validate_import_no_model_library(command):
    """`--help` and `validate` need neither torch, a model, Chroma nor Prefect (sys.modules in a fresh
    process, not a timing)."""
    code = ("import json, sys\nfrom ragline.flows.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_the_cli_constants_match_their_modules():
    """The CLI names the API port and default file without importing the modules that define them."""
    from ragline.flows import cli
    from ragline.flows.spec import compile
    from ragline.flows.serve.supervise import service as serve

    assert cli.API_PORT == serve.DEFAULT_PORT and cli.DEFAULT_FILE == compile.DEFAULT_FILE


# ----------------------------------------------------------------------------- item 5: the API's LLM and discovery
@pytest.mark.integration
def test_api_starts_the_packaged_llm_in_the_background_and_stops_it(api_project, tmp_path):
    """`ragline api` as `serve`: the API answers at once, /readyz reports the LLM until it is up."""
    llm_port, port = free_port(), free_port()
    project = write_project(api_project.parent, f"http://127.0.0.1:{llm_port}/v1", name="api_llm.yaml")
    env = {**os.environ, "RAGLINE_VLLM_DEPLOY": str(fake_deploy(tmp_path)), "RAGLINE_START_LLM": "1",
           "RAGLINE_API_TOKEN": API_TOKEN}
    log = tmp_path / "api.log"
    with open(log, "wb") as out:
        api = subprocess.Popen([SCRIPT, "api", "-f", str(project), "--port", str(port)], stdout=out,
                               stderr=subprocess.STDOUT, env=env)

    def llm_status() -> str | None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/readyz",
                                         headers={"Authorization": f"Bearer {API_TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.load(response)["checks"]["llm"]["status"]
        except urllib.error.HTTPError as exc:  # 503 while the LLM is not ready
            return json.load(exc)["checks"]["llm"]["status"]
        except OSError:
            return None

    try:
        deadline = time.monotonic() + 180
        while llm_status() != "up":
            assert api.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.3)
        said = log.read_text()
        assert f"ragline api: starting the packaged LLM (smollm2 on vLLM) at http://127.0.0.1:{llm_port}/v1" in said
        assert re.search(r"ragline api: LLM ready in \d+ s \(pid \d+, ", said), said
    finally:
        api.terminate()
        api.wait(60)
    deadline = time.monotonic() + 30
    while not port_free(llm_port):
        assert time.monotonic() < deadline, "the packaged LLM outlived ragline api"
        time.sleep(0.2)


def test_the_discovery_file_names_only_a_live_api_of_this_project_on_this_host(tmp_path):
    """A stale file (the API was killed), another machine's, another file beside the same data, an
    edited file or a newer tuned overlay: never used."""
    from types import SimpleNamespace

    from ragline.flows.serve.supervise import discovery as api_discovery

    project_file = tmp_path / "pipelines.yaml"
    project_file.write_text("pipelines: {}\n")
    project = SimpleNamespace(path=project_file, overlay=None)
    with api_discovery.published(project, "0.0.0.0", 8123, "a-token", None) as target:
        assert target == tmp_path / ".ragline" / "api.server.json"
        service, why = api_discovery.find(project_file)
        assert service == api_discovery.Service("http://127.0.0.1:8123", os.getpid(), True, False) and why is None
        assert api_discovery.find(tmp_path / "other.yaml") == (None, None)
        (tmp_path / "pipelines.tuned.yaml").write_text("version: 1\n")  # `ragline tune` ran since
        assert api_discovery.find(project_file)[1] == (f"the ragline API at http://127.0.0.1:8123 (pid "
                                                       f"{os.getpid()}) serves an older tuned overlay")
        (tmp_path / "pipelines.tuned.yaml").unlink()
        info = json.loads(target.read_text())
        target.write_text(json.dumps({**info, "hostname": "elsewhere"}))
        assert api_discovery.find(project_file) == (None, None)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        target.write_text(json.dumps({**info, "pid": dead.pid, "started": None}))
        assert api_discovery.find(project_file) == (None, None)
        target.write_text(json.dumps({**info, "host": "203.0.113.7"}))  # a record edited to catch the token
        assert api_discovery.find(project_file) == (None, "the ragline API record names http://203.0.113.7:8123, "
                                                          "not a loopback address: the token is not sent there")
        target.write_text(json.dumps(info))
    assert not target.exists()


# ----------------------------------------------------------------------------- item 5: a running API answers
# Last in the module: one `ragline api` serves these tests, and no other API may run in its folder meanwhile.
API_TOKEN = "cli-service-token"
MODULES = ("import json, sys\nfrom ragline.flows.cli import main\ncode = main(sys.argv[1:])\n"
           f"print(json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]), file=sys.stderr)")


@pytest.fixture(scope="module")
def running_api(api_project, tmp_path_factory):
    """`ragline api` on the session's indexed project (a real process, real uvicorn, a token), one
    for the module's last tests: no other API runs beside it in that folder until it stops."""
    port = free_port()
    logs = tmp_path_factory.mktemp("running-api")
    log = open(logs / "api.log", "wb")
    api = subprocess.Popen([SCRIPT, "api", "-f", str(api_project), "--port", str(port)], stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, "RAGLINE_API_TOKEN": API_TOKEN})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=2).close()
            break
        except OSError:
            assert api.poll() is None, (logs / "api.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "ragline api did not start"
            time.sleep(0.2)
    try:
        yield url, api.pid
    finally:
        api.terminate()
        api.wait(30)
        log.close()
    assert not (api_project.parent / ".ragline" / "api.server.json").exists()  # withdrawn when it stops


@pytest.mark.integration
def test_search_and_ask_use_a_running_api_of_the_same_project_and_say_so(api_project, running_api):
    url, pid = running_api
    discovery = api_project.parent / ".ragline" / "api.server.json"
    assert json.loads(discovery.read_text())["port"] == int(url.rsplit(":", 1)[1])
    token = {"RAGLINE_API_TOKEN": API_TOKEN}
    searched = subprocess.run([sys.executable, "-c", MODULES, "search", QUESTION, "-f", str(api_project), "--json",
                               "-k", "2"], capture_output=True, text=True, env={**os.environ, **token}, timeout=120)
    said, (code, heavy) = searched.stderr.splitlines()[:-1], json.loads(searched.stderr.splitlines()[-1])
    assert code == 0 and said == [f"(answered by the running ragline API at {url}, pid {pid})"], searched.stderr
    assert heavy == []  # no torch, no model, no Chroma, no Prefect in the CLI's process
    served = json.loads(searched.stdout)
    assert len(served) == 2 and served[0]["title"] and served[0]["score"] > 0
    asked = ragline("ask", QUESTION, "-f", str(api_project), env=token)
    assert asked.returncode == 0 and asked.stderr == f"(answered by the running ragline API at {url}, pid {pid})\n"
    assert asked.stdout.startswith("Diffusion tensor imaging measures it [1].\n[1] ")
    streamed = ragline("ask", QUESTION, "-f", str(api_project), "--stream", env=token)  # its server-sent events
    assert streamed.returncode == 0 and streamed.stderr == asked.stderr, streamed.stderr
    assert streamed.stdout.startswith("Diffusion tensor imaging measures it [1].\n\n[1] "), streamed.stdout
    # without the token the API was given, the CLI answers in-process (and says why)
    alone = ragline("search", QUESTION, "-f", str(api_project), "--json", "-k", "2",
                    env={"RAGLINE_API_TOKEN": ""})
    assert alone.returncode == 0 and alone.stderr.startswith(f"(the ragline API at {url} needs a token: set "
                                                             f"RAGLINE_API_TOKEN to use it; running in-process)\n")
    assert [p["chunk_id"] for p in json.loads(alone.stdout)] == [p["chunk_id"] for p in served]


@pytest.mark.integration
def test_an_edited_pipelines_file_is_not_answered_by_the_api_that_serves_the_old_one(api_project, running_api):
    url, pid = running_api
    edited = api_project.read_text()
    try:
        api_project.write_text(edited + "\n# edited\n")
        result = ragline("search", QUESTION, "-f", str(api_project), "-k", "1",
                         env={"RAGLINE_API_TOKEN": API_TOKEN})
    finally:
        api_project.write_text(edited)
    assert result.returncode == 0 and result.stdout.startswith("1. [")
    assert result.stderr.startswith(f"(the ragline API at {url} (pid {pid}) serves another version of "
                                    f"{api_project.name}: running in-process)\n"), result.stderr
