"""The answerability gate through the real engine and a scripted HTTP LLM: a question the
references do not bear on is refused before generation (no generation request is made), with the
gate's reason; an answerable one goes through unchanged; its prompt opens like the answer prompt."""
from __future__ import annotations

from ragline.flows.contracts import Context
from tests.scripted_llm import ScriptedLLM
from tests.tasks.test_llm_stages import chat_prompts, project_for, run

ZEBRAFISH = "Zebrafish regenerate their heart muscle after injury by dedifferentiation of cardiomyocytes."
GATED = """      - {id: insert, task: insert, with: {max_tokens: 1000}}
      - {id: gate, task: answerable, with: {min_probability: 0.5}}
      - {id: answer, task: generate}
"""


def with_embedder(make_project):
    """make_project for a file that also declares the packaged embedder."""
    def make(text: str):
        return make_project(text.replace("resources:\n", "resources:\n  embedder: {type: sentence_transformer}\n", 1))
    return make


def replies(gate: str):
    return lambda prompt: gate if "contain the answer to this question" in prompt else "Paris [1]."


def test_an_unanswerable_question_is_refused_without_a_generation(make_project):
    with ScriptedLLM(replies("No")) as llm:
        answer = run(project_for(make_project, llm.base_url, GATED, [ZEBRAFISH]))
        prompts = chat_prompts(llm)
    assert answer.refused and answer.text == "I cannot answer this question"
    assert answer.reason.startswith("the references do not seem to contain the answer (P(answerable) 0.00 < 0.50")
    assert len(prompts) == 1 and "contain the answer to this question" in prompts[0]


def test_an_answerable_question_goes_through_to_the_generator(make_project):
    with ScriptedLLM(replies("Yes")) as llm:
        answer = run(project_for(make_project, llm.base_url, GATED, ["Paris is the capital of France."]))
        prompts = chat_prompts(llm)
    assert not answer.refused and answer.text.startswith("Paris") and answer.citations == [1]
    assert len(prompts) == 2 and "cite the documents" in prompts[1]


def test_the_gate_prompt_opens_like_the_answer_prompt_so_the_server_reuses_its_prefill(make_project):
    """vLLM's prefix cache reuses the longest shared token prefix: everything up to the question."""
    with ScriptedLLM(replies("Yes")) as llm:
        run(project_for(make_project, llm.base_url, GATED, [ZEBRAFISH, "Paris is the capital of France."]))
        gate, answer = chat_prompts(llm)
    shared = gate[:gate.index("Do the documents above contain")]
    assert "Question: What is the capital of France?" in shared and answer.startswith(shared)


def test_similarity_refuses_an_off_topic_question_without_any_llm_call(make_project):
    steps = GATED.replace("min_probability: 0.5", "min_similarity: 0.3, min_probability: 0.5")
    with ScriptedLLM(replies("Yes")) as llm:
        pipeline = project_for(with_embedder(make_project), llm.base_url, steps, [ZEBRAFISH])
        off_topic = run(pipeline, "Which train goes from Paris to Lyon on Sundays?")
        assert chat_prompts(llm) == []
        on_topic = run(pipeline, "How do zebrafish regenerate heart muscle?")
    assert off_topic.refused and off_topic.reason.startswith("no reference is close to the question (similarity ")
    assert not on_topic.refused


def test_thresholds_of_zero_turn_the_gate_off(make_project):
    steps = GATED.replace("{min_probability: 0.5}", "{}")
    with ScriptedLLM(replies("No")) as llm:
        answer = run(project_for(make_project, llm.base_url, steps, [ZEBRAFISH]))
        assert len(chat_prompts(llm)) == 1  # the generation only
    assert not answer.refused


def test_an_empty_context_passes_through_without_any_call():
    from ragline.tasks.answerable import Params, answerable

    empty = Context()
    assert answerable.fn(None, empty, Params(min_similarity=0.9, min_probability=0.9), None, None, None) is empty
