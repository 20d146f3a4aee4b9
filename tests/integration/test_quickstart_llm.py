"""Issue 15.7: the quickstart's managed LLM, as a user runs it (console script, real Prefect flow
runs), with deploy/vllm/ replaced by tests/fake_vllm.py: a real child process that can die."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ragline.flows.ops.llm_server import free_port
from tests.fake_vllm import fake_deploy
from tests.helpers.data import REPO

pytestmark = pytest.mark.integration


def test_a_managed_llm_that_dies_during_the_quickstart_is_one_line_with_its_log(tmp_path):
    for folder in ("samples", "prompts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    deploy = fake_deploy(tmp_path / "stand-in", before="export FAKE_VLLM_DIE_AFTER=1\n")  # dies at the ask
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), RAGLINE_VLLM_DEPLOY=str(deploy),
               RAGLINE_LLM_BASE_URL=f"http://127.0.0.1:{port}/v1", RAGLINE_LLM_MODEL="smollm2")
    env.pop("PREFECT_API_URL", None)
    env.pop("RAGLINE_START_LLM", None)
    script = shutil.which("ragline", path=os.path.dirname(sys.executable))
    result = subprocess.run([script, "quickstart"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "LLM ready in" in output  # its own child answered a completion
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "the packaged LLM (smollm2 on vLLM, pid" in line and "exited with code 3" in line
    assert "engine core died unexpectedly" in line  # the log's last lines
    assert "Traceback" not in output, output[-3000:]
