"""A query pipeline of fixed passages and the repository prompts, for LLM stages against the scripted
server (tests/scripted_llm.py)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.contracts import Passage, Query
from ragline.flows.spec.registry import stage
from tests.helpers.data import REPO
from tests.scripted_llm import ScriptedLLM

REPO_PROMPTS = REPO / "prompts"

class FixedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str]

@stage("test_fixed_passages", params=FixedParams, produces="passages", kind="query")
def _fixed(query: Query, params: FixedParams) -> list[Passage]:
    return [Passage(chunk_id=f"c{i}", source_id=f"doc{i}", title=f"Doc {i}", text=t, score=1.0 - i / 10,
                    metadata={"source": f"/data/doc{i}.md"}) for i, t in enumerate(params.texts, start=1)]

def project_for(make_project, url: str, steps: str, texts: list[str]):
    import shutil

    path = make_project(f"""
resources:
  llm: {{type: openai_compatible, base_url: "{url}", max_retries: 0, timeout_seconds: 10}}
pipelines:
  p:
    kind: query
    steps:
      - {{id: passages, task: test_fixed_passages, with: {{texts: {texts!r}}}}}
{steps}""")
    shutil.rmtree(path.parent / "prompts")
    shutil.copytree(REPO_PROMPTS, path.parent / "prompts")
    return load_project(path).pipeline("p")

ANSWER_STEPS = """      - {id: insert, task: insert, with: {max_tokens: 1000}}
      - {id: answer, task: generate}
      - {id: check, task: verify}
"""

def chat_prompts(server) -> list[str]:
    return [r["messages"][-1]["content"] for r in server.requests if "messages" in r]

def run(pipeline, text="What is the capital of France?", **query):
    return engine.run(pipeline, {"query": {"text": text, **query}}, orchestrate=False)


def rewrite_with(reply: str, mode: str, query: Query, **params):
    """Run the rewrite stage alone against a scripted reply; returns (rewritten, prompts sent)."""
    from ragline.flows.context import StepContext
    from ragline.flows.spec.prompts import PromptLibrary
    from ragline.flows.resources.models.llm import LLMClient, LLMSpec
    from ragline.tasks.rewrite.rewrite import Params, rewrite

    with ScriptedLLM(lambda p: reply) as server:
        ctx = StepContext(pipeline="t", step_id="rw", prompt_name=f"rewrite_{mode}",
                          render_prompt=PromptLibrary(REPO_PROMPTS).render)
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        return rewrite.fn(query=query, params=Params(mode=mode, **params), ctx=ctx, llm=llm), chat_prompts(server)
