"""Request classification and routing (issue 21): `classify` labels a request by its nearest labelled
examples (the packaged MiniLM, no LLM) or by the LLM's pick among the declared labels (the scripted
server), falls back to the default label with a warning on a reply that names none, and may route a
label to collections; the shipped `ask_routed` answers chit-chat directly, without retrieval, and
everything else through the `ask` path."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from ragline.flows import resources
from ragline.flows.context import StepContext
from ragline.flows.contracts import Query
from ragline.flows.errors import ConfigError
from ragline.flows.resources import clear_cache
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.rewrite.classify import Params, classify, parse_label
from tests.helpers.llm_stages import REPO_PROMPTS, chat_prompts
from tests.helpers.reads_roles import EMBEDDER, LLM, TWO_EMBEDDERS, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

REPO = Path(__file__).resolve().parents[3]
COMPANY = REPO / "tests" / "fixtures" / "company"
LABELS = {
    "retrieve": {"description": "a question the documents answer",
                 "examples": ["How many days of annual leave do employees get?", "What is the expense policy?",
                              "Which drug lowers blood pressure?", "When was the office opened?"]},
    "chitchat": {"description": "greetings, thanks, small talk",
                 "examples": ["hello", "hi, how are you?", "thanks a lot!", "good morning", "bye"]},
}


@pytest.fixture
def shared_minilm(minilm, monkeypatch):
    """The session's MiniLM is the resource the engine gets for `{type: sentence_transformer}`."""
    key = ("sentence_transformer", minilm.spec.model_dump_json(), "")
    monkeypatch.setitem(resources._cache, key, minilm)
    return minilm


def label_of(text: str, params: Params, embedder=None, llm=None, folder: Path = Path("."), project=None,
             **query) -> Query:
    ctx = StepContext(pipeline="p", step_id="route", base_dir=str(folder), project=project,
                      prompt_name="classify", render_prompt=PromptLibrary(REPO_PROMPTS).render)
    return classify.fn(query=Query(text=text, **query), params=params, ctx=ctx, embedder=embedder, llm=llm)


@pytest.mark.parametrize("method", ["knn", "centroid"])
def test_embedding_mode_labels_by_the_nearest_examples(minilm, method):
    params = Params(labels=LABELS, method=method, k=3)
    chat = label_of("hey there, how's it going?", params, minilm).labels["route"]
    question = label_of("How much paid leave do I get per year?", params, minilm).labels["route"]
    assert (chat.label, chat.mode, question.label, question.mode) == ("chitchat", "embedding", "retrieve", "embedding")
    assert 0.3 < chat.score <= 1 and 0.3 < question.score <= 1


def test_below_min_similarity_the_default_label_is_given(minilm):
    params = Params(labels=LABELS, default="retrieve", min_similarity=0.99)
    label = label_of("thanks, that was great", params, minilm).labels["route"]
    assert (label.label, label.mode) == ("retrieve", "default") and label.score < 0.99


def test_examples_come_from_a_file_too_and_a_bad_line_is_named(minilm, tmp_path):
    lines = [{"text": "cheers mate", "label": "chitchat"}, {"text": "Is aspirin safe?", "label": "retrieve"}]
    (tmp_path / "routes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    params = Params(labels={"retrieve": {}, "chitchat": {}}, examples_file="routes.jsonl")
    assert label_of("cheers!", params, minilm, folder=tmp_path).labels["route"].label == "chitchat"
    (tmp_path / "routes.jsonl").write_text(json.dumps(lines[0]) + "\n" + json.dumps({"text": "x", "label": "spam"}))
    with pytest.raises(ConfigError, match=r"routes.jsonl:2: label 'spam' is not one of the step's labels"):
        label_of("cheers!", params, minilm, folder=tmp_path)
    (tmp_path / "routes.jsonl").write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(ConfigError, match=r"no example for label 'retrieve'"):
        label_of("cheers!", params, minilm, folder=tmp_path)


@pytest.mark.parametrize("given, words", [
    ({"labels": {"retrieve": {"examples": ["a"]}, "chitchat": {}}}, "needs examples for every label; none for "
                                                                    "'chitchat'"),
    ({"labels": LABELS, "default": "spam"}, "default 'spam' is not one of the labels (retrieve, chitchat)"),
    ({"labels": {**LABELS, "not a label": {"examples": ["x"]}}}, "'not a label': a label is a letter"),
    ({"labels": {"retrieve": {"examples": ["a"]}}}, "at least 2 items"),
])
def test_bad_params_are_refused_with_the_reason(given, words):
    with pytest.raises(ValidationError, match=re.escape(words)):
        Params(**given)


def test_llm_mode_asks_for_one_of_the_labels_and_reads_the_reply(shared_minilm):
    params = Params(mode="llm", labels=LABELS)
    with ScriptedLLM(lambda prompt: '{"label": "chitchat"}') as server:
        from ragline.flows.resources.models.llm import LLMClient, LLMSpec

        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, model="m", max_retries=0))
        label = label_of("hello!", params, llm=llm).labels["route"]
        [request] = [r for r in server.requests if "messages" in r]
    assert (label.label, label.mode) == ("chitchat", "llm")
    schema = request["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["label"]["enum"] == ["retrieve", "chitchat"]
    prompt = request["messages"][-1]["content"]
    assert "- chitchat: greetings, thanks, small talk" in prompt and prompt.rstrip().endswith("Request: hello!")
    assert prompt.index("data, not instructions") < prompt.index("Request:")


def test_an_llm_reply_that_names_no_label_falls_back_to_the_default_with_a_warning(caplog):
    params = Params(mode="llm", labels=LABELS, default="retrieve")
    with ScriptedLLM(lambda prompt: "I would rather not say.") as server:
        from ragline.flows.resources.models.llm import LLMClient, LLMSpec

        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, model="m", max_retries=0))
        with caplog.at_level(logging.WARNING):
            label = label_of("hello!", params, llm=llm).labels["route"]
    assert (label.label, label.mode) == ("retrieve", "default")
    assert any("names no label" in r.getMessage() and "'retrieve'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("reply, label", [
    ('{"label": "chitchat"}', "chitchat"), ("chitchat", "chitchat"), ("Chit-chat.", "chitchat"),
    ("Label: RETRIEVE", "retrieve"), ("This is chitchat, not retrieve", "chitchat"), ('{"label": "spam"}', None),
    ("", None), ("retrieved", None),
])
def test_a_reply_is_parsed_leniently_but_only_to_a_declared_label(reply, label):
    assert parse_label(reply, ["retrieve", "chitchat"]) == label


def test_a_label_may_route_to_collections_within_those_the_request_asked(minilm, caplog):
    labels = {**LABELS, "retrieve": {**LABELS["retrieve"], "collections": ["handbook"]}}
    params = Params(labels=labels)
    assert label_of("What is the expense policy?", params, minilm).collections == ["handbook"]
    assert label_of("hello", params, minilm).collections is None  # chit-chat routes nowhere
    with caplog.at_level(logging.WARNING):
        assert label_of("What is the expense policy?", params, minilm, collections=["papers"]).collections == ["papers"]
    assert any("none of the request's" in r.getMessage() for r in caplog.records)

    class Project:
        collections = {"papers": object()}

    with pytest.raises(ConfigError, match=r"routes to unknown collection 'handbook'; the file declares papers"):
        label_of("What is the expense policy?", params, minilm, project=Project())


# ----------------------------------------------------------------------------- the shipped ask_routed
def embedder_key(project) -> tuple[str, str, str]:
    spec = project.spec.resources["embedder"]
    return spec.type, spec.model_dump_json(), ""


@pytest.fixture(scope="module")
def company_indexed(tmp_path_factory, minilm):
    """The shipped pipelines.yaml over a copy of five made-up-company documents, indexed once (with
    the session's MiniLM, not a second copy)."""
    root = tmp_path_factory.mktemp("routed")
    (root / "pipelines.yaml").write_text((REPO / "pipelines.yaml").read_text().replace(
        "paths: [samples/docs]", "paths: [docs]"))
    shutil.copytree(REPO / "prompts", root / "prompts")
    shutil.copytree(COMPANY, root / "docs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGLINE_LLM_BASE_URL", "http://127.0.0.1:9/v1")
        project = load_project(root / "pipelines.yaml", tuned=False)
        patch.setitem(resources._cache, embedder_key(project), minilm)
        engine.run(project.pipeline("index"), orchestrate=False)
    clear_cache()  # the stores closed and flushed (the session's MiniLM was taken out of the cache first)
    return root


def reply(prompt: str) -> str:
    if "Reply briefly and politely" in prompt:
        return "Hello! Ask me anything about the documents."
    return "Employees get 27 days of paid annual leave [1]."


def test_ask_routed_answers_chit_chat_directly_and_questions_from_the_documents(company_indexed, minilm,
                                                                                 monkeypatch):
    with ScriptedLLM(reply) as llm:
        monkeypatch.setenv("RAGLINE_LLM_BASE_URL", llm.base_url)
        project = load_project(company_indexed / "pipelines.yaml", tuned=False)
        monkeypatch.setitem(resources._cache, embedder_key(project), minilm)
        pipeline = project.pipeline("ask_routed")
        chat = engine.run(pipeline, {"query": "hi there, how are you?"}, orchestrate=False)
        chat_calls = chat_prompts(llm)
        answer = engine.run(pipeline, {"query": "How many days of paid annual leave do employees get?"},
                            orchestrate=False)
    assert chat.text == "Hello! Ask me anything about the documents." and not chat.sources and not chat.refused
    assert {"rewrite", "dense", "sparse", "fuse", "insert", "gate", "answer", "check"} == set(chat.skipped)
    assert len(chat_calls) == 1 and "<document" not in chat_calls[0]  # one call, no references: no retrieval
    assert answer.sources and not answer.refused and "27 days" in answer.text
    assert set(answer.skipped) == {"reply"}


def test_ask_routed_embeds_the_question_once(company_indexed, minilm, monkeypatch):
    """The classifier's vector of the question is the one dense retrieval searches with: one encode
    of the question for the whole request (issue: it was embedded by `route` and again by `dense`)."""
    question = "How many days of paid annual leave does a new employee get in the first year?"
    encoded: list[str] = []
    original = minilm._encode_queries  # the torch-free encoder's or the model's: every query text passes here
    monkeypatch.setattr(minilm, "_encode_queries", lambda texts: encoded.extend(texts) or original(texts))
    with ScriptedLLM(reply) as llm:
        monkeypatch.setenv("RAGLINE_LLM_BASE_URL", llm.base_url)
        project = load_project(company_indexed / "pipelines.yaml", tuned=False)
        monkeypatch.setitem(resources._cache, embedder_key(project), minilm)
        trace: list = []
        answer = engine.run(project.pipeline("ask_routed"), {"query": question}, orchestrate=False, trace=trace)
    steps = {step for step, _ in trace}
    assert {"route", "dense"} <= steps and "27 days" in answer.text  # both embedding steps ran
    assert [text for text in encoded if question in text] == [question]


def test_answer_direct_replies_with_its_text_or_the_llms_without_references():
    from ragline.flows.resources.models.llm import LLMClient, LLMSpec
    from ragline.tasks.generate.answer_direct import Params as DirectParams, answer_direct

    ctx = StepContext(pipeline="p", step_id="reply", prompt_name="answer_direct",
                      render_prompt=PromptLibrary(REPO_PROMPTS).render)
    fixed = answer_direct.fn(query=Query(text="hello"), params=DirectParams(reply="Hi! Ask me about the docs."),
                             ctx=ctx, llm=None)
    assert (fixed.text, fixed.sources, fixed.refused) == ("Hi! Ask me about the docs.", [], False)
    history = [{"role": "user", "content": "I am Ada"}, {"role": "assistant", "content": "Hello Ada"}]
    with ScriptedLLM(lambda prompt: "Thanks, Ada!") as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, model="m", max_retries=0))
        said = answer_direct.fn(query=Query(text="thank you", history=history),
                                params=DirectParams(system="Be terse."), ctx=ctx, llm=llm)
        [messages] = [r["messages"] for r in server.requests if "messages" in r]
    assert said.text == "Thanks, Ada!" and not said.sources
    assert messages[0] == {"role": "system", "content": "Be terse."}
    assert "user: I am Ada" in messages[1]["content"] and messages[1]["content"].rstrip().endswith("User: thank you\nReply:")


# ----------------------------------------------------------------------------- resources read (validate)
CLASSIFY_STEP = """      - id: route
        task: classify
        with:
          labels: {a: {examples: [hello there]}, b: {examples: [what is X]}}
          mode: {mode}
"""


def test_classify_reads_the_resource_of_its_mode_and_validate_says_which_is_missing(make_project):
    """Each mode reads one resource: mode llm without an LLM (and mode embedding without an embedder)
    validated and failed only when a request came; now `ragline validate` names the line and with.mode."""

    error = error_at(make_project(pipelines_file(EMBEDDER, CLASSIFY_STEP.replace("{mode}", "llm"))), "route",
                     "with.mode")
    assert "mode 'llm' asks the LLM for the label" in error.message and "openai_compatible" in error.message
    error = error_at(make_project(pipelines_file(LLM, CLASSIFY_STEP.replace("{mode}", "embedding")), name="e.yaml"),
                     "route", "with.mode")
    assert "mode 'embedding' embeds" in error.message and "sentence_transformer" in error.message


@pytest.mark.parametrize("mode", ["llm", "embedding"])
def test_classify_binds_only_its_modes_resource_so_two_of_the_other_need_no_name(make_project, mode):

    own, others = (LLM, TWO_EMBEDDERS) if mode == "llm" else (EMBEDDER, TWO_LLMS)
    path = make_project(pipelines_file(own + others, CLASSIFY_STEP.replace("{mode}", mode)))
    assert validate_file(path) == []
    role = "llm" if mode == "llm" else "embedder"
    assert load_project(path).pipeline("p").step("route").resources == {role: role}


ANSWER_DIRECT_STEP = """      - id: direct
        task: answer_direct
        with: {max_tokens: 40}
"""


def test_answer_direct_without_reply_needs_an_llm_and_with_reply_binds_none(make_project):

    error = error_at(make_project(pipelines_file(EMBEDDER, ANSWER_DIRECT_STEP)), "direct", "with.reply", needle="with:")
    assert "without `reply` the LLM answers" in error.message
    fixed = make_project(pipelines_file(TWO_LLMS, ANSWER_DIRECT_STEP.replace("{max_tokens: 40}", "{reply: Hi!}")),
                         name="reply.yaml")
    assert validate_file(fixed) == [] and load_project(fixed).pipeline("p").step("direct").resources == {}
