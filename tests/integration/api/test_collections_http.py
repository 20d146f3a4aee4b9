"""Named collections through the HTTP API (issue 19 item 1): two collections compiled from one template,
each indexed by its own pipeline into its own Chroma collection, BM25 index and state; real uvicorn,
real embeddings. A query naming one collection gets only its sources, each saying which collection it
came from; by default a query searches every collection its key may query; a key scoped to one
collection never sees the other, and asking for it is 403 naming it; an unknown name is 400 naming the
field. The OpenAI-compatible surface carries the collection in its sources too."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from ragline.flows.resources import clear_cache
from ragline.flows.serve.auth.keys import KeyStore, keys_file
from tests.helpers.api_harness import Script
from tests.helpers import pipelines
from tests.helpers.collections import handbook_and_papers, handbook_keys, served_with_query_log
from tests.helpers.query_log import logged_entry
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

QUERIES = pipelines.search() + pipelines.pipeline(
    "flare", "id: dense,  task: retrieve_dense, with: {k: 10}", "id: fuse,   task: fuse, with: {top_k: 4}",
    "id: insert, task: insert", "id: answer, task: generate_flare, with: {mode: instruct}") + pipelines.ask()
QUESTION = "vacation policy and the experiment results"
@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    script = Script()
    script.answer = "See [1]."
    with ScriptedLLM(script) as llm:
        yield handbook_and_papers(tmp_path_factory.mktemp("collections-http"), QUERIES, llm.base_url, timeout_seconds=10)
    clear_cache()


@pytest.fixture(scope="module")
def keys(project) -> dict[str, str]:
    return handbook_keys(project)


@pytest.fixture(scope="module")
def served(project, keys):
    with served_with_query_log(project) as url:
        yield url


def query(served: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{served}/v1/query", json={"pipeline": "search", "question": QUESTION, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def get(served: str, path: str, key: str | None = None) -> httpx.Response:
    """A GET with the module's timeout: on a loaded CI machine httpx's default 5 s was once too short."""
    return httpx.get(f"{served}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def collections_in(reply: httpx.Response) -> dict[str, set[str]]:
    """collection -> the folders of the sources it returned (the folder names the collection's sources)."""
    found: dict[str, set[str]] = {}
    for passage in reply.json()["passages"]:
        found.setdefault(passage["metadata"]["collection"], set()).add(passage["metadata"]["source"].split("/")[0])
    return found


def test_a_query_naming_one_collection_gets_only_its_sources(served, keys):
    reply = query(served, keys["all"], collections=["papers"])
    assert reply.status_code == 200, reply.text
    assert collections_in(reply) == {"papers": {"papers"}}


def test_by_default_a_query_searches_every_collection(served, keys):
    reply = query(served, keys["all"])
    assert reply.status_code == 200, reply.text
    assert collections_in(reply) == {"handbook": {"handbook"}, "papers": {"papers"}}


def test_a_key_scoped_to_one_collection_searches_only_it_and_is_refused_the_other(served, keys, project):
    reply = query(served, keys["handbook"])
    assert collections_in(reply) == {"handbook": {"handbook"}}
    assert logged_entry(project.parent, reply.json()["answer_id"])["collections"] == ["handbook"]  # the audit says which
    refused = query(served, keys["handbook"], collections=["papers"])
    assert refused.status_code == 403 and "'papers'" in refused.json()["error"]["message"]
    models = get(served, "/v1/models", keys["handbook"]).json()
    assert {m["id"] for m in models["data"]} == {"search", "flare", "ask"}  # it may query one of their collections


def test_an_unknown_collection_is_a_bad_request_naming_the_field(served, keys):
    reply = query(served, keys["all"], collections=["memos"])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "collections"
    assert "'memos'" in reply.json()["error"]["message"]


def test_openai_sources_say_which_collection_they_came_from(served, keys):
    body = {"model": "ask", "messages": [{"role": "user", "content": QUESTION}], "collections": ["handbook"]}
    reply = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {keys['all']}"})
    assert reply.status_code == 200, reply.text
    sources = reply.json()["sources"]
    assert sources and {s["collection"] for s in sources} == {"handbook"}


def test_the_collections_a_key_may_query_are_listed_with_their_counts(served, keys, project):
    listed = get(served, "/v1/collections", keys["all"])
    assert listed.status_code == 200, listed.text
    rows = {row["name"]: row for row in listed.json()["collections"]}
    assert list(rows) == ["handbook", "papers"]
    assert rows["handbook"]["documents"] == 2 and rows["handbook"]["chunks"] >= 2
    assert rows["papers"]["description"]

    mine = get(served, "/v1/collections", keys["handbook"])
    assert [row["name"] for row in mine.json()["collections"]] == ["handbook"]
    ingest_only = KeyStore(keys_file(project.parent)).create("ingest-only", ["ingest"], ["*"])[1]
    refused = get(served, "/v1/collections", ingest_only)
    assert refused.status_code == 403 and "scope 'query'" in refused.json()["error"]["message"]
    assert get(served, "/v1/collections").status_code == 401


def test_the_chat_page_picks_a_collection_and_says_where_each_citation_came_from(served, keys):
    """Headless Chromium: the picker lists what the key may query (from /v1/collections); a question
    asked of one collection cites only its sources, each labelled with its collection."""
    from playwright.sync_api import sync_playwright

    from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            for key, offered in (("handbook", ["", "handbook"]), ("all", ["", "handbook", "papers"])):
                page = browser.new_page()
                page.add_init_script(f"sessionStorage.setItem('ragline.token', {keys[key]!r})")
                page.goto(served + "/")
                page.wait_for_selector(f"#collection option[value={offered[-1]}]", state="attached")
                assert page.eval_on_selector_all("#collection option", "os => os.map(o => o.value)") == offered
            assert "papers" in page.locator("#collection option[value=papers]").inner_text()  # with its counts
            page.select_option("#collection", "papers")
            card = ask(page, QUESTION, pipeline="search")
            labels = card.locator("ol.sources li .source-collection").all_inner_texts()
            assert labels and set(labels) == {"papers"}
            page.select_option("#collection", "")
            card = ask(page, QUESTION, pipeline="ask")
            assert set(card.locator("ol.sources li .source-collection").all_inner_texts()) <= {"handbook", "papers"}
            assert card.locator("ol.sources li .source-collection").count() >= 1
        finally:
            browser.close()



def test_a_key_scoped_to_one_collection_may_ask_a_flare_pipeline(served, keys):
    """FLARE's store is the template's, which nothing writes once collections exist: its searches go
    to the collections the query searches, so a key needs only those, not the template's."""
    reply = query(served, keys["handbook"], pipeline="flare")
    assert reply.status_code == 200, reply.text
    assert {s["collection"] for s in reply.json()["answer"]["sources"]} <= {"handbook"}
