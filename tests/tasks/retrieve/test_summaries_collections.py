"""``ask_global`` over named collections and with request filters, and community summaries kept in a
PostgreSQL index state: real ingestion into embedded Chroma with the packaged MiniLM, the real
``summarize`` job per collection, the LLM through the scripted OpenAI-compatible server over real
HTTP (summaries name the topics they read, so which community is which is checked, not assumed)."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ragline.flows.contracts import COLLECTION_KEY, MEMBERS_KEY
from ragline.flows.errors import InputError
from ragline.flows.run import engine
from ragline.flows.serve.auth.principals import Principal, query_collections
from ragline.flows.spec.compile import load_project
from ragline.tasks.retrieve.summaries import SummariesMissing, SummariesStale
from tests.helpers import pipelines
from tests.helpers.communities import TOPICS, Counting, is_summarise, summary_reply
from tests.helpers.data import BASE_RESOURCES, REPO

RESOURCES = BASE_RESOURCES + """  llm:      {type: openai_compatible, base_url: "URL", max_retries: 0, timeout_seconds: 10}
"""
PIPELINES = "\npipelines:\n" + pipelines.index(write="delete_missing: true") + """  summarize:
    kind: job
    steps:
      - {id: summarize, task: summarize_communities, with: {communities: COMMUNITIES, top_communities: 1,
                                                            member_chunks: 4}}
  overview:
    kind: query
    steps:
      - {id: summaries, task: retrieve_summaries, with: {level: fine, top_k: null}}
  overview_any:
    kind: query
    steps:
      - {id: summaries, task: retrieve_summaries, with: {level: fine, top_k: null, filter_rule: any}}
  ask_global:
    kind: query
    steps:
      - {id: summaries, task: retrieve_summaries, with: {level: fine, top_k: 8}}
      - {id: insert,    task: insert, with: {order: relevance, max_tokens: 4000, max_documents: 8}}
      - {id: answer,    task: generate_map_reduce, with: {map_prompt: map_summary, score_notes: true, max_notes: 4}}
"""
# collection alpha: astronomy and cooking, public; beta: football public, cooking readable by group hr only
COLLECTIONS = """
collections:
  alpha: {paths: [alpha]}
  beta:  {paths: [beta, {path: beta_hr, access: [{prefix: "", groups: [hr]}]}]}
"""
FOLDERS = {"alpha": ("astronomy", "cooking"), "beta": ("football",), "beta_hr": ("cooking",)}


def topics_of(passage) -> set[str]:
    return set(re.findall(r"topic (astronomy|cooking|football)", passage.text))


def write_docs(root: Path, folders: dict[str, tuple[str, ...]]) -> None:
    for folder, topics in folders.items():
        (root / folder).mkdir(parents=True)
        for topic in topics:
            for n, text in enumerate(TOPICS[topic]):
                (root / folder / f"{topic}{n}.txt").write_text(text)


def reply(prompt: str) -> str:
    """Summaries name their topics; a map note scores the astronomy summary highest; the answer cites note 1."""
    if is_summarise(prompt):
        return summary_reply(prompt)
    if prompt.rstrip().endswith("Notes:"):
        topic = re.search(r"topic (astronomy|cooking|football)", prompt).group(1)
        return {"astronomy": "Astronomy.\nScore: 90", "cooking": "Cooking.\nScore: 70",
                "football": "Football.\nScore: 50"}[topic]
    return "The themes are astronomy [1] and more [2] [3] [4]."


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    """Two named collections, indexed and summarised per collection; yields (project, llm). Built once
    for the module: its tests only read (the one that republishes a summary set puts it back)."""
    tmp_path = tmp_path_factory.mktemp("summaries-collections")
    write_docs(tmp_path, FOLDERS)
    (tmp_path / "prompts").symlink_to(REPO / "prompts")
    with Counting(reply) as llm:
        (tmp_path / "pipelines.yaml").write_text(textwrap.dedent(
            RESOURCES.replace("URL", llm.base_url) + PIPELINES.replace("COMMUNITIES", "2") + COLLECTIONS))
        project = load_project(tmp_path / "pipelines.yaml")
        for name in ("alpha", "beta"):
            engine.run(project.pipeline(f"index@{name}"), orchestrate=False)
            engine.run(project.pipeline(f"summarize@{name}"), orchestrate=False)
        yield project, llm


def ask(project, pipeline: str, **query):
    return engine.run(project.pipeline(pipeline), {"query": {"text": "What are the main themes?", **query}},
                      orchestrate=False)


def test_ask_global_reads_every_collection_a_request_selects_merged_by_score(collections):
    project, llm = collections
    found = ask(project, "overview")
    by_collection = {(p.metadata[COLLECTION_KEY], frozenset(topics_of(p))) for p in found}
    assert by_collection == {("alpha", frozenset({"astronomy"})), ("alpha", frozenset({"cooking"})),
                             ("beta", frozenset({"football"})), ("beta", frozenset({"cooking"}))}
    assert [p.score for p in found] == sorted((p.score for p in found), reverse=True)  # one ranking over both
    assert len({p.chunk_id for p in found}) == 4
    assert all(p.chunk_id.startswith(f"community:{p.metadata[COLLECTION_KEY]}:") for p in found)
    # each community's members are its own collection's documents
    folders = {"alpha": ("alpha/",), "beta": ("beta/", "beta_hr/")}
    assert all(d.startswith(folders[p.metadata[COLLECTION_KEY]]) for p in found
               for d in p.metadata[MEMBERS_KEY].split("\n"))
    only_a = ask(project, "overview", collections=["alpha"])
    assert {p.metadata[COLLECTION_KEY] for p in only_a} == {"alpha"} and len(only_a) == 2
    # top_k is over all collections: the football question's best summary comes from b
    top = engine.run(project.pipeline("ask_global").with_overrides({"summaries": {"top_k": 1}}),
                     {"query": {"text": "Who scored the goal in the football match?"}}, orchestrate=False)
    [source] = top.sources
    assert source.collection == "beta" and all(d.startswith("beta/football") for d in source.documents)
    with pytest.raises(InputError, match="unknown collection 'gamma'"):
        ask(project, "overview", collections=["gamma"])


def test_a_request_limited_to_some_groups_sees_no_community_with_a_document_it_may_not_read(collections):
    project, llm = collections
    public = ask(project, "overview", access=["eng"])
    assert {(p.metadata[COLLECTION_KEY], frozenset(topics_of(p))) for p in public} == {
        ("alpha", frozenset({"astronomy"})), ("alpha", frozenset({"cooking"})), ("beta", frozenset({"football"}))}
    assert not any("beta_hr/" in p.metadata[MEMBERS_KEY] for p in public)
    hr = ask(project, "overview", access=["hr"])
    assert any("beta_hr/" in p.metadata[MEMBERS_KEY] for p in hr) and len(hr) == 4
    # the same through the whole pipeline: no citation names a document the request may not read
    answer = ask(project, "ask_global", access=["eng"])
    assert answer.sources and not any(d.startswith("beta_hr/") for s in answer.sources for d in s.documents)


def test_ask_global_is_authorised_per_collection_like_a_retriever(collections):
    project, llm = collections
    pipeline = project.pipeline("ask_global")
    assert pipeline.collections == ["alpha", "beta"]

    def request(allowed: set[str]):
        principal = Principal(id="key:1", kind="key", scopes=frozenset({"query"}), collections=frozenset(allowed))
        return SimpleNamespace(state=SimpleNamespace(principal=principal))

    # a key for beta reads beta's summaries only
    assert query_collections(request({"beta"}), pipeline, None)[1] == ["beta"]
    assert query_collections(request({"*"}), pipeline, None)[1] == ["alpha", "beta"]


def test_request_filters_keep_communities_whose_member_chunks_match(collections):
    project, llm = collections
    astronomy = [f"alpha/astronomy{n}.txt" for n in range(4)]
    # all member chunks must match (the default): the astronomy community, whole, and nothing else
    [whole] = ask(project, "overview", filters={"source_id": {"$in": astronomy}})
    assert topics_of(whole) == {"astronomy"} and sorted(whole.metadata[MEMBERS_KEY].split("\n")) == astronomy
    # half of its documents: its summary read the others too, so `all` leaves it out ...
    assert ask(project, "overview", filters={"source_id": {"$in": astronomy[:2]}}) == []
    # ... `any` keeps it and cites only the matching documents
    [part] = ask(project, "overview_any", filters={"source_id": {"$in": astronomy[:2]}})
    assert topics_of(part) == {"astronomy"} and part.metadata[MEMBERS_KEY].split("\n") == astronomy[:2]
    assert "(2 documents)" in part.title
    # the retrievers' filter language and its checks, naming the field
    with pytest.raises(InputError, match=r"unknown filter operator '\$regex' on field 'source_id'"):
        ask(project, "overview", filters={"source_id": {"$regex": "alpha/.*"}})
    with pytest.raises(InputError, match="reserved for access control"):
        ask(project, "overview", filters={"ragline_acl_public": True})


def test_a_collection_without_summaries_names_its_job(tmp_path):
    write_docs(tmp_path, FOLDERS)
    with Counting(reply) as llm:
        (tmp_path / "pipelines.yaml").write_text(textwrap.dedent(
            RESOURCES.replace("URL", llm.base_url) + PIPELINES.replace("COMMUNITIES", "2") + COLLECTIONS))
        project = load_project(tmp_path / "pipelines.yaml")
        engine.run(project.pipeline("index@alpha"), orchestrate=False)
        engine.run(project.pipeline("summarize@alpha"), orchestrate=False)
        assert len(ask(project, "overview", collections=["alpha"])) == 2
        with pytest.raises(Exception, match="ragline run summarize --collection beta") as raised:
            ask(project, "overview")
    assert isinstance(raised.value.__cause__, SummariesMissing)


@pytest.mark.parametrize("state_backend", ["postgres"], indirect=True)
def test_summaries_of_a_postgresql_state_are_rows_of_each_collections_schema(tmp_path, state_backend):
    """A database state has no file of its own (its `path` is the template's for every collection):
    the summaries are published into each collection's schema, the job and ask_global read them there."""
    write_docs(tmp_path, FOLDERS)
    (tmp_path / "prompts").symlink_to(REPO / "prompts")
    with Counting(reply) as llm:
        text = state_backend(textwrap.dedent(
            RESOURCES.replace("URL", llm.base_url) + PIPELINES.replace("COMMUNITIES", "2") + COLLECTIONS))
        assert "postgresql://" in text
        (tmp_path / "pipelines.yaml").write_text(text)
        project = load_project(tmp_path / "pipelines.yaml")
        reports = {}
        for name in ("alpha", "beta"):
            engine.run(project.pipeline(f"index@{name}"), orchestrate=False)
            reports[name] = engine.run(project.pipeline(f"summarize@{name}"), orchestrate=False)
        for name, report in reports.items():
            state = project.resource(f"state@{name}")
            assert report.written and report.path == state.summaries().location and "meta row" in report.path
            assert "pg-" not in report.path  # the URL's password is never shown
            assert state.summaries().load().model_dump() == report.model_dump()
        assert not list(tmp_path.rglob("*.summaries.json"))  # no file on this machine
        found = ask(project, "overview")
        assert {(p.metadata[COLLECTION_KEY], frozenset(topics_of(p))) for p in found} == {
            ("alpha", frozenset({"astronomy"})), ("alpha", frozenset({"cooking"})), ("beta", frozenset({"football"})),
            ("beta", frozenset({"cooking"}))}
        # request filters read the member chunks' metadata from the database
        [astronomy] = ask(project, "overview", filters={"source_id": {"$in": [f"alpha/astronomy{n}.txt"
                                                                              for n in range(4)]}})
        assert topics_of(astronomy) == {"astronomy"} and astronomy.metadata[COLLECTION_KEY] == "alpha"
        # an incremental re-run reads the published rows: nothing changed, nothing is summarised
        calls = len(llm.summaries())
        again = engine.run(project.pipeline("summarize@alpha"), orchestrate=False)
        assert again.summarised == [] and len(llm.summaries()) == calls
        answer = ask(project, "ask_global", access=["eng"])
        assert not answer.refused and answer.sources
        assert not any(d.startswith("beta_hr/") for s in answer.sources for d in s.documents)


@pytest.mark.integration
def test_served_ask_global_takes_the_requests_collections_and_filters(collections):
    """Over the real HTTP API (uvicorn): a request naming a collection reads its summaries only (before,
    ask_global searched no named collections and refused the field); a bad filter is a 400 naming it."""
    from ragline.flows.serve.app import create_app
    from tests.helpers.api_harness import AUTH, TOKEN, running

    project, llm = collections
    with running(create_app(str(project.path), token=TOKEN)) as url:
        def post(body: dict) -> httpx.Response:
            return httpx.post(f"{url}/v1/query", json={"pipeline": "ask_global", "question": "What are the main "
                                                                                           "themes?", **body},
                              headers=AUTH, timeout=120)

        only_beta = post({"collections": ["beta"]})
        assert only_beta.status_code == 200, only_beta.text
        sources = only_beta.json()["answer"]["sources"]
        assert sources and {s["collection"] for s in sources} == {"beta"}
        both = post({})
        assert {s["collection"] for s in both.json()["answer"]["sources"]} == {"alpha", "beta"}
        bad = post({"filters": {"source_id": {"$regex": "x"}}})
        assert bad.status_code in (400, 422) and "source_id" in bad.text and "$regex" in bad.text
        unknown = post({"collections": ["gamma"]})
        assert unknown.status_code == 400 and "collections" in unknown.text


def test_a_bad_fixed_filter_is_a_located_error_in_pipelines_yaml(tmp_path):
    from ragline.flows.spec.parse import SpecValidationError

    text = RESOURCES.replace("URL", "http://127.0.0.1:9/v1") + PIPELINES.replace("COMMUNITIES", "2").replace(
        "with: {level: fine, top_k: null, filter_rule: any}", "with: {where: {year: {$regex: '20.*'}}}")
    (tmp_path / "pipelines.yaml").write_text(textwrap.dedent(text))
    with pytest.raises(SpecValidationError) as raised:
        load_project(tmp_path / "pipelines.yaml")
    message = str(raised.value)
    assert "pipelines.yaml:" in message and "overview_any" in message and "$regex" in message and "'year'" in message


def test_summaries_embedded_by_another_model_are_a_clear_503_not_a_wrong_ranking(collections):
    project, llm = collections
    state = project.resource("state@beta")
    report = state.summaries().load()
    state.summaries().publish(report.model_copy(update={"embedder": "another-model"}))
    try:
        with pytest.raises(Exception, match="embedded with 'another-model'.*summarize --collection beta") as raised:
            ask(project, "overview")
        assert isinstance(raised.value.__cause__, SummariesStale) and raised.value.__cause__.http_status == 503
        assert len(ask(project, "overview", collections=["alpha"])) == 2  # the other collection's still answer
    finally:
        state.summaries().publish(report)  # the module's other tests read it
    assert len(ask(project, "overview")) == 4
