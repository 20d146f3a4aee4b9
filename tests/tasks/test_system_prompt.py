"""A system prompt per pipeline (issue 21): `generate` (and `generate_flare`) send the operator's
instructions as the system message, inline or rendered from a template with the pipeline's own
values (never the request); a template that is missing or reads the request is a located error."""
from __future__ import annotations

from pathlib import Path

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Context, ContextDocument, Passage, Query
from ragline.flows.resources.stores.chroma import ChromaSpec, ChromaStore
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.parse import SpecValidationError
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.generate import flare as generate_flare
from tests.helpers.llm_stages import REPO_PROMPTS, project_for, run
from tests.scripted_llm import ScriptedLLM

QUESTION = "What is the capital of France?"
PASSAGES = ["Paris is the capital of France."]


def answer_step(with_: str = "") -> str:
    return f"      - {{id: insert, task: insert, with: {{max_tokens: 1000}}}}\n" \
           f"      - {{id: answer, task: generate{', with: {' + with_ + '}' if with_ else ''}}}\n"


def project_file(make_project, url: str, steps: str, prompts: dict[str, str] | None = None):
    """The fixed-passages pipeline of tests/helpers/llm_stages.py, with these steps and templates."""
    path = project_for(make_project, url, "", PASSAGES).project.path
    for name, body in (prompts or {}).items():
        (path.parent / "prompts" / f"{name}.j2").write_text(body)
    path.write_text(path.read_text() + steps)
    return path


def messages_sent(make_project, steps: str, prompts: dict[str, str] | None = None) -> list[dict]:
    with ScriptedLLM(lambda p: "Paris [1].") as llm:
        run(load_project(project_file(make_project, llm.base_url, steps, prompts)).pipeline("p"), text=QUESTION)
        [request] = [r for r in llm.requests if "messages" in r]
    return request["messages"]


def test_without_a_system_prompt_the_llm_gets_one_user_message(make_project):
    [message] = messages_sent(make_project, answer_step())
    assert message["role"] == "user" and QUESTION in message["content"]


def test_an_inline_system_prompt_is_the_first_message(make_project):
    system, user = messages_sent(make_project, answer_step('system: "Answer formally, in British English."'))
    assert system == {"role": "system", "content": "Answer formally, in British English."}
    assert user["role"] == "user" and QUESTION in user["content"] and "British" not in user["content"]


def test_a_streamed_answer_gets_the_system_message_too(make_project):
    system, user = messages_sent(make_project, answer_step('stream: true, system: "Be brief."'))
    assert system == {"role": "system", "content": "Be brief."} and QUESTION in user["content"]


def test_a_system_template_is_rendered_with_the_pipelines_values_only(make_project):
    template = "You answer for {{ company }}'s help desk (pipeline {{ pipeline }}), in a friendly tone."
    system, user = messages_sent(make_project, answer_step('system_prompt: tone, system_variables: {company: Acme}'),
                                 prompts={"tone": template})
    assert system == {"role": "system", "content": "You answer for Acme's help desk (pipeline p), in a friendly tone."}
    assert QUESTION not in system["content"] and QUESTION in user["content"]


def errors_of(make_project, steps: str, prompts: dict[str, str] | None = None) -> list:
    with pytest.raises(SpecValidationError) as caught:
        load_project(project_file(make_project, "http://127.0.0.1:9/v1", steps, prompts))
    return caught.value.errors


def test_a_missing_system_template_is_located_at_its_parameter(make_project):
    [error] = errors_of(make_project, answer_step("system_prompt: tonne"), prompts={"tone": "Be kind."})
    assert (error.pipeline, error.step, error.field) == ("p", "answer", "with.system_prompt")
    assert "'tonne.j2' not found" in error.message and "'tone'" in error.message  # with the nearest name
    lines = Path(error.file).read_text().splitlines()
    assert "system_prompt: tonne" in lines[error.line - 1]


def test_a_system_template_cannot_read_the_request(make_project):
    [error] = errors_of(make_project, answer_step("system_prompt: tone"), prompts={"tone": "Asked: {{ question }}"})
    assert (error.step, error.field) == ("answer", "with.system_prompt")
    assert "undefined variable 'question'" in error.message and "provides: pipeline" in error.message


@pytest.mark.parametrize("with_, expected", [
    ('system: "Be brief.", system_prompt: tone', "not both"),
    ("system_variables: {company: Acme}", "none is named"),
    ("system_prompt: tone, system_variables: {pipeline: x}", "not usable as a template variable: 'pipeline'"),
])
def test_conflicting_system_parameters_are_located_errors(make_project, with_, expected):
    [error] = errors_of(make_project, answer_step(with_), prompts={"tone": "Be kind."})
    assert error.step == "answer" and error.field.startswith("with") and expected in error.message


def test_flare_sends_the_system_message_with_every_look_ahead(tmp_path, minilm):
    store = ChromaStore(ChromaSpec(type="chroma", path="c", collection="flare"), base_dir=tmp_path)
    store.upsert([Chunk(chunk_id="k0", source_id="s0", ordinal=0, text="Paris hosted the 2024 Olympics.",
                        embedding=minilm.encode_documents(["Paris hosted the 2024 Olympics."])[0].tolist())])
    context = Context(documents=[ContextDocument(number=1, passage=Passage(chunk_id="k1", source_id="s1",
                                                                           text="Lyon is known for food."))])
    with ScriptedLLM(lambda p: "Paris hosted them [1].") as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="t", step_id="flare", prompt_name="flare_continue",
                          render_prompt=PromptLibrary(REPO_PROMPTS).render)
        generate_flare.generate_flare.fn(query=Query(text="Who hosted the 2024 Olympics?"), context=context,
                                         params=generate_flare.Params(system="Be terse.", max_sentences=2), ctx=ctx,
                                         llm=llm, store=store, embedder=minilm)
        sent = [r["messages"] for r in server.requests if "messages" in r]
    assert sent and all(m[0] == {"role": "system", "content": "Be terse."} and m[1]["role"] == "user" for m in sent)
