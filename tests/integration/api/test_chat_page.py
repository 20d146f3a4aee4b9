"""The chat page at `/` in a real headless Chromium (Debian's, driven by playwright) against the real
API on uvicorn with the scripted LLM: type, submit, watch the answer stream in, follow a citation to
its source and passage, see a refusal's reason, and give the token the API asks for."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_harness import QUESTION, TOKEN
from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask

pytestmark = pytest.mark.integration

SCREENSHOT = Path(__file__).resolve().parents[3] / "docs" / "img" / "chat.png"


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, served):
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    page = context.new_page()
    page.add_init_script(f"sessionStorage.setItem('ragline.token', {TOKEN!r})")
    page.goto(served + "/")
    page.wait_for_selector("#pipeline option[value=ask]", state="attached")
    yield page
    context.close()


def test_the_page_is_served_without_a_token_with_a_strict_policy(served):
    response = httpx.get(served + "/", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    page = response.text.lower()
    assert not any(ref in page for ref in ('src="http', "href=\"http", "@import", "url(http"))  # no external assets


@pytest.fixture
def paced(scripted_llm):
    """Words 50 ms apart: at the session's 2 ms a loaded machine can deliver the whole answer in one
    read, and the page would rightly show it at once."""
    saved, scripted_llm.chunk_delay = scripted_llm.chunk_delay, 0.05
    yield
    scripted_llm.chunk_delay = saved


def test_answer_streams_in_and_its_citation_leads_to_the_source_and_passage(page, fresh_script, paced):
    fresh_script.answer = "Diffusion tensor imaging measures white matter development in newborns [1]."
    streamed: list[str] = []
    page.expose_function("sawDraft", lambda text: streamed.append(text))
    page.evaluate("""() => new MutationObserver(() => {
        const draft = document.querySelector('.answer.streaming');
        if (draft && draft.textContent) window.sawDraft(draft.textContent);
    }).observe(document.getElementById('results'), {subtree: true, childList: true, characterData: true})""")
    card = ask(page, QUESTION)
    assert "Diffusion tensor imaging measures white matter development in newborns [1]." in card.locator(".answer").inner_text()
    assert len(set(streamed)) > 1, "the answer should appear piece by piece"
    assert card.locator(".banner.refusal").count() == 0
    citation = card.locator("a.cite").first
    assert citation.inner_text() == "[1]"
    target = citation.get_attribute("href")
    source = page.locator(target)
    assert source.locator(".source-title").inner_text().startswith("[1] ")
    passage = source.locator("blockquote").inner_text()
    assert len(passage) > 50  # the cited passage itself, from the SciFact abstract
    citation.click()
    assert page.evaluate("location.hash") == target
    if os.environ.get("RAGLINE_SCREENSHOTS") == "1":  # the README's picture
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)


def test_a_refusal_shows_its_reason_and_withdraws_the_draft(page, fresh_script):
    fresh_script.answer = "Volcanic ash improves the memory of goldfish [1]."
    fresh_script.verdict = "No"
    card = ask(page, QUESTION)
    banner = card.locator(".banner.refusal")
    assert banner.inner_text().startswith("Refused:") and len(banner.inner_text()) > len("Refused: ")
    assert "withdrawn" in card.inner_text()
    assert card.locator(".answer").inner_text() == "I cannot answer this question"
    assert card.locator("ol.sources").count() == 0


def test_a_search_pipeline_lists_its_passages(page):
    card = ask(page, "white matter in newborns", pipeline="search")
    assert card.locator("ol.sources li").count() >= 1
    assert card.locator("ol.sources li blockquote").first.inner_text()


def test_without_a_token_the_page_asks_for_one_then_answers(browser, served):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(served + "/")
        page.locator("#token-box.shown").wait_for(timeout=30_000)
        assert "needs an API token" in page.inner_text("#status")
        page.fill("#token", TOKEN)
        page.click("#token-box button")
        page.wait_for_selector("#pipeline option[value=search]", state="attached")
        card = ask(page, "white matter in newborns", pipeline="search")
        assert card.locator("ol.sources li").count() >= 1
        assert page.evaluate("sessionStorage.getItem('ragline.token')") == TOKEN
    finally:
        context.close()


def test_a_wrong_token_is_forgotten_and_asked_for_again(browser, served):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.add_init_script("sessionStorage.setItem('ragline.token', 'wrong-token')")
        page.goto(served + "/")
        page.locator("#token-box.shown").wait_for(timeout=30_000)
        assert "refused this token" in page.inner_text("#status")
        assert page.evaluate("sessionStorage.getItem('ragline.token')") is None
    finally:
        context.close()


def test_an_error_names_the_field(page):
    page.evaluate("document.getElementById('pipeline').append(new Option('nope', 'nope'))")
    card = ask(page, "anything", pipeline="nope")
    assert "field 'pipeline'" in card.locator(".banner.error").inner_text()


def test_a_passage_links_only_to_the_loaders_url_never_to_its_own_metadata(page):
    """Issue 16 item 9: metadata a document brings (a JSONL record's `path`) is never a link; only
    the `url` the loader set from a root's url_prefix is. The passages are the server's real answer
    with the two cases written into their metadata on the way to the page."""
    def spoof(route):
        response = route.fetch()
        body = response.json()
        if "passages" in body and len(body["passages"]) >= 2:
            body["passages"][0]["metadata"].update(path="https://evil.example/phish", source="docs/a.md")
            body["passages"][1]["metadata"].update(path="https://evil.example/x", source="https://wiki.example.com/b",
                                                   url="https://wiki.example.com/b")
        route.fulfill(response=response, json=body)

    page.route("**/v1/query", spoof)
    card = ask(page, "white matter in newborns", pipeline="search")
    hrefs = [a.get_attribute("href") for a in card.locator("ol.sources a").all()]
    assert hrefs == ["https://wiki.example.com/b"]
    assert "docs/a.md" in card.locator("ol.sources li").first.inner_text()
    assert "evil.example" not in card.inner_html()


def test_thumbs_under_an_answer_post_its_rating_to_feedback(page, fresh_script, api_project):
    fresh_script.answer = "Diffusion tensor imaging measures it [1]."
    posted: list[dict] = []
    page.on("request", lambda r: posted.append(r.post_data_json) if r.url.endswith("/v1/feedback") else None)
    card = ask(page, QUESTION)
    rating = card.locator(".rating")
    answer_id = rating.get_attribute("data-answer-id")
    assert answer_id and len(answer_id) == 32
    card.locator("button.thumb.down").click()
    rating.locator(".rating-status", has_text="Thanks").wait_for(timeout=30_000)
    card.locator("button.thumb.up").click()
    card.locator("button.thumb.up[aria-pressed=true]").wait_for(timeout=30_000)  # not wait_for_function: the CSP forbids eval
    assert card.locator("button.thumb.down").get_attribute("aria-pressed") == "false"
    assert posted == [{"answer_id": answer_id, "rating": "down"}, {"answer_id": answer_id, "rating": "up"}]
    stored = [json.loads(line) for line in (api_project.parent / ".ragline" / "feedback" / "feedback.jsonl")
              .read_text().splitlines()]
    assert [r["rating"] for r in stored if r["answer_id"] == answer_id] == ["down", "up"]


def test_a_refused_feedback_says_why_under_the_answer(page, fresh_script):
    page.route("**/v1/feedback", lambda route: route.fulfill(
        status=404, json={"error": {"message": "field 'answer_id': no answer in the query log", "type": "x",
                                    "param": "answer_id", "code": "answer_not_found"}}))
    card = ask(page, QUESTION)
    card.locator("button.thumb.up").click()
    status = card.locator(".rating .rating-status", has_text="not saved")
    status.wait_for(timeout=30_000)
    assert "field 'answer_id'" in status.inner_text()
    assert card.locator("button.thumb.up").get_attribute("aria-pressed") == "false"


def test_follow_ups_send_the_conversation_as_text_bounded_and_a_new_one_starts_empty(page, fresh_script):
    """The chat page sends its earlier turns as `history` (so `recall_history` and a conversational
    `rewrite` serve the page, not only API clients): the answers' turns, oldest first, the last 12
    messages of at most 2,000 characters each; never rendered, so markup in an answer stays inert."""
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/query") else None)
    fresh_script.answer = 'White matter is measured by DTI [1]. <img src=x onerror="document.title=\'pwned\'">'
    first = ask(page, QUESTION)
    assert "<img" in first.locator(".answer").inner_text()  # shown as text
    assert page.locator("#conversation").is_visible()
    assert "conversation so far (1 exchange)" in page.inner_text("#conversation")
    fresh_script.answer = "By diffusion tensor imaging [1]."
    second = ask(page, "And in preterm infants?")
    assert "diffusion tensor imaging" in second.locator(".answer").inner_text()
    assert [body.get("history") for body in sent] == [[], [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": 'White matter is measured by DTI [1]. <img src=x onerror="document.title=\'pwned\'">'}]]
    assert page.locator("img").count() == 0 and page.title() != "pwned"

    page.click("#new-conversation")  # forgets the turns and the cards
    assert page.locator("article.card").count() == 0 and page.locator("#conversation").is_hidden()
    page.evaluate("() => { for (let i = 0; i < 20; i++) remember('q' + i + 'x'.repeat(3000), 'a' + i); }")
    ask(page, "white matter in newborns", pipeline="search")
    history = sent[-1]["history"]
    assert len(history) == 12 and history[0]["content"].startswith("q14") and history[-1]["content"] == "a19"
    assert max(len(turn["content"]) for turn in history) == 2000
