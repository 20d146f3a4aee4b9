"""The query flow against a real vLLM server (SmolLM2-135M on CPU): never asserting exact text,
which differs between bf16 and fp32, only the contract of each stage."""
from __future__ import annotations

import shutil

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.data import REPO

pytestmark = [pytest.mark.integration, pytest.mark.llm]


@pytest.fixture(scope="module")
def sample_project(tmp_path_factory, vllm_server):
    """The shipped pipelines.yaml and sample docs, pointed at the test's vLLM server, indexed."""
    import os

    folder = tmp_path_factory.mktemp("ask")
    shutil.copy(REPO / "pipelines.yaml", folder / "pipelines.yaml")
    shutil.copytree(REPO / "samples", folder / "samples")
    shutil.copytree(REPO / "prompts", folder / "prompts")
    os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"] = vllm_server.base_url, vllm_server.model
    try:
        project = load_project(folder / "pipelines.yaml")
    finally:
        del os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"]
    engine.run(project.pipeline("index"), orchestrate=False)
    return project


def test_ask_answers_grounded_question_with_mapped_citations(sample_project):
    answer = engine.run(sample_project.pipeline("ask"),
                        {"query": "What happens to a document that cannot be read?"}, orchestrate=False)
    assert answer.text and answer.confidence is not None and 0 < answer.confidence <= 1
    assert not answer.invalid_citations
    for source in answer.sources:
        assert source.path.startswith("samples/docs/") and source.passage  # below its root, never a server path
        assert str(sample_project.base_dir) not in source.path


def test_ask_refuses_what_the_corpus_does_not_contain(sample_project):
    answer = engine.run(sample_project.pipeline("ask"), {"query": "What is the capital of Peru?"},
                        orchestrate=False)
    assert answer.refused and answer.text == "I cannot answer this question" and answer.reason


def test_streaming_as_a_prefect_flow(sample_project, prefect_server):
    pipeline = sample_project.pipeline("ask").with_overrides({"answer": {"stream": True}})
    pieces: list[str] = []
    # a question the evidence answers: the LLM is called only then (evidence first, issue 34)
    answer = engine.run(pipeline, {"query": "What happens to a document that cannot be read?"},
                        on_token=pieces.append)
    assert answer.evidence is not None and not answer.evidence.refused
    assert len(pieces) > 1
    assert "".join(pieces).strip().removeprefix("Answer:").strip()[:20] in (answer.draft or answer.text)


def test_conversational_rewrite_with_history(sample_project):
    history = [{"role": "user", "content": "How does ragline chunk documents?"},
               {"role": "assistant", "content": "With the embedding model's tokenizer."}]
    trace: list = []
    answer = engine.run(sample_project.pipeline("ask"),
                        {"query": {"text": "And how does it keep them up to date?", "history": history}},
                        orchestrate=False, trace=trace)
    assert answer.question == "And how does it keep them up to date?"
    assert [step for step, _ in trace] == ["rewrite", "dense", "sparse", "fuse", "insert", "gate", "evidence",
                                        "answer", "check"]


# Contract tests, not quality ones: short generations keep the CPU model's minutes down.
# short generations and two passages to take notes on: the pipeline's every step still runs on the real
# model, at a third of the CPU time (each note and the rerank prefill whole passages)
SHORT_FUSION = {"variants": {"max_tokens": 48}, "hyde": {"max_tokens": 48}, "notes": {"max_tokens": 32},
                "rerank": {"candidates": 4, "top_k": 2}, "answer": {"max_tokens": 48}}


def test_fusion_pipeline_end_to_end(sample_project):
    answer = engine.run(sample_project.pipeline("ask_fusion").with_overrides(SHORT_FUSION),
                        {"query": "Which retrievers does the search pipeline combine?"}, orchestrate=False)
    assert answer.text and (answer.refused or answer.verdict is not None or answer.sources is not None)


def test_active_retrieval_pipeline_end_to_end(sample_project):
    answer = engine.run(sample_project.pipeline("ask_active").with_overrides({"answer": {"max_tokens": 32}}),
                        {"query": "How are deleted sources handled?"}, orchestrate=False)
    assert answer.text and answer.retrievals >= 0 and not answer.invalid_citations or answer.refused


def test_insert_counts_tokens_with_the_served_tokenizer(sample_project):
    llm = sample_project.resource("llm")
    counts = llm.count_tokens(["hello world", "a much longer sentence with many more tokens in it"])
    assert llm._tokenize_endpoint is True and 0 < counts[0] < counts[1]


def test_pointwise_llm_rerank_scores_from_logprobs(sample_project):
    pipeline = sample_project.pipeline("ask_fusion").with_overrides(
        {**SHORT_FUSION, "rerank": {"method": "pointwise", "candidates": 3, "top_k": 2}})
    trace: list = []
    engine.run(pipeline, {"query": "What is reciprocal rank fusion?"}, orchestrate=False, trace=trace)
    assert "rerank" in [step for step, _ in trace]


def test_community_summaries_and_ask_global_on_the_real_model(sample_project):
    """The summarize job with the real model: every document in a community, every summary written;
    a re-run re-summarises nothing; ask_global answers from the summaries (or refuses), citing
    summaries whose member documents are indexed ones."""
    job = sample_project.pipeline("summarize").with_overrides(
        {"summarize": {"communities": 2, "top_communities": 1, "member_chunks": 2, "summary_tokens": 24}})
    built = engine.run(job, orchestrate=False)
    fine = [c for c in built.communities if c.level == 1]
    assert built.written and len(fine) == 2 and all(c.summary for c in built.communities)
    assert sorted(d for c in fine for d in c.documents) == sorted(built.communities[0].documents)
    again = engine.run(job, orchestrate=False)
    assert again.summarised == [] and again.llm_calls == 0
    answer = engine.run(sample_project.pipeline("ask_global").with_overrides(
        {"answer": {"map_tokens": 24, "max_tokens": 32}}), {"query": "What are the main themes of these documents?"},
        orchestrate=False)
    indexed = {d for c in fine for d in c.documents}
    assert answer.text and not set(answer.invalid_citations) & {s.number for s in answer.sources}
    assert all(s.source_id.startswith("community:") and s.documents and set(s.documents) <= indexed
               for s in answer.sources)


def test_ask_global_across_named_collections_on_the_real_model(tmp_path, vllm_server):
    """Two collections (the shipped file's `collections:` block), each summarised by its own job with the
    real model; ask_global reads both (or the one a request names), and every cited summary's documents
    are its own collection's."""
    import os
    import textwrap

    from ragline.flows.run.query_runner import STEP_OUTPUTS

    shutil.copytree(REPO / "prompts", tmp_path / "prompts")
    docs = sorted((REPO / "samples" / "docs").iterdir())
    for name, part in (("guides", docs[:2]), ("notes", docs[2:])):
        (tmp_path / name).mkdir()
        for doc in part:
            shutil.copy(doc, tmp_path / name / doc.name)
    text = (REPO / "pipelines.yaml").read_text() + textwrap.dedent("""
        collections:
          guides: {paths: [guides]}
          notes:  {paths: [notes]}
        """)
    (tmp_path / "pipelines.yaml").write_text(text)
    os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"] = vllm_server.base_url, vllm_server.model
    try:
        project = load_project(tmp_path / "pipelines.yaml")
    finally:
        del os.environ["RAGLINE_LLM_BASE_URL"], os.environ["RAGLINE_LLM_MODEL"]
    indexed = {}
    for name in ("guides", "notes"):
        engine.run(project.pipeline(f"index@{name}"), orchestrate=False)
        built = engine.run(project.pipeline(f"summarize@{name}").with_overrides(
            {"summarize": {"communities": 2, "top_communities": 1, "member_chunks": 2, "summary_tokens": 24}}),
            orchestrate=False)
        assert built.written and all(c.summary for c in built.communities)
        indexed[name] = {d for c in built.communities for d in c.documents}
    assert all(d.startswith(f"{name}/") for name, found in indexed.items() for d in found)
    # every summary retrieved, two read by the model (a CPU model answers few map calls in its timeout)
    ask_global = project.pipeline("ask_global").with_overrides({"summaries": {"top_k": None},
                                                                "insert": {"max_documents": 2},
                                                                "answer": {"map_tokens": 16, "max_tokens": 24}})
    outputs: dict = {}
    token = STEP_OUTPUTS.set(outputs)
    try:
        both = engine.run(ask_global, {"query": {"text": "What are the main themes of these documents?"}},
                          orchestrate=False)
    finally:
        STEP_OUTPUTS.reset(token)
    # the summaries step read both collections' fine communities, whatever the model answers
    assert {p.metadata["collection"] for p in outputs["summaries"]} == {"guides", "notes"}
    assert both.text and all(s.collection in indexed and set(s.documents) <= indexed[s.collection]
                             for s in both.sources)
    one = engine.run(ask_global, {"query": {"text": "What are the main themes?", "collections": ["notes"]}},
                     orchestrate=False)
    assert all(s.collection == "notes" and set(s.documents) <= indexed["notes"] for s in one.sources)
