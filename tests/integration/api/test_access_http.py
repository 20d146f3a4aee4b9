"""Document access through the HTTP API (issue 19 items 3 and 5): API keys with groups, a real
uvicorn server, real embeddings, Chroma and BM25. Whatever a key asks, through `/v1/query` (JSON
and streamed) or `/v1/chat/completions` (streamed), with or without its own filter, no passage,
citation or stream frame carries a document its groups may not read; nor does any MCP tool result,
resource or progress notification (`/mcp`); the query log names who asked."""
from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragline.flows.resources import clear_cache
from ragline.flows.serve.auth.keys import KeyStore, keys_file
from ragline.flows.serve.supervise.service import api_app
from ragline.flows.spec.compile import load_project
from tests.helpers import pipelines
from tests.helpers.access_site import citing_llm, index_site, site_yaml, write_notes, write_pipelines
from tests.helpers.api_harness import running
from tests.helpers.query_log import logged_entry
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

pytestmark = pytest.mark.integration

GROUPS = ("hr", "eng", "legal")
DOCS = {  # folder -> (groups that may read it, a word only its documents say)
    "hr": (["hr"], "okapi"), "eng": (["eng"], "narwhal"), "legal": (["legal", "hr"], "quokka"), "public": ([], "otter")}
PIPELINES = site_yaml('[{prefix: "hr/", groups: [hr]}, {prefix: "eng/", groups: [eng]}, '
                      '{prefix: "legal/", groups: [legal, hr]}]', pipelines.search(k=40, top_k=40) + pipelines.ask())
WORDS = [word for _, word in DOCS.values()] + ["salary", "review", "contract", "build", "holiday"]


def _document(folder: str, number: int, word: str) -> str:
    return (f"# {folder.title()} note {number}\n\n" + " ".join(
        f"Item {i}: the {word} {folder} record {number} covers salary, review, contract, build and holiday "
        f"rules for the {word} team." for i in range(4)) + "\n")


@pytest.fixture(scope="module")
def llm():
    with citing_llm() as server:
        yield server


@pytest.fixture(scope="module")
def project(tmp_path_factory, llm) -> Path:
    folder = tmp_path_factory.mktemp("access-http")
    write_notes(folder, {name: word for name, (_, word) in DOCS.items()}, 3, _document)
    yield index_site(write_pipelines(folder, PIPELINES, llm.base_url), 12)
    clear_cache()


@pytest.fixture(scope="module")
def keys(project) -> dict[frozenset, str]:
    """One key per set of groups (none, each one, two together): all may query everything."""
    store = KeyStore(keys_file(project.parent))
    sets = [frozenset(), *(frozenset([g]) for g in GROUPS), frozenset(["eng", "legal"])]
    return {groups: store.create("k" + "-".join(sorted(groups)), ["query"], ["*"], groups=sorted(groups))[1]
            for groups in sets}


@pytest.fixture(scope="module")
def served(project, keys, monkeypatch_module):
    monkeypatch_module.setenv("RAGLINE_QUERY_LOG", "1")
    with running(api_app(project)) as url:
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def readable(groups: frozenset) -> set[str]:
    return {folder for folder, (allowed, _) in DOCS.items() if not allowed or groups & set(allowed)}


def folders_in(text: str) -> set[str]:
    """Which folders' documents a response (or a stream frame) carries, by their ids and their words."""
    return {folder for folder, (_, word) in DOCS.items() if f"kb/{folder}/" in text or word in text}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(groups=st.sampled_from([frozenset(), frozenset(["hr"]), frozenset(["eng"]), frozenset(["legal"]),
                               frozenset(["eng", "legal"])]),
       words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=3),
       client_filter=st.sampled_from([None, {"chunk": {"$gte": 0}}, {"ragline_acl.hr": True}, {"title": "x"}]),
       stream=st.booleans())
def test_no_response_or_frame_carries_a_document_the_key_may_not_read(served, keys, groups, words, client_filter,
                                                                       stream):
    body = {"pipeline": "search", "question": " ".join(words), "top_k": 40, "stream": False}
    if client_filter is not None:
        body["filters"] = client_filter
    reply = httpx.post(f"{served}/v1/query", json=body, headers={"Authorization": f"Bearer {keys[groups]}"},
                       timeout=60)
    if client_filter is not None and "ragline_acl.hr" in client_filter:
        assert reply.status_code == 422 and "ragline_acl" in reply.json()["error"]["message"]  # cannot widen
        return
    assert reply.status_code == 200, reply.text
    assert "ragline_acl" not in reply.text  # which groups may read a document is not shown to its readers
    shown = folders_in(reply.text)
    assert shown <= readable(groups), (groups, shown)
    if stream and client_filter is None:
        chat = {"model": "ask", "stream": True, "messages": [{"role": "user", "content": " ".join(words)}]}
        with httpx.stream("POST", f"{served}/v1/chat/completions", json=chat, timeout=60,
                          headers={"Authorization": f"Bearer {keys[groups]}"}) as response:
            assert response.status_code == 200
            frames = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "data: [DONE]"
        for frame in frames:
            assert folders_in(frame) <= readable(groups), (groups, frame[:300])


@pytest.fixture(scope="module")
def chunk_ids(project) -> list[str]:
    return sorted(load_project(project).resource("state").chunk_ids())


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(groups=st.sampled_from([frozenset(), frozenset(["hr"]), frozenset(["eng"]), frozenset(["legal"]),
                               frozenset(["eng", "legal"])]),
       words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=3),
       client_filter=st.sampled_from([None, {"chunk": {"$gte": 0}}, {"ragline_acl.hr": True}]),
       chunk=st.integers(min_value=0, max_value=11))
def test_no_mcp_result_resource_or_progress_carries_a_document_the_key_may_not_read(served, keys, chunk_ids, groups,
                                                                                    words, client_filter, chunk):
    """The same property over MCP: search, ask (and its progress notifications), get_passage of any
    chunk, list_documents, the resource list and a read of every document."""
    shown: list[str] = []

    async def progress(done, total, message):
        shown.append(message)

    async def go():
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {keys[groups]}"},
                                      timeout=httpx2.Timeout(30, read=300)) as http:
            async with streamable_http_client(f"{served}/mcp", http_client=http) as (read, write):
                async with ClientSession(read, write) as client:
                    await client.initialize()
                    arguments = {"query": " ".join(words), "k": 40}
                    if client_filter is not None:
                        arguments["filters"] = client_filter
                    results = [await client.call_tool("search", arguments),
                               await client.call_tool("ask", {"question": " ".join(words)}, progress_callback=progress),
                               await client.call_tool("get_passage", {"chunk_id": chunk_ids[chunk % len(chunk_ids)]}),
                               await client.call_tool("list_documents", {})]
                    listed = await client.list_resources()
                    results.append(listed)
                    for folder in DOCS:
                        try:
                            results.append(await client.read_resource(f"ragline://test/kb/{folder}/note0.md"))
                        except Exception as exc:  # noqa: BLE001 - a refusal names what was asked, nothing more
                            shown.append(str(exc).replace(f"kb/{folder}/note0.md", "<asked>"))
                    return results

    results = anyio.run(go)
    texts = [json.dumps(r.model_dump(mode="json")) for r in results] + shown
    if client_filter is not None and "ragline_acl.hr" in client_filter:
        assert results[0].is_error and "ragline_acl" in results[0].content[0].text  # cannot widen
        texts = texts[1:]
    for text in texts:
        assert "ragline_acl" not in text and "/tmp/" not in text, text[:300]
        assert folders_in(text) <= readable(groups), (groups, text[:300])
    documents = results[3].structured_content["documents"]
    assert {d["source"].split("/")[1] for d in documents} == readable(groups)  # not a wall around everything


def test_every_reader_finds_what_its_groups_may_read(served, keys):
    """The filter is not a wall around everything: each folder is found by the keys that may read it."""
    for groups, key in keys.items():
        seen: set[str] = set()
        for word in WORDS[:4]:
            reply = httpx.post(f"{served}/v1/query", json={"pipeline": "search", "question": word, "top_k": 40},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
            seen |= folders_in(reply.text)
        assert seen == readable(groups), (groups, seen)


def test_the_query_log_names_the_key_that_asked_and_that_it_was_restricted(served, keys, project):
    key = keys[frozenset(["eng"])]
    reply = httpx.post(f"{served}/v1/query", json={"pipeline": "search", "question": "narwhal"},
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
    answer_id = reply.json()["answer_id"]
    entry = logged_entry(project.parent, answer_id)
    key_id = key.split("_")[1]
    assert entry["principal"] == f"key:{key_id}" and entry["restricted"] is True
    log = project.parent / ".ragline" / "query-log" / "queries.jsonl"
    assert key not in log.read_text()  # the secret is never logged
