"""The README's main job on the real packaged model: `ragline quickstart` as a console script, a real
Prefect flow run and vLLM. In a module of its own so that it runs on the worker that holds the
session's vLLM (tests/conftest.py VLLM_MODULES)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.data import REPO

pytestmark = pytest.mark.integration


@pytest.mark.llm
def test_quickstart_console_script_indexes_the_sample_and_answers_with_citations(tmp_path, vllm_server):
    """The README's main job, as a user runs it: a real console script, a real Prefect flow run and
    the packaged model on vLLM (started by the product's own start path, as quickstart does)."""
    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    shutil.copytree(REPO / "samples", tmp_path / "samples")
    shutil.copytree(REPO / "prompts", tmp_path / "prompts")
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), RAGLINE_LLM_BASE_URL=vllm_server.base_url,
               RAGLINE_LLM_MODEL=vllm_server.model)
    env.pop("PREFECT_API_URL", None)
    script = shutil.which("ragline", path=os.path.dirname(sys.executable))
    result = subprocess.run([script, "quickstart"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "index: added 4, updated 0, deleted 0, unchanged 0, failed 0" in result.stdout
    # The passage that answers the sample question ranks near the top (ties are broken by chunk id,
    # which depends on the folder, so not necessarily first).
    hits = re.findall(r"^(\d)\. \[[0-9.]+\] (.+)$", result.stdout.split("answer: ", 1)[0], flags=re.MULTILINE)
    assert "observability" in [title for _, title in hits[:3]], hits
    # The evidence answer (ask_extractive, no LLM) is printed first, before the LLM is waited for: the
    # sentence that answers, cited to the sample document that holds it.
    evidence = result.stdout.split("evidence: ", 1)[1].split("\nask: ", 1)[0]
    assert evidence.startswith("A document that cannot be read is reported by path with the reason and skipped; "
                               "the run goes on. [1]"), evidence
    assert re.search(r"^  \[1\] observability — samples/docs/observability\.txt$", evidence, flags=re.MULTILINE)
    # Evidence first: the packaged model's answer is shown where the evidence grounds it, else the evidence
    # answer; either way a cited answer holding the key phrase, never a refusal of this question.
    answer = result.stdout.split("answer: ", 1)[1]
    assert not answer.startswith("I cannot answer this question"), answer[:500]
    assert "skipped" in answer.splitlines()[0], answer[:500]
    cited = re.findall(r"^  \[(\d+)\] (.+) — (.+)$", answer, flags=re.MULTILINE)
    assert cited, result.stdout[-2000:]
    # root-relative source paths (`<root name>/<path>`): never the machine's own path
    assert all(path.startswith("samples/docs/") and not Path(path).is_absolute() for _, _, path in cited), cited
    assert "Finished in state" not in result.stdout + result.stderr  # Prefect's task lines stay off the terminal
