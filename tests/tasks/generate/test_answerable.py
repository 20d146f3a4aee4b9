"""The answerability gate through the real engine and a scripted HTTP LLM: a question the
references do not bear on is refused before generation (no generation request is made), with the
gate's reason; an answerable one goes through unchanged; its prompt opens like the answer prompt."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.contracts import Context
from ragline.flows.resources import clear_cache
from ragline.tasks.generate.answerable import FLOOR_KEY, read_floor
from tests.helpers.llm_stages import chat_prompts, project_for, run
from tests.helpers.reads_roles import BM25, EMBEDDER, LLM, STATE, TWO_EMBEDDERS, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

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
    from ragline.tasks.generate.answerable import Params, answerable

    empty = Context()
    assert answerable.fn(None, empty, Params(min_similarity=0.9, min_probability=0.9), None, None, None) is empty


# ----------------------------------------------------------------------------- the floor set at ingestion
# Issue 24 item 2: the gate refuses what the documents do not cover out of the box, with a floor that
# ingestion computes from the index it publishes (no `ragline tune` needed); a query only reads it.
COMPANY = Path(__file__).resolve().parents[2] / "fixtures" / "company"
REPO = Path(__file__).resolve().parents[3]
QUESTIONS = json.loads((COMPANY.parent / "company-questions.json").read_text())
ANSWERABLE, OFF_TOPIC = list(QUESTIONS["answerable"]), QUESTIONS["off_topic"]


@pytest.fixture(scope="module")
def company_indexed(tmp_path_factory):
    """The shipped pipelines.yaml over a copy of five made-up-company documents, indexed once."""
    root = tmp_path_factory.mktemp("company")
    (root / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    shutil.copytree(REPO / "prompts", root / "prompts")
    shutil.copytree(COMPANY, root / "docs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGLINE_LLM_BASE_URL", "http://127.0.0.1:9/v1")
        engine.run(load_project(root / "pipelines.yaml", tuned=False).pipeline("index"), orchestrate=False)
    clear_cache()  # as after a process: every store closed and flushed before the folder is copied
    return root


@pytest.fixture
def company(company_indexed, tmp_path, monkeypatch):
    """A copy of the indexed company project (documents, prompts and indexes, mtimes kept) for one
    test; ``load(url)`` points its LLM at ``url``."""
    folder = shutil.copytree(company_indexed, tmp_path / "company", symlinks=True)

    def load(url: str = "http://127.0.0.1:9/v1"):
        monkeypatch.setenv("RAGLINE_LLM_BASE_URL", url)
        return load_project(folder / "pipelines.yaml", tuned=False)

    return load


def test_ingestion_sets_the_floor_and_ask_refuses_off_topic_questions_without_a_call(company):
    with ScriptedLLM(lambda prompt: "Employees get 27 days of paid annual leave [1].") as llm:
        project = company(llm.base_url)
        state = project.resource("state")
        floor = read_floor(state)
        assert floor is not None and floor.generation == state.generation and floor.pairs >= 20
        assert 0.05 < floor.min_similarity < 0.3 and project.pipeline("ask").step("gate").params.min_similarity == "auto"
        off = [engine.run(project.pipeline("ask"), {"query": q}, orchestrate=False) for q in OFF_TOPIC]
        assert chat_prompts(llm) == []  # refused before generation: not one LLM call
        on = [engine.run(project.pipeline("ask"), {"query": q}, orchestrate=False) for q in ANSWERABLE]
        assert len(chat_prompts(llm)) == len(ANSWERABLE)  # every answerable question reached the generator
    assert all(a.refused and a.reason.startswith("no reference is close to the question (similarity ")
               and a.reason.endswith(f" < {floor.min_similarity:.2f}, the floor set at ingestion)") for a in off)
    assert not any(a.reason.startswith("no reference is close") for a in on)


def test_the_floor_is_computed_again_only_when_the_index_changed_size_by_a_tenth(company):
    """The floor describes the collection: an edited document keeps it (encoding the pseudo-queries
    costs seconds on a loaded machine), a collection that grew is measured again."""
    project = company()
    state = project.resource("state")
    before = state.get_meta(FLOOR_KEY)
    engine.run(project.pipeline("index"), orchestrate=False)  # nothing changed
    (project.base_dir / "docs" / "office.txt").write_text(
        (COMPANY / "office.txt").read_text() + "\nThe canteen serves lunch from 12:00 to 14:00 on working days.\n")
    engine.run(project.pipeline("index"), orchestrate=False)  # one document edited: five chunks still
    assert state.get_meta(FLOOR_KEY) == before and read_floor(state).generation < state.generation
    (project.base_dir / "docs" / "canteen.md").write_text(
        "# The canteen\n\nThe canteen on the first floor serves a warm lunch from 12:00 to 14:00. Vegetarian "
        "and vegan dishes are on the menu every day. Employees pay with their badge at the till.\n")
    engine.run(project.pipeline("index"), orchestrate=False)  # six chunks: a fifth more
    floor = read_floor(state)
    assert floor.generation == state.generation and floor.chunks == 6 and state.get_meta(FLOOR_KEY) != before


def test_too_few_sentences_for_a_floor_leave_the_gate_open(company):
    project = company()
    docs = project.base_dir / "docs"
    for path in docs.iterdir():
        if path.name != "benefits.md":
            path.unlink()
    engine.run(project.pipeline("index"), orchestrate=False)
    floor = read_floor(project.resource("state"))
    assert floor.pairs < 20 and floor.min_similarity is None
    with ScriptedLLM(lambda prompt: "I cannot answer this question") as llm:
        project = load_project(project.path, tuned=False).with_resource("llm", base_url=llm.base_url)
        answer = engine.run(project.pipeline("ask"), {"query": "What is the capital of Peru?"}, orchestrate=False)
    # the gate let the references through: the evidence step (evidence first, no LLM call) judged them
    assert answer.refused and answer.evidence is not None and answer.evidence.refused
    assert not answer.evidence.reason.startswith("no reference is close to the question"), answer.evidence.reason


def test_a_floor_computed_with_another_embedder_is_not_used(company):
    project = company()
    state = project.resource("state")
    state.set_meta(FLOOR_KEY, read_floor(state).model_copy(update={"embedder": "another", "min_similarity": 0.99})
                   .model_dump_json())
    with ScriptedLLM(lambda prompt: "I cannot answer this question") as llm:
        project = load_project(project.path, tuned=False).with_resource("llm", base_url=llm.base_url)
        engine.run(project.pipeline("ask"), {"query": ANSWERABLE[0]}, orchestrate=False)
        assert len(chat_prompts(llm)) == 1  # 0.99 would have refused it


def test_the_gate_reads_the_stored_vectors_instead_of_encoding_every_passage_again(company, monkeypatch):
    """Encoding five passages on each question took 1.4 s on the loaded test machine; the store
    holds their vectors (the embedder's own: the same similarity as encoding them)."""
    from ragline.tasks.generate.answerable import similarity

    with ScriptedLLM(lambda prompt: "I cannot answer this question") as llm:
        project = company(llm.base_url)
        embedder = project.resource("embedder")
        encoded: list[int] = []
        encode = embedder.encode_passages
        monkeypatch.setattr(embedder, "encode_passages", lambda texts, *a, **k: encoded.append(len(texts)) or
                            encode(texts, *a, **k))
        answer = engine.run(project.pipeline("ask"), {"query": OFF_TOPIC[0]}, orchestrate=False)
    assert answer.refused and encoded == []
    passages = [p.text for p in engine.run(project.pipeline("search"), {"query": OFF_TOPIC[0]}, orchestrate=False)[:5]]
    assert f"(similarity {similarity(embedder, OFF_TOPIC[0], passages):.2f} <" in answer.reason


# ----------------------------------------------------------------------------- resources read (validate)
GATE_STEP = """      - id: gate
        task: answerable
        with:
          min_similarity: 0.3
          min_probability: 0.5
"""


@pytest.mark.parametrize("resources, field, why", [
    (EMBEDDER, "with.min_probability", "min_probability: 0.5 asks the LLM whether the documents answer"),
    (LLM, "with.min_similarity", "min_similarity: 0.3 compares the question with the passages")])
def test_answerable_says_at_validate_which_resource_its_thresholds_read(make_project, resources, field, why):
    """min_probability reads the LLM, a similarity floor the embedder: a file without one validated and
    failed only when a question came; now `ragline validate` names the line and the field."""
    error = error_at(make_project(pipelines_file(resources, GATE_STEP)), "gate", field)
    assert why in error.message


def test_answerable_binds_what_it_reads_and_auto_reads_an_embedder_only_where_there_is_one(make_project):
    """Thresholds at 0 read nothing (two embedders and two LLMs need no name); ``auto`` binds the
    file's embedder and validates without one."""
    before = ("      - {id: ret, task: retrieve_sparse}\n      - {id: fuse, task: fuse}\n"
              "      - {id: insert, task: insert, uses: {llm: LLM_NAME}}\n")
    off = before.replace("LLM_NAME", "llm_a") + GATE_STEP.replace("0.3", "0").replace("0.5", "0")
    path = make_project(pipelines_file(STATE + BM25 + TWO_EMBEDDERS + TWO_LLMS, off))
    assert validate_file(path) == []
    assert load_project(path).pipeline("p").step("gate").resources == {}
    auto = before.replace("LLM_NAME", "llm") + GATE_STEP.replace("0.3", "auto").replace("0.5", "0")
    bound = load_project(make_project(pipelines_file(STATE + BM25 + EMBEDDER + LLM, auto), name="auto.yaml"))
    assert bound.pipeline("p").step("gate").resources == {"embedder": "embedder"}
    without = load_project(make_project(pipelines_file(STATE + BM25 + LLM, auto.replace(": 0\n", ": 0.5\n")),
                                        name="no.yaml"))
    assert without.pipeline("p").step("gate").resources == {"llm": "llm"}
