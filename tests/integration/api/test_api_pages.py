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
        from ragline.flows.serve.api import create_app

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
