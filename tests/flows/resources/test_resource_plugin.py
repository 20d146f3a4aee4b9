"""A resource type is one module plus one entry point: a test-only distribution (a dist-info
folder on sys.path, as pip would install it) registers `echo` in the `ragline.resources` group,
and pipelines.yaml uses it with no edit anywhere in ragline. Validation, the run, relocation under
a data folder, fingerprints, warm-up at API start and /readyz all come from its `Resource` class.
Run in a fresh interpreter: the resource types are read once, at import."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

RESOURCE = '''
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ragline.flows.resources.base import Health, Resource

WARMED = []


class EchoSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["echo"]
    path: str = "echo.txt"
    prefix: str = "echo: "
    volume: int = 1  # does not change what is indexed


class EchoStore(Resource):
    Spec = EchoSpec
    located = True

    @classmethod
    def fingerprint_fields(cls, spec):
        return {"prefix": spec.prefix}

    @property
    def path(self) -> Path:
        return (self.base_dir / self.spec.path).resolve()

    def say(self, text: str) -> str:
        return self.spec.prefix + text

    def warm_up(self) -> None:
        WARMED.append(str(self.path))

    def health(self, index_state=None) -> Health:
        return Health.up(path=str(self.path)) if WARMED else Health.down("never warmed up")
'''

STAGE = '''
from ragline.flows.contracts import Passage, Query
from ragline.flows.spec.registry import stage


@stage("echo", produces="passages", kind="query", uses={"echo": ("echo",)})
def echo(query: Query, echo) -> list[Passage]:
    """The query, said back by the echo resource."""
    return [Passage(chunk_id="1", source_id="s", text=echo.say(query.text), score=1.0)]
'''

PIPELINES = '''
resources:
  loud:  {type: echo, prefix: "ECHO ", path: /somewhere/else/echo.txt}
pipelines:
  say:
    kind: query
    steps:
      - {id: e, task: echo_stage.echo, uses: [loud]}
'''

SCRIPT = '''
import json, sys
from fastapi.testclient import TestClient

import echo_resource
from ragline.flows.run import engine
from ragline.flows.serve.app import create_app
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import resource_types

project = load_project(sys.argv[1])
moved = project.relocated(sys.argv[2])
louder = project.with_resource("loud", volume=11)
pipeline = project.pipeline("say")
with TestClient(create_app(sys.argv[1], data_dir=sys.argv[2]), base_url="http://127.0.0.1") as client:
    warmed = list(echo_resource.WARMED)
    ready = client.get("/readyz")
print(json.dumps({
    "registered": resource_types()["echo"].__name__,
    "answer": engine.run(pipeline, {"query": "hello"}, orchestrate=False)[0].text,
    "relocated_path": str(moved.resource("loud").path),
    "same_fingerprint_at_other_volume": louder.pipeline("say").fingerprint(louder.pipeline("say").steps)
        == pipeline.fingerprint(pipeline.steps),
    "warmed": warmed,
    "ready": [ready.status_code, ready.json()["checks"]["loud"]],
}))
'''


@pytest.mark.integration  # a fresh interpreter discovers the entry point
def test_a_resource_type_registered_by_entry_point_is_usable_from_pipelines_yaml(tmp_path):
    plugins = tmp_path / "plugins"
    (plugins / "echo_dist-0.1.dist-info").mkdir(parents=True)
    (plugins / "echo_dist-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-dist\n"
                                                                  "Version: 0.1\n")
    (plugins / "echo_dist-0.1.dist-info" / "entry_points.txt").write_text(
        "[ragline.resources]\necho = echo_resource:EchoStore\n")
    (plugins / "echo_resource.py").write_text(textwrap.dedent(RESOURCE))
    (plugins / "echo_stage.py").write_text(textwrap.dedent(STAGE))
    (tmp_path / "pipelines.yaml").write_text(PIPELINES)
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])),
           "RAGLINE_ALLOW_MODULES": "echo_stage"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "pipelines.yaml"), str(data)],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["registered"] == "EchoStore"
    assert out["answer"] == "ECHO hello"  # validated, compiled and run through the stage's `uses`
    assert out["relocated_path"] == str(data.resolve() / "loud")  # located: an absolute path moves under the data dir
    assert out["same_fingerprint_at_other_volume"] is True  # the type's fingerprint_fields decide
    assert out["warmed"] == [str(data.resolve() / "loud")]  # the API warmed the query pipeline's resource
    status, check = out["ready"]
    assert status == 200 and check["status"] == "up" and check["type"] == "echo", out["ready"]
