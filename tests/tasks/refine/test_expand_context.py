"""Context expansion (``expand_context``, small-to-big) over a real index of SciFact abstracts cut
into small chunks by the real ingestion pipeline (Chroma, BM25, the index state)."""
from __future__ import annotations

import re

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Passage, Query
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.tasks.refine.expand_context import Params, expand_context, stitch, token_counts
from tests.helpers import pipelines
from tests.helpers.data import BASE_RESOURCES, scifact_records, write_jsonl

PIPELINES = BASE_RESOURCES + "pipelines:\n" + pipelines.index(chunk_size=40) + """  search_context:
    kind: query
    steps:
      - {id: dense,   task: retrieve_dense,  with: {k: 20}}
      - {id: sparse,  task: retrieve_sparse, with: {k: 20}, after: []}
      - {id: fuse,    task: fuse, after: [dense, sparse], with: {top_k: 20}}
      - {id: context, task: expand_context, with: {neighbours: NEIGHBOURS, max_tokens: 400}}
"""


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """Six SciFact abstracts indexed in chunks of 40 tokens (8 overlapping); the state, the
    project and the records."""
    folder = tmp_path_factory.mktemp("context")
    (folder / "prompts").mkdir()
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES.replace("NEIGHBOURS", "1"))
    records = scifact_records(6)
    write_jsonl(folder / "docs" / "scifact.jsonl", records)
    project = load_project(path)
    engine.run(project.pipeline("index"), orchestrate=False)
    state = IndexState(StateSpec(type="index_state", path="idx/state.sqlite"), base_dir=folder)
    yield state, project, {r["_id"]: r for r in records}
    state.close()


def chunks_of(state: IndexState, doc_id: str) -> list[Passage]:
    rows = state.reader.execute("SELECT chunk_id, source_id, ordinal, text, title, metadata FROM chunks "
                                "WHERE source_id LIKE ? ORDER BY ordinal", (f"%#{doc_id}",)).fetchall()
    return [Passage(chunk_id=cid, source_id=sid, text=text, title=title, metadata={"chunk": ordinal})
            for cid, sid, ordinal, text, title, _ in rows]


def squashed(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def expand(passages, state, minilm, access=None, **params):
    return expand_context.fn(query=Query(text="q", access=access), passages=passages, params=Params(**params),
                             ctx=StepContext(pipeline="p", step_id="c"), state=state, embedder=minilm)


def test_a_hit_grows_into_its_neighbours_as_one_seamless_span(indexed, minilm):
    state, _, records = indexed
    doc_id = next(d for d in records if len(chunks_of(state, d)) >= 4)
    chunks = chunks_of(state, doc_id)
    [grown] = expand([chunks[2]], state, minilm, neighbours=1, max_tokens=1000)
    assert grown.metadata["context_chunks"] == "1-3" and grown.original_text == chunks[2].text
    title = records[doc_id]["title"]
    body = grown.text[len(title) + 1:]
    assert grown.text.startswith(title + "\n") and title not in body  # the title line once, at the top
    assert squashed(body) in squashed(records[doc_id]["text"])  # no overlap repeated, nothing left out
    hit = chunks[2].text[len(title) + 1:]
    assert squashed(hit) in squashed(body) and len(body) > len(hit)


def test_the_window_stays_within_the_budget_next_side_first(indexed, minilm):
    state, _, records = indexed
    doc_id = next(d for d in records if len(chunks_of(state, d)) >= 4)
    chunks = chunks_of(state, doc_id)
    sizes = token_counts(minilm, [c.text for c in chunks])
    [grown] = expand([chunks[2]], state, minilm, neighbours=5, max_tokens=sizes[2] + sizes[3])
    assert grown.metadata["context_chunks"] == "2-3"
    [whole] = expand([chunks[2]], state, minilm, neighbours=10_000, max_tokens=sum(sizes))
    assert whole.metadata["context_chunks"] == f"0-{len(chunks) - 1}"
    assert squashed(whole.text[len(whole.title) + 1:]) == squashed(records[doc_id]["text"])


def test_no_text_is_given_twice(indexed, minilm):
    state, _, records = indexed
    first_doc, second_doc = [d for d in records if len(chunks_of(state, d)) >= 4][:2]
    a, b = chunks_of(state, first_doc), chunks_of(state, second_doc)
    out = expand([a[1], b[0], a[2], a[3]], state, minilm, neighbours=1, max_tokens=1000)
    # a[2] is inside a[1]'s window (0-2) and dropped; a[3]'s window stops before a[2], already shown
    assert [p.chunk_id for p in out] == [a[1].chunk_id, b[0].chunk_id, a[3].chunk_id]
    assert [p.metadata["context_chunks"] for p in out[:2]] == ["0-2", "0-1"]
    assert out[2].metadata.get("context_chunks", "3").startswith("3")  # never back into 0-2


def test_hits_beyond_top_k_pass_unchanged(indexed, minilm):
    state, _, records = indexed
    doc_ids = [d for d in records if len(chunks_of(state, d)) >= 3][:2]
    first, second = chunks_of(state, doc_ids[0])[1], chunks_of(state, doc_ids[1])[1]
    out = expand([first, second], state, minilm, top_k=1)
    assert "context_chunks" in out[0].metadata and out[1] == second


def test_without_an_index_state_the_passages_pass_with_a_warning(tmp_path, minilm, caplog):
    missing = IndexState(StateSpec(type="index_state", path="none.sqlite"), base_dir=tmp_path)
    hits = [Passage(chunk_id="c1", source_id="s", text="t")]
    assert expand(hits, missing, minilm) == hits
    assert "context not expanded" in caplog.text and not (tmp_path / "none.sqlite").exists()


def test_in_a_pipeline_it_reads_and_never_writes_the_index(indexed):
    state, project, records = indexed
    stores = project.base_dir / "idx"
    before = {p: p.read_bytes() for p in stores.rglob("*") if p.is_file()}
    question = next(iter(records.values()))["title"]
    passages = engine.run(project.pipeline("search_context"), {"query": question}, orchestrate=False)
    assert passages and "context_chunks" in passages[0].metadata
    assert len({p.chunk_id for p in passages}) == len(passages)
    assert {p: p.read_bytes() for p in stores.rglob("*") if p.is_file()} == before


def test_stitch_removes_the_overlap_only_when_it_is_real():
    assert stitch("alpha beta gamma delta epsilon zeta", "delta epsilon zeta eta theta") == \
        "alpha beta gamma delta epsilon zeta eta theta"
    assert stitch("short", "other text entirely") == "short\nother text entirely"
    assert stitch("were 3.0%, p = 0.001;", "p = 0.001; internal") == "were 3.0%, p = 0.001; internal"
    assert stitch("filled with", "without a word cut") == "filled with\nwithout a word cut"  # not a whole word


def test_invalid_neighbours_are_located(make_project):
    path = make_project(PIPELINES.replace("NEIGHBOURS", "-1"))
    [error] = validate_file(path)
    assert (error.pipeline, error.step, error.field) == ("search_context", "context", "with.neighbours")
    assert error.line and "greater than or equal to 0" in error.message


def test_over_collections_each_hit_grows_in_its_own_collections_index(tmp_path):
    """With collections declared the template's index is empty: a hit grows from the index state of
    the collection it came from (its ``metadata.collection``)."""
    (tmp_path / "prompts").mkdir()
    path = tmp_path / "pipelines.yaml"
    path.write_text(PIPELINES.replace("NEIGHBOURS", "1").replace("\npipelines:\n", """
collections:
  first:  {paths: [first]}
  second: {paths: [second]}
pipelines:
""", 1))
    records = scifact_records(4)
    write_jsonl(tmp_path / "first" / "a.jsonl", records[:2])
    write_jsonl(tmp_path / "second" / "b.jsonl", records[2:])
    project = load_project(path)
    for name in ("index@first", "index@second"):
        engine.run(project.pipeline(name), orchestrate=False)
    for record in (records[0], records[3]):
        passages = engine.run(project.pipeline("search_context"), {"query": record["title"]}, orchestrate=False)
        assert passages[0].source_id.endswith(record["_id"])
        assert "context_chunks" in passages[0].metadata, passages[0].metadata["collection"]
