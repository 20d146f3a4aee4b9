"""Page citations over real HTTP: a PDF indexed page by page, asked through /v1/query and the
OpenAI surface; every source names its page ("p. 3") and links to it (#page=3)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fpdf import FPDF

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import AUTH, TOKEN, Script, running, write_project
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

PAGES = [
    "The orchard report counts apple trees, pear trees and plum trees planted along the river terraces. "
    "Pruning happens in late winter before the buds open.",
    "The harbour chapter lists fishing boats, their crews and the nets they mend each spring. "
    "Boats are painted blue and white every third year.",
    "The glacier survey measured ice thickness with ground penetrating radar at forty stations. "
    "The radar pulses reflect from the bedrock beneath the ice, which gives its depth.",
    "The bakery appendix gives recipes for rye bread, oat biscuits and honey cakes. "
    "Dough rests overnight in a cool cellar.",
]
QUESTION = "How was the glacier ice thickness measured at the stations?"
ANSWER = "The glacier ice thickness was measured with ground penetrating radar at forty stations [1]."


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("pages")
    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in PAGES:
        pdf.add_page()
        pdf.multi_cell(0, 7, text)
    (folder / "docs").mkdir()
    (folder / "docs" / "field-notes.pdf").write_bytes(bytes(pdf.output()))
    script = Script()
    script.answer = ANSWER
    with ScriptedLLM(script) as llm:
        path = write_project(folder, llm.base_url)
        path.write_text(path.read_text().replace(
            "with: {paths: [docs]}", 'with: {paths: [{path: docs, url_prefix: "https://files.example.org/notes/"}]}'))
        report = engine.run(load_project(path).pipeline("index"), orchestrate=False)
        assert report.added == 1
        from ragline.flows.serve.app import create_app

        with running(create_app(str(path), token=TOKEN)) as url:
            yield url


def test_query_sources_name_the_page_and_link_to_it(served):
    response = httpx.post(f"{served}/v1/query", json={"question": QUESTION}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()["answer"]
    assert not answer["refused"], answer
    (source,) = answer["sources"]
    assert (source["page"], source["page_start"], source["page_end"]) == ("p. 3", 3, 3)
    assert source["url"] == "https://files.example.org/notes/field-notes.pdf#page=3"
    assert "radar" in source["passage"]

    search = httpx.post(f"{served}/v1/query", json={"question": QUESTION, "pipeline": "search", "top_k": 4},
                        headers=AUTH, timeout=60).json()
    pages = {p["metadata"]["page_start"] for p in search["passages"]}
    assert pages == {1, 2, 3, 4} and search["passages"][0]["metadata"]["page_start"] == 3


def test_openai_surface_sources_carry_the_page(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    completion = client.chat.completions.create(model="ask", messages=[{"role": "user", "content": QUESTION}])
    source = completion.model_extra["sources"][0]
    assert (source["page"], source["url"]) == ("p. 3", "https://files.example.org/notes/field-notes.pdf#page=3")

    search = client.chat.completions.create(model="search", messages=[{"role": "user", "content": QUESTION}])
    assert search.choices[0].message.content.startswith("[1] field-notes, p. 3: ")
    assert search.model_extra["sources"][0]["page"] == "p. 3"


def test_chat_page_shows_the_page_and_links_to_it(served):
    import shutil

    from playwright.sync_api import sync_playwright

    from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page()
            page.add_init_script(f"sessionStorage.setItem('ragline.token', {TOKEN!r})")
            page.goto(served + "/")
            page.wait_for_selector("#pipeline option[value=ask]", state="attached")
            card = ask(page, QUESTION)
            card.locator("ol.sources li").first.wait_for(timeout=60_000)
            source = card.locator("ol.sources li").first
            assert "field-notes.pdf, p. 3" in source.inner_text()
            assert source.locator("a").first.get_attribute("href") == \
                "https://files.example.org/notes/field-notes.pdf#page=3"
            page.reload()
            page.wait_for_selector("#pipeline option[value=search]", state="attached")
            passages = ask(page, QUESTION, pipeline="search").locator("ol.sources li")
            passages.first.wait_for(timeout=60_000)
            assert ", p. 3" in passages.first.inner_text()
            assert passages.first.locator("a").first.get_attribute("href").endswith("field-notes.pdf#page=3")
        finally:
            browser.close()
