"""The ``enrich`` ingestion stage with the real MiniLM embedder: KeyBERT-style keywords (phrases of the
document ranked by similarity to it, made diverse by MMR) stored as scalar metadata that a ``where``
selects through real BM25 and Chroma; a document-level context that the embedder sees and the index
does not store; one LLM sentence per document from the scripted server; located param errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.prompts import library
from ragline.tasks.ingest.embed import embed
from ragline.tasks.ingest.enrich import Params, enrich, mmr
from tests.helpers.data import BASE_RESOURCES
from tests.helpers.hostile import HOSTILE
from tests.helpers.reads_roles import EMBEDDER, LLM, TWO_EMBEDDERS, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

REPO_PROMPTS = Path(__file__).resolve().parents[3] / "prompts"
PENGUINS = ("Emperor penguins breed on the Antarctic sea ice during the polar winter. The male penguin incubates "
            "the egg on his feet while the females feed at sea. Penguin colonies huddle together against the wind.")
VOLCANOES = ("Volcanic eruptions release sulfur dioxide into the stratosphere. The sulfate aerosols reflect "
             "sunlight and cool the climate for a year or two after a large eruption.")


def chunks_of(source_id: str, title: str, text: str, pieces: int = 2) -> list[Chunk]:
    words = text.split()
    step = len(words) // pieces + 1
    return [Chunk(chunk_id=f"{source_id}:{i}", source_id=source_id, ordinal=i, title=title,
                  text=" ".join(words[i * step:(i + 1) * step]), metadata={"chunk": i}) for i in range(pieces)]


def run(chunks, embedder=None, llm=None, ctx=None, **params):
    ctx = ctx or StepContext(pipeline="index", step_id="enrich")
    return enrich.fn(chunks=chunks, params=Params(**params), ctx=ctx, embedder=embedder, llm=llm)


def test_keywords_are_phrases_of_the_document_ranked_by_similarity_to_it(minilm):
    items = chunks_of("p", "Penguins", PENGUINS) + chunks_of("v", "Volcanoes", VOLCANOES)
    out = run(items, minilm, keywords=4, diversity=0.0)
    by_source = {c.source_id: c.metadata["keywords"].split(", ") for c in out}
    for source, title, text in (("p", "Penguins", PENGUINS), ("v", "Volcanoes", VOLCANOES)):
        found = by_source[source]
        assert len(found) == 4 and all(k in text.lower() for k in found)  # phrases of the document itself
        document = "\n".join([title, *(c.text for c in items if c.source_id == source)])  # as the stage sees it
        sims = minilm.encode_documents(found) @ minilm.encode_documents([document])[0]
        assert list(sims) == sorted(sims, reverse=True)  # no diversity: ranked by similarity to the document
        assert all(c.metadata["topic"] == found[0] for c in out if c.source_id == source)
    assert "penguin" in by_source["p"][0] and "volcan" in " ".join(by_source["v"][:2])
    assert all(c.metadata["chunk"] == c.ordinal and c.text == i.text and c.context == "" for c, i in zip(out, items))


def test_mmr_trades_similarity_for_diversity():
    document = np.array([1.0, 0.0, 0.0])
    phrases = np.array([[0.99, 0.14, 0.0], [0.98, 0.2, 0.0], [0.7, 0.0, 0.71]])  # two near-duplicates, one other
    phrases /= np.linalg.norm(phrases, axis=1, keepdims=True)
    assert mmr(document, phrases, 2, diversity=0.0) == [0, 1]
    assert mmr(document, phrases, 2, diversity=0.7) == [0, 2]


def test_diversity_gives_keywords_less_alike(minilm):
    items = chunks_of("p", "Penguins", PENGUINS)

    def redundancy(diversity: float) -> float:
        found = run(items, minilm, keywords=5, diversity=diversity)[0].metadata["keywords"].split(", ")
        vectors = minilm.encode_documents(found)
        sims = vectors @ vectors.T
        return float(sims[np.triu_indices(len(found), 1)].mean())

    assert redundancy(0.8) < redundancy(0.0)


def test_context_reaches_the_embedder_but_not_the_text(minilm):
    items = chunks_of("v", "Volcanoes and climate", VOLCANOES)
    titled = run(items, minilm, context="title")
    assert [c.context for c in titled] == ["Volcanoes and climate"] * 2 and [c.text for c in titled] == \
        [c.text for c in items]
    with_keywords = run(items, minilm, keywords=3, context="keywords")
    assert with_keywords[0].context == with_keywords[0].metadata["keywords"]
    ctx = StepContext(pipeline="index", step_id="embed")
    embedded = embed.fn(chunks=titled, ctx=ctx, embedder=minilm)
    expected = minilm.encode_documents([f"Volcanoes and climate\n{c.text}" for c in items])
    np.testing.assert_allclose(np.asarray([c.embedding for c in embedded], dtype=np.float32), expected, atol=1e-5)
    assert [c.text for c in embedded] == [c.text for c in items]
    # a chunk that already opens with its title gets it only once
    opened = [items[0].model_copy(update={"text": f"Volcanoes and climate\n{items[0].text}"})]
    assert run(opened, minilm, context="title")[0].context == ""


def test_llm_context_is_one_sentence_per_document_within_max_chars():
    prompts: list[str] = []

    def reply(prompt: str) -> str:
        prompts.append(prompt)
        if "Penguins" in prompt:
            return "A field note on emperor penguins breeding on Antarctic ice. It goes on."
        return "An explainer on how volcanic eruptions " + "cool the climate " * 30

    items = chunks_of("p", "Penguins", PENGUINS) + chunks_of("v", "Volcanoes", VOLCANOES + " " + HOSTILE)
    with ScriptedLLM(reply) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="index", step_id="enrich", prompt_name="enrich_context",
                          render_prompt=library(str(REPO_PROMPTS)).render)
        out = run(items, llm=llm, ctx=ctx, context="llm", max_chars=80)
    assert len(prompts) == 2  # one call per document, not per chunk
    assert all("data, not instructions" in p.split("<document>")[0] and p.count("</document>") == 1
               for p in prompts)
    penguin = [c for c in out if c.source_id == "p"]
    assert {c.context for c in penguin} == {"A field note on emperor penguins breeding on Antarctic ice."}
    assert penguin[0].metadata["summary"] == penguin[0].context
    volcano = next(c for c in out if c.source_id == "v")
    assert len(volcano.context) <= 82 and volcano.context.endswith(" …")
    assert [c.text for c in out] == [c.text for c in items]


def test_a_failed_llm_call_reports_its_document_and_keeps_the_others():
    def reply(prompt: str) -> str:
        if "Volcanoes" in prompt:
            raise RuntimeError("boom")
        return "About penguins."

    items = chunks_of("p", "Penguins", PENGUINS) + chunks_of("v", "Volcanoes", VOLCANOES)
    with ScriptedLLM(reply) as server:
        llm = LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))
        ctx = StepContext(pipeline="index", step_id="enrich", prompt_name="enrich_context",
                          render_prompt=library(str(REPO_PROMPTS)).render)
        out = run(items, llm=llm, ctx=ctx, context="llm")
    assert {c.source_id for c in out} == {"p"}
    assert [(f.source_id, f.stage) for f in ctx.failures] == [("v", "enrich")]


def test_llm_context_needs_an_llm(minilm):
    with pytest.raises(MissingResource, match="context 'llm' needs an openai_compatible resource"):
        run(chunks_of("p", "Penguins", PENGUINS), minilm, context="llm")


@pytest.mark.parametrize("setting, field", [("keywords: -1", "with.keywords"), ("context: summary", "with.context"),
                                            ("context: keywords", "with"), ("diversity: 2", "with.diversity")])
def test_bad_params_are_located(make_project, setting, field):
    path = make_project(BASE_RESOURCES + f"""
pipelines:
  index:
    kind: ingestion
    steps:
      - {{id: load,   task: load, with: {{paths: [docs]}}}}
      - {{id: chunk,  task: chunk}}
      - {{id: enrich, task: enrich, with: {{{setting}}}}}
      - {{id: embed,  task: embed}}
      - {{id: write,  task: index}}
""")
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.field) == ("index", "enrich", field)


ENRICHED = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 48, overlap: 8}}
      - {id: enrich,  task: enrich, with: {keywords: 3, context: keywords}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  dense:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense,  with: {k: 10}}
  sparse:
    kind: query
    steps:
      - {id: sparse, task: retrieve_sparse, with: {k: 10}}
"""


def test_keyword_metadata_is_filterable_in_bm25_and_chroma(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "penguins.md").write_text(f"# Penguins\n\n{PENGUINS}\n")
    (tmp_path / "docs" / "volcanoes.md").write_text(f"# Volcanoes\n\n{VOLCANOES}\n")
    (tmp_path / "pipelines.yaml").write_text(ENRICHED)
    project = load_project(tmp_path / "pipelines.yaml")
    engine.run(project.pipeline("index"), orchestrate=False)
    question = {"text": "sea ice and sunlight"}
    every = engine.run(project.pipeline("sparse"), {"query": question}, orchestrate=False)
    topics = {p.source_id.rsplit("/", 1)[-1]: p.metadata["topic"] for ranking in every for p in ranking.passages}
    assert topics.keys() == {"penguins.md", "volcanoes.md"} and topics["penguins.md"] != topics["volcanoes.md"]
    for retriever in ("dense", "sparse"):
        rankings = engine.run(project.pipeline(retriever), {"query": {**question, "filters": {"topic": topics[
            "penguins.md"]}}}, orchestrate=False)
        passages = [p for ranking in rankings for p in ranking.passages]
        assert passages and {p.source_id.rsplit("/", 1)[-1] for p in passages} == {"penguins.md"}, retriever
        assert all(p.metadata["keywords"].startswith(topics["penguins.md"]) for p in passages)
        assert all(not p.text.startswith(p.metadata["keywords"]) for p in passages)  # the context is not stored


def fingerprint(make_project, text: str, name: str) -> str:
    """What the engine hashes for an ingestion run: every step but the source and the sink."""
    pipeline = load_project(make_project(text, name=name)).pipeline("index")
    return pipeline.fingerprint([s for s in pipeline.steps if s.stage.inputs and s.stage.plan is None])


def test_enrich_params_and_only_the_resources_it_uses_enter_the_fingerprint(make_project):
    llm = '  llm: {type: openai_compatible, base_url: "http://127.0.0.1:9/v1", model: MODEL}\n'
    index = ENRICHED.replace("  state:", llm + "  state:").split("  dense:")[0]
    plain = index.replace("      - {id: enrich,  task: enrich, with: {keywords: 3, context: keywords}}\n", "")
    variants = {"plain": plain, "on": index, "more": index.replace("keywords: 3", "keywords: 4"),
                "other_llm": index.replace("MODEL", "other"),
                "llm": index.replace("context: keywords", "context: llm"),
                "llm_other": index.replace("context: keywords", "context: llm").replace("MODEL", "other")}
    prints = {name: fingerprint(make_project, text, f"{name}.yaml") for name, text in variants.items()}
    assert len({prints["plain"], prints["on"], prints["more"], prints["llm"], prints["llm_other"]}) == 5
    assert prints["other_llm"] == prints["on"]  # an LLM bound but unused by this configuration re-indexes nothing


# ----------------------------------------------------------------------------- resources read (validate)
ENRICH_STEPS = """      - {id: load,   task: load, with: {paths: [docs]}}
      - {id: chunk,  task: chunk, uses: {embedder: EMBEDDER}, with: {size: 48, overlap: 8}}
      - id: enrich
        task: enrich
        with:
          keywords: 3
          context: llm
"""


def test_enrich_with_an_llm_context_and_no_llm_fails_validation_at_context(make_project):
    """An LLM context reads the LLM: a file without one validated and failed only when ingestion ran;
    now `ragline validate` names the line and with.context."""
    error = error_at(make_project(pipelines_file(EMBEDDER, ENRICH_STEPS.replace("EMBEDDER", "embedder"),
                                                 kind="ingestion")), "enrich", "with.context")
    assert "context 'llm' has the LLM write a sentence per document" in error.message


def test_enrich_binds_the_embedder_and_llm_only_where_its_keywords_and_context_read_them(make_project):
    """Two embedders and two LLMs in the file: an enrich step that reads neither needs no name; one
    that reads the embedder for keywords is asked to name one, as before."""
    steps = ENRICH_STEPS.replace("EMBEDDER", "emb_a")
    neither = steps.replace("keywords: 3", "keywords: 0").replace("context: llm", "context: title")
    path = make_project(pipelines_file(TWO_EMBEDDERS + TWO_LLMS, neither, kind="ingestion"))
    assert validate_file(path) == []
    assert load_project(path).pipeline("p").step("enrich").resources == {}
    keywords = make_project(pipelines_file(TWO_EMBEDDERS + LLM, steps, kind="ingestion"), name="kw.yaml")
    [error] = validate_file(keywords)
    assert (error.step, error.field) == ("enrich", "uses") and "several resources (emb_a, emb_b)" in error.message
    both = make_project(pipelines_file(EMBEDDER + LLM, steps.replace("emb_a", "embedder"), kind="ingestion"),
                        name="both.yaml")
    assert load_project(both).pipeline("p").step("enrich").resources == {"embedder": "embedder", "llm": "llm"}
