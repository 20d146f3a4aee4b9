"""Issue 34 item 3: every serving surface shows the evidence answer at once. On real uvicorn over the
session's indexed SciFact papers: `/v1/query` (JSON: `answer.evidence`; SSE: an `evidence` event
first, before any token), `/v1/chat/completions` with the stock `openai` client (`evidence` and
`answered_by` in `model_extra`; streaming: a chunk carrying the evidence before any text), with the
scripted LLM, with no LLM (`ask_extractive`) and with the LLM at a closed port (the evidence
answers, not a refusal); a client that leaves after the evidence event; and the chat page in
Debian's headless Chromium (the evidence first, its sentence highlighted inside its passage)."""
from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, events, running, write_project
from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask

pytestmark = pytest.mark.integration

EVIDENCE_PIPELINES = """
  ask_evidence:
    kind: query
    steps:
      - {id: dense,    task: retrieve_dense, with: {k: 10}}
      - {id: sparse,   task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,     task: fuse, after: [dense, sparse], with: {top_k: 3}}
      - {id: insert,   task: insert, with: {max_tokens: 1500, count: words}}
      - {id: evidence, task: extract_answer}
      - {id: answer,   task: generate}
      - {id: check,    task: verify, with: {fact_check: false}}
  ask_extractive:
    kind: query
    steps:
      - {id: dense,    task: retrieve_dense, with: {k: 10}}
      - {id: sparse,   task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,     task: fuse, after: [dense, sparse], with: {top_k: 3}}
      - {id: insert,   task: insert, with: {max_tokens: 1500, count: words}}
      - {id: evidence, task: extract_answer}
      - {id: check,    task: verify, with: {fact_check: false}}
"""
GROUNDED = "A line scan diffusion-weighted magnetic resonance imaging (MRI) sequence with diffusion tensor analysis " \
           "was applied to measure the apparent diffusion coefficient in cerebral white matter [1]."


def evidence_project(folder: Path, llm_url: str, name: str) -> Path:
    path = write_project(folder, llm_url, name=name)
    path.write_text(path.read_text() + EVIDENCE_PIPELINES)
    return path


@pytest.fixture(scope="module")
def served_evidence(api_project, scripted_llm) -> Iterator[str]:
    from ragline.flows.serve.app import create_app

    path = evidence_project(api_project.parent, scripted_llm.base_url, "evidence.yaml")
    with running(create_app(str(path), token=TOKEN)) as url:
        yield url


@pytest.fixture(scope="module")
def served_llm_down(api_project) -> Iterator[str]:
    """The same pipelines with the LLM at a closed port (bound, never listening: refused)."""
    from ragline.flows.serve.app import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        path = evidence_project(api_project.parent, f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                                "evidence_down.yaml")
        with running(create_app(str(path), token=TOKEN)) as url:
            yield url


@pytest.fixture
def paced(scripted_llm):
    """Words 50 ms apart, so a stream has many token events to order against."""
    saved, scripted_llm.chunk_delay = scripted_llm.chunk_delay, 0.05
    yield
    scripted_llm.chunk_delay = saved


def query(url: str, pipeline: str, stream: bool = False) -> httpx.Response:
    response = httpx.post(f"{url}/v1/query", json={"question": QUESTION, "pipeline": pipeline, "stream": stream},
                          headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response


def assert_located(evidence: dict) -> None:
    """A cited evidence answer whose every span is exactly where it says in its source's passage."""
    assert not evidence["refused"] and evidence["text"] and evidence["spans"] and evidence["citations"]
    passages = {s["number"]: s["passage"] for s in evidence["sources"]}
    for span in evidence["spans"]:
        assert passages[span["number"]][span["start"]:span["end"]] == span["text"]
        assert f"[{span['number']}]" in evidence["text"]


def test_json_carries_the_evidence_answer_without_any_llm(served_llm_down):
    body = query(served_llm_down, "ask_extractive").json()
    answer = body["answer"]
    assert_located(answer["evidence"])
    assert answer["answered_by"] == "evidence" and not answer["refused"]
    assert answer["text"] == answer["evidence"]["text"]
    assert "evidence" in body["timings"]


def test_the_evidence_event_comes_first_then_the_tokens_then_the_answer(served_evidence, fresh_script, paced):
    fresh_script.answer = GROUNDED
    response = query(served_evidence, "ask_evidence", stream=True)
    seen = events(response)
    names = [name for name, _ in seen]
    assert names[0] == "evidence" and names.count("evidence") == 1
    assert names[-1] == "answer" and names.count("token") > 3 and set(names[1:-1]) == {"token"}
    first, final = seen[0][1], seen[-1][1]
    assert first["answer_id"] == response.headers["X-Answer-ID"] == final["answer_id"]
    assert first["pipeline"] == "ask_evidence" and first["step"] == "evidence" and first["latency_ms"] > 0
    assert_located(first["evidence"])
    assert final["answer"]["evidence"] == first["evidence"]  # the same evidence, again on the answer
    assert first["latency_ms"] < final["latency_ms"]


def test_an_unreachable_llm_answers_with_the_evidence_shown_first(served_llm_down):
    seen = events(query(served_llm_down, "ask_evidence", stream=True))
    assert [name for name, _ in seen] == ["evidence", "answer"]
    evidence, answer = seen[0][1]["evidence"], seen[1][1]["answer"]
    assert_located(evidence)
    assert not answer["refused"] and answer["answered_by"] == "evidence"
    assert answer["text"] == evidence["text"] and answer["citations"] == evidence["citations"]
    assert seen[1][1]["replaced_by_evidence"] is False  # nothing was streamed to take back


def test_a_draft_the_evidence_does_not_ground_is_withdrawn_for_the_evidence(served_evidence, fresh_script):
    fresh_script.answer = "Volcanic ash improves the memory of goldfish by 73 percent [1]."
    seen = events(query(served_evidence, "ask_evidence", stream=True))
    assert seen[0][0] == "evidence" and any(name == "token" for name, _ in seen)
    final = seen[-1][1]
    assert final["answer"]["answered_by"] == "evidence" and final["replaced_by_evidence"] is True
    assert "evidence answer" in final["notice"]
    assert final["answer"]["text"] == seen[0][1]["evidence"]["text"]


def test_a_client_that_leaves_after_the_evidence_does_not_stop_the_server(served_evidence, fresh_script, paced):
    fresh_script.answer = GROUNDED
    body = {"question": QUESTION, "pipeline": "ask_evidence", "stream": True}
    with httpx.stream("POST", f"{served_evidence}/v1/query", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("event:")) == "event: evidence"
    answer = query(served_evidence, "ask_evidence").json()["answer"]  # the next client is answered in full
    assert answer["text"] == GROUNDED and answer["answered_by"] == "llm"
    assert_located(answer["evidence"])


@pytest.fixture
def client(served_evidence) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served_evidence}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, model: str, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], **kwargs)


def test_the_openai_client_reads_the_evidence_from_model_extra(client, fresh_script):
    fresh_script.answer = GROUNDED
    completion = chat(client, "ask_evidence")
    assert completion.choices[0].message.content == GROUNDED
    assert completion.model_extra["answered_by"] == "llm"
    assert_located(completion.model_extra["evidence"])
    extractive = chat(client, "ask_extractive")
    assert extractive.model_extra["answered_by"] == "evidence"
    assert extractive.choices[0].message.content == extractive.model_extra["evidence"]["text"]


def test_an_openai_stream_carries_the_evidence_before_any_text(client, fresh_script, paced):
    fresh_script.answer = GROUNDED
    chunks = list(chat(client, "ask_evidence", stream=True))
    carrying = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("evidence")]
    texts = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    assert carrying and texts and carrying[0] < texts[0]
    early = chunks[carrying[0]]
    assert early.choices[0].delta.content is None and early.choices[0].finish_reason is None
    assert_located(early.model_extra["evidence"])
    assert "".join(chunks[i].choices[0].delta.content for i in texts) == GROUNDED
    stop = [c for c in chunks if c.choices and c.choices[0].finish_reason == "stop"]
    assert stop[0].model_extra["evidence"] == early.model_extra["evidence"]
    assert stop[0].model_extra["answered_by"] == "llm"
    assert stop[0].model_extra["verification"]["replaced_by_evidence"] is False


def test_an_openai_stream_with_the_llm_down_answers_with_the_evidence(served_llm_down):
    client = openai.OpenAI(base_url=f"{served_llm_down}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    chunks = list(chat(client, "ask_evidence", stream=True))
    evidence = next(c.model_extra["evidence"] for c in chunks if (c.model_extra or {}).get("evidence"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == evidence["text"]
    stop = next(c for c in chunks if c.choices and c.choices[0].finish_reason == "stop")
    assert stop.model_extra["answered_by"] == "evidence" and not stop.model_extra["verification"]["refused"]


# ----------------------------------------------------------------------------- the chat page, in Chromium
@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


def open_page(browser, url: str):
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    page.add_init_script(f"sessionStorage.setItem('ragline.token', {TOKEN!r})")
    page.goto(url + "/")
    page.wait_for_selector("#pipeline option[value=ask_evidence]", state="attached")
    return context, page


def assert_highlighted(card, evidence: dict) -> None:
    """The evidence section shows each cited passage whole with its sentence marked at its offsets."""
    span = evidence["spans"][0]
    passage = next(s["passage"] for s in evidence["sources"] if s["number"] == span["number"])
    shown = card.locator(f"section.evidence .evidence-source[id$='-evidence-source-{span['number']}']")
    assert shown.locator("blockquote").text_content() == passage
    mark = shown.locator("blockquote mark").first
    assert mark.text_content() == span["text"]
    assert (int(mark.get_attribute("data-start")), int(mark.get_attribute("data-end"))) == (span["start"], span["end"])
    assert card.locator("section.evidence .evidence-text").inner_text() == evidence["text"]


def test_the_page_shows_the_evidence_highlighted_before_the_generated_answer(browser, served_evidence, fresh_script,
                                                                             paced):
    fresh_script.answer = GROUNDED
    evidence = query(served_evidence, "ask_evidence").json()["answer"]["evidence"]
    context, page = open_page(browser, served_evidence)
    try:
        drafts: list[str] = []  # what the generated draft held when the evidence appeared
        page.expose_function("sawEvidence", lambda draft: drafts.append(draft))
        page.evaluate("""() => new MutationObserver((_, observer) => {
            const box = document.querySelector('section.evidence');
            if (!box) return;
            observer.disconnect();
            const draft = document.querySelector('.answer.streaming');
            window.sawEvidence(draft ? draft.textContent : 'the answer was already rendered');
        }).observe(document.getElementById('results'), {subtree: true, childList: true, characterData: true})""")
        card = ask(page, QUESTION, pipeline="ask_evidence")
        assert drafts == [""], "the evidence should show before any generated text"
        assert_highlighted(card, evidence)
        assert card.locator(".answer").inner_text() == GROUNDED
        assert card.locator(".answered-by").count() == 0 and card.locator(".banner.refusal").count() == 0
    finally:
        context.close()


def test_the_page_with_the_llm_down_shows_the_evidence_as_the_answer(browser, served_llm_down):
    evidence = query(served_llm_down, "ask_extractive").json()["answer"]["evidence"]
    context, page = open_page(browser, served_llm_down)
    try:
        card = ask(page, QUESTION, pipeline="ask_evidence")
        assert_highlighted(card, evidence)
        assert "Answered by the evidence above" in card.locator(".answered-by").inner_text()
        assert card.locator(".banner").count() == 0  # neither a refusal nor an error
        card.locator("section.evidence a.cite").first.click()
        assert page.evaluate("location.hash").endswith(f"-evidence-source-{evidence['spans'][0]['number']}")
    finally:
        context.close()
