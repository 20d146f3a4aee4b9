"""Document access on the paths the HTTP property test (api/test_access_http.py) does not walk
(issue 19 item 5): a run's stored result through `GET /v1/runs/{id}`, the chat page in a real
headless Chromium, and an ACL change applied by a re-ingestion in another process while the
server runs (old rights revoked on the next query, not after a restart). Real uvicorn, real
embeddings, Chroma and BM25, API keys with groups, the scripted LLM."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ragline.flows.resources import clear_cache
from ragline.flows.serve.auth.keys import KeyStore, keys_file
from ragline.flows.serve.supervise.service import api_app, served_flow
from ragline.flows.spec.compile import load_project

from tests.helpers import access_site
from tests.helpers.access_site import bearer, citing_llm, index_site, site_yaml, write_notes
from tests.helpers.api_harness import running
from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS, ask
from tests.helpers.harness import run_child
from tests.helpers import pipelines
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

TOKEN = "operator-token"  # the legacy token: the operator, reads every document
DOCS = {"hr": (["hr"], "okapi"), "eng": (["eng"], "narwhal"), "public": ([], "otter")}  # folder -> (groups, word)
PIPELINES = site_yaml('[{prefix: "hr/", groups: HR_GROUPS}, {prefix: "eng/", groups: [eng]}]', """
  dense:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 20}}
      - {id: fuse,  task: fuse, with: {top_k: 20}}
  sparse:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 20}}
      - {id: fuse,   task: fuse, with: {top_k: 20}}
""" + pipelines.search() + pipelines.ask())
QUESTION = "okapi narwhal otter salary review build"  # every folder's word: unrestricted, it finds all three


def write_pipelines(folder: Path, llm_url: str, hr_groups: list[str]) -> Path:
    return access_site.write_pipelines(folder, PIPELINES.replace("HR_GROUPS", json.dumps(hr_groups)), llm_url)


def note(name: str, number: int, word: str) -> str:
    return f"# {name.title()} note {number}\n\n" + " ".join(
        f"Item {i}: the {word} {name} record {number} covers salary, review and build rules." for i in range(3))


def folders_in(text: str) -> set[str]:
    """Which folders' documents a response, a stored result or a page carries: their ids and their
    text (not the question's words, which a page or an answer may echo)."""
    return {folder for folder, (_, word) in DOCS.items() if f"kb/{folder}/" in text or f"{word} {folder} record" in text}


@pytest.fixture(scope="module")
def llm() -> Iterator[ScriptedLLM]:
    with citing_llm() as server:
        yield server


@pytest.fixture(scope="module")
def project(tmp_path_factory, llm) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("access-paths")
    write_notes(folder, {name: word for name, (_, word) in DOCS.items()}, 2, note)
    yield index_site(write_pipelines(folder, llm.base_url, ["hr"]), 6)
    clear_cache()


@pytest.fixture(scope="module")
def keys(project) -> dict[str, str]:
    store = KeyStore(keys_file(project.parent))
    return {group: store.create(f"reader-{group}", ["query"], ["*"], groups=[group])[1] for group in ("hr", "eng")}


@pytest.fixture(scope="module")
def served(project, keys) -> Iterator[str]:
    with running(api_app(project, token=TOKEN)) as url:
        yield url


def shown(served: str, secret: str) -> dict[str, set[str]]:
    """The folders dense and sparse search each show to ``secret``, and a streamed chat completion
    (every frame)."""
    seen = {}
    for pipeline in ("dense", "sparse"):
        reply = httpx.post(f"{served}/v1/query", json={"pipeline": pipeline, "question": QUESTION, "top_k": 20},
                           headers=bearer(secret), timeout=60)
        assert reply.status_code == 200, reply.text
        seen[pipeline] = folders_in(reply.text)
    chat = {"model": "ask", "stream": True, "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", f"{served}/v1/chat/completions", json=chat, headers=bearer(secret),
                      timeout=60) as response:
        assert response.status_code == 200
        seen["chat"] = set().union(*(folders_in(line) for line in response.iter_lines()))
    return seen


# ----------------------------------------------------------------------------- GET /v1/runs/{id}
def stored_run(project: Path, access: list[str] | None) -> str:
    """The id of a completed flow run of `search` whose result is persisted as JSON, as `ragline
    serve`'s deployments persist theirs, read with ``access`` (a deployment's `triggered_groups`)."""
    query: dict = {"text": QUESTION}
    if access is not None:
        query["access"] = access
    state = served_flow(load_project(project))(pipeline="search", inputs={"query": query}, file=str(project),
                                               return_state=True)
    assert state.is_completed(), state
    return str(state.state_details.flow_run_id)


def run_result(served: str, secret: str, run_id: str) -> dict:
    reply = httpx.get(f"{served}/v1/runs/{run_id}", headers=bearer(secret), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_stored_result_is_shown_only_to_principals_that_may_read_all_it_holds(served, keys, project,
                                                                                   prefect_server):
    everything = stored_run(project, None)  # as with triggered_groups '*'
    as_operator = run_result(served, TOKEN, everything)
    assert folders_in(json.dumps(as_operator["result"])) == {"hr", "eng", "public"}
    for group in ("hr", "eng"):
        shown = run_result(served, keys[group], everything)
        assert shown["state"] == "COMPLETED" and folders_in(json.dumps(shown)) <= {group, "public"}, (group, shown)

    hr_only = stored_run(project, ["hr"])  # as with triggered_groups 'hr'
    shown = run_result(served, keys["hr"], hr_only)
    assert folders_in(json.dumps(shown["result"])) == {"hr", "public"}  # its reader sees it all
    assert folders_in(json.dumps(run_result(served, keys["eng"], hr_only))) <= {"eng", "public"}
    public = stored_run(project, [])  # the default: public documents only, shown to every reader
    assert folders_in(json.dumps(run_result(served, keys["eng"], public)["result"])) == {"public"}


# ----------------------------------------------------------------------------- the chat page
@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


def page_shows(browser, served: str, secret: str) -> set[str]:
    """The folders the chat page shows (or holds in its DOM, or received from the API) to a
    reader with key ``secret``, after asking the ask and the search pipeline."""
    context = browser.new_context()
    page = context.new_page()
    responses: list = []
    page.on("response", lambda response: responses.append(response) if "/v1/" in response.url else None)
    page.add_init_script(f"sessionStorage.setItem('ragline.token', {secret!r})")
    page.goto(served + "/")
    page.wait_for_selector("#pipeline option[value=ask]", state="attached")
    ask(page, QUESTION, "ask")
    ask(page, QUESTION, "search")
    page.wait_for_load_state("networkidle")
    shown = folders_in(page.content()) | folders_in("\n".join(r.text() for r in responses))
    context.close()
    return shown


def test_the_chat_page_shows_a_reader_only_what_its_groups_may_read(browser, served, keys):
    assert page_shows(browser, served, keys["hr"]) == {"hr", "public"}  # the page does show what it may
    assert page_shows(browser, served, keys["eng"]) == {"eng", "public"}
    for group, status in (("hr", 200), ("eng", 404)):  # the panel's list, and one document asked by id
        assert httpx.get(f"{served}/v1/documents/kb/hr/note0.md", headers=bearer(keys[group]),
                         timeout=30).status_code == status, group


# ----------------------------------------------------------------------------- ACL change + re-ingestion
def test_an_acl_change_reingested_elsewhere_applies_to_the_next_query_of_the_running_server(served, keys,
                                                                                           project, llm):
    """`ragline index` in another process re-grants hr/ to eng, then takes it back; the server, not
    restarted, shows eng the hr notes on the query after the first run and never after the second."""
    def only(folders: set[str], secret: str) -> dict[str, set[str]]:
        seen = shown(served, secret)
        return {"dense": seen["dense"], "sparse": seen["sparse"], "chat beyond": seen["chat"] - folders}

    def expected(folders: set[str]) -> dict[str, set[str]]:
        return {"dense": folders, "sparse": folders, "chat beyond": set()}

    assert only({"eng", "public"}, keys["eng"]) == expected({"eng", "public"})
    write_pipelines(project.parent, llm.base_url, ["hr", "eng"])
    granted = run_child(project)
    assert granted.returncode == 0, granted.stderr[-2000:]
    # the grant is seen by the next query of the running server (not restarted)
    assert only({"hr", "eng", "public"}, keys["eng"]) == expected({"hr", "eng", "public"})
    write_pipelines(project.parent, llm.base_url, ["hr"])
    revoked = run_child(project)
    assert revoked.returncode == 0, revoked.stderr[-2000:]
    assert only({"eng", "public"}, keys["eng"]) == expected({"eng", "public"})  # and its revocation
    assert only({"hr", "public"}, keys["hr"]) == expected({"hr", "public"})
