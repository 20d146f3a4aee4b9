"""Document-level access on a real index (issue 19 item 3): real embeddings, embedded Chroma, BM25
and the index state over a folder with hr/ and public/ files. A query with groups {eng} never gets
an hr chunk from dense, sparse or hybrid retrieval, context expansion or FLARE's re-retrieval; a
changed rule is applied by the next ingestion run without re-embedding anything, and a run killed
while re-granting converges to what a clean build holds."""
from __future__ import annotations

import math
import shutil
import signal

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Context, ContextDocument, Passage, Query
from ragline.flows.resources import clear_cache
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.run import engine
from ragline.flows.serve.query_service import access_for
from ragline.flows.spec.compile import load_project
from ragline.flows.spec.prompts import PromptLibrary
from ragline.tasks.refine import expand_context as expand_stage
from ragline.tasks.generate import flare as flare_stage
from tests.helpers.access_site import site_yaml, write_pipelines
from tests.helpers.harness import run_child, run_index, snapshot
from tests.helpers.llm_stages import REPO_PROMPTS
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

ENG = access_for({"eng"})
SECRET = "okapi"  # only hr/ files say it

# the access site's ingestion (tests/helpers/access_site.py) with its LLM never called (FLARE's test
# brings its own), and the query pipelines of this module
PIPELINES = site_yaml('[{prefix: "hr/", groups: HR_GROUPS}, {prefix: "", groups: []}]', """
  dense:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, with: {k: 50}}
      - {id: fuse,  task: fuse, with: {top_k: 50}}
  sparse:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 50}}
      - {id: fuse,   task: fuse, with: {top_k: 50}}
  hybrid:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 50}}
      - {id: sparse, task: retrieve_sparse, with: {k: 50}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse], with: {top_k: 50}}
  context:
    kind: query
    steps:
      - {id: dense,   task: retrieve_dense, with: {k: 50}}
      - {id: fuse,    task: fuse, with: {top_k: 50}}
      - {id: context, task: expand_context, with: {neighbours: 50, max_tokens: 4000, top_k: 50}}
""", chunk_size=40)
NO_LLM = "http://127.0.0.1:9/v1"

HR_FILES = {
    "hr/salaries.md": "# Salaries\n\n" + " ".join(
        f"Paragraph {i}: the {SECRET} salary band for level {i} engineers is confidential and reviewed yearly "
        f"by the compensation board of the {SECRET} programme." for i in range(6)),
    "hr/reviews.md": f"# Reviews\n\nPerformance reviews of the {SECRET} team happen in March and September.\n",
}
PUBLIC_FILES = {
    "public/guide.md": "# Guide\n\n" + " ".join(
        f"Section {i}: engineers open a pull request, ask for review, and merge once the salary-free checks "
        f"pass on the build server." for i in range(6)),
    "public/holidays.md": "# Holidays\n\nThe office is closed on public holidays and the last week of December.\n",
}
QUESTIONS = [f"{SECRET} salary band for engineers", "performance reviews in March", "salary review board",
             "how do engineers merge a pull request"]


def write_project(root, hr_groups: list[str]):
    return write_pipelines(root, PIPELINES.replace("HR_GROUPS", repr(hr_groups)), NO_LLM)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The hr/ and public/ files indexed once, for the tests that only query them."""
    root = tmp_path_factory.mktemp("access-site")
    for path, text in {**HR_FILES, **PUBLIC_FILES}.items():
        (root / "docs" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / path).write_text(text)
    path = write_project(root, ["hr"])
    report = run_index(path)
    assert report.added == 4 and not report.failures
    clear_cache()
    yield path
    clear_cache()


@pytest.fixture
def project(site, tmp_path):
    """A copy of the indexed site (files with their times, indexes, state: no re-embedding), for a
    test that changes its rules or its index."""
    clear_cache()  # nothing holds the site's stores open while they are copied
    shutil.copytree(site.parent, tmp_path / "site")
    yield tmp_path / "site" / "pipelines.yaml"
    clear_cache()


def ask(path, pipeline: str, text: str, access) -> list[Passage]:
    return engine.run(load_project(path).pipeline(pipeline), {"query": {"text": text, "access": access}},
                      orchestrate=False)


def hr(passages: list[Passage]) -> list[str]:
    return [p.chunk_id for p in passages if p.source_id.startswith("kb/hr/") or SECRET in p.text]


@pytest.mark.parametrize("pipeline", ["dense", "sparse", "hybrid", "context"])
def test_a_query_with_groups_eng_never_gets_an_hr_chunk(site, pipeline):
    for question in QUESTIONS:
        everything = ask(site, pipeline, question, None)  # no principal: today's behaviour
        assert everything and (hr(everything) or "merge" in question), (pipeline, question)
        restricted = ask(site, pipeline, question, ENG)
        assert restricted and not hr(restricted), (pipeline, question, hr(restricted))
        assert ask(site, pipeline, question, frozenset({"hr"})) or pipeline == "sparse"
    # the client's own filter narrows within the access, never widens it
    widened = {"$or": [{"root": "kb"}, {"format": "markdown"}]}
    passages = engine.run(load_project(site).pipeline(pipeline),
                          {"query": {"text": QUESTIONS[0], "filters": widened, "access": ENG}}, orchestrate=False)
    assert passages and not hr(passages)


def test_context_expansion_never_grows_into_a_chunk_the_query_may_not_read(site):
    """Even handed an hr hit (as if an upstream step leaked one), expansion adds none of its
    neighbours for {eng}; with every right it does."""
    resources = load_project(site)
    state, embedder = resources.resource("state"), resources.resource("embedder")
    rows = [r for r in state.source_chunks(["kb/hr/salaries.md"]) if r[2] == 2]
    hit = Passage(chunk_id=rows[0][0], source_id="kb/hr/salaries.md", text=rows[0][3])

    def expand(access):
        [out] = expand_stage.expand_context.fn(query=Query(text="q", access=access), passages=[hit],
                                               params=expand_stage.Params(neighbours=5, max_tokens=4000),
                                               ctx=StepContext(pipeline="p", step_id="c"), state=state,
                                               embedder=embedder)
        return out.text

    assert len(expand(None)) > len(hit.text) * 2
    assert expand(ENG) == hit.text


def test_flare_re_retrieval_reads_only_what_the_query_may(site):
    resources = load_project(site)
    store, embedder = resources.resource("store"), resources.resource("embedder")
    public = Passage(chunk_id="x", source_id="kb/public/holidays.md", text=PUBLIC_FILES["public/holidays.md"])

    def prompts(access) -> str:
        with ScriptedLLM(lambda p: f"The {SECRET} salary band is reviewed yearly [1].", logprob=math.log(0.5)) as server:
            llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
            ctx = StepContext(pipeline="t", step_id="flare", prompt_name="flare_continue",
                              render_prompt=PromptLibrary(REPO_PROMPTS).render)
            answer = flare_stage.generate_flare.fn(
                query=Query(text=f"What is the {SECRET} salary band?", access=access),
                context=Context(documents=[ContextDocument(number=1, passage=public)]),
                params=flare_stage.Params(threshold=0.95, k=5, max_sentences=2, max_retrievals=2), ctx=ctx,
                llm=llm, store=store, embedder=embedder)
            assert answer.retrievals >= 1
            return "\n".join(str(r.get("messages")) for r in server.requests)

    assert "compensation board" in prompts(None)  # re-retrieval found the hr chunk for an operator
    assert "compensation board" not in prompts(ENG)


def test_a_changed_rule_is_applied_by_reingestion_without_reembedding(project, monkeypatch):
    before = snapshot(project)
    embedded: list[int] = []
    encode = Embedder.encode_documents
    monkeypatch.setattr(Embedder, "encode_documents", lambda self, texts, *a, **k: (
        embedded.append(len(texts)), encode(self, texts, *a, **k))[1])
    assert not hr(ask(project, "hybrid", QUESTIONS[0], ENG))

    write_project(project.parent, ["hr", "eng"])  # eng may now read hr/
    report = run_index(project)
    assert (report.regranted, report.unchanged, report.updated, report.added, report.chunks_written) == (2, 2, 0, 0, 0)
    assert embedded == []  # nothing was embedded
    after = snapshot(project)
    assert [c[0] for c in after["chroma"]] == [c[0] for c in before["chroma"]] and after["sources"] == before["sources"]
    for pipeline in ("dense", "sparse", "hybrid"):
        assert hr(ask(project, pipeline, QUESTIONS[0], ENG)), pipeline
        assert not hr(ask(project, pipeline, QUESTIONS[0], frozenset({"sales"}))), pipeline
    again = run_index(project)
    assert (again.regranted, again.unchanged) == (0, 4)

    write_project(project.parent, [])  # hr/ is public now: every principal reads it
    assert run_index(project).regranted == 2 and embedded == []
    assert hr(ask(project, "sparse", QUESTIONS[0], frozenset()))


@pytest.mark.parametrize("failpoint", ["regrant.after_forget", "regrant.after_store"])
def test_a_run_killed_while_regranting_converges_to_a_clean_build(project, failpoint):
    """The worst case: killed after Chroma took the new rights, then the rule is put back before
    the next run. The next run must still make Chroma, BM25 and the state agree with the rule."""
    write_project(project.parent, ["hr", "eng"])
    crashed = run_child(project, failpoints=failpoint)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    write_project(project.parent, ["hr"])  # put back
    recovered = run_child(project)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    clear_cache()
    after = snapshot(project)
    for pipeline in ("dense", "sparse"):
        assert not hr(ask(project, pipeline, QUESTIONS[0], ENG)), pipeline
    clear_cache()
    shutil.rmtree(project.parent / "idx")
    run_index(project)
    assert after == snapshot(project)
