"""The ``adapt_embedder`` stage on a small index: it trains and saves a loadable model whose vectors
differ from the base model's; the same pairs and seed give the same folder and the same weights;
hard negatives are BM25's best chunks of other documents, never of the source; and it points the
embedder at the saved model in the tuned overlay, which changes the settings fingerprint, so the
next ingestion re-embeds (until then, dense retrieval refuses to mix the two models' vectors)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.context import StepContext
from ragline.flows.resources.stores.bm25 import in_memory, tokenize
from ragline.tasks.jobs import adapt_embedder as ae
from ragline.tasks.ingest.pseudo_queries import Params as PairParams
from ragline.tasks.ingest.pseudo_queries import pseudo_queries
from ragline.tasks.jobs.tune_retrieval import Corpus
from tests.helpers.data import require_scifact, scifact_records, write_jsonl
from tests.helpers.optional import requires

pytestmark = requires("datasets", "accelerate", reason="training needs sentence-transformers[train] (datasets, accelerate)")

REPO = Path(__file__).resolve().parents[3]
DOCS = 40
PAIRS = 24  # pairs trained on: 3 steps of 8
ADAPT = {"epochs": 1, "batch_size": 8, "hard_negatives": 1, "max_seq_length": 64, "progress": False}

ADAPT_YAML = f"""
resources:
  embedder: {{type: sentence_transformer, max_seq_length: 128}}
  store:    {{type: chroma, path: idx/chroma, collection: test}}
  sparse:   {{type: bm25, path: idx/bm25}}
  state:    {{type: index_state, path: idx/state.sqlite}}
pipelines:
  index:
    kind: ingestion
    steps:
      - {{id: load,    task: load, with: {{paths: [dataset/corpus.jsonl]}}}}
      - {{id: convert, task: convert}}
      - {{id: chunk,   task: chunk, with: {{size: 128, overlap: 8}}}}
      - {{id: embed,   task: embed}}
      - {{id: write,   task: index}}
  search:
    kind: query
    steps:
      - {{id: dense, task: retrieve_dense, with: {{k: 5}}}}
      - {{id: fuse,  task: fuse, after: [dense], with: {{top_k: 5}}}}
  adapt:
    kind: job
    steps:
      - {{id: pairs, task: pseudo_queries, with: {{n: {PAIRS}}}}}
      - {{id: adapt, task: adapt_embedder, with: {json.dumps(ADAPT)}}}
"""
TEXTS = ["cerebral white matter in preterm newborns", "vitamin D deficiency and bone density",
         "A randomized trial of statins in elderly patients showed fewer strokes."]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """SciFact's first abstracts indexed in a project with an `adapt` job pipeline."""
    require_scifact()
    root = tmp_path_factory.mktemp("adapt")
    write_jsonl(root / "dataset" / "corpus.jsonl", scifact_records(DOCS))
    (root / "pipelines.yaml").write_text(ADAPT_YAML)
    (root / "prompts").symlink_to(REPO / "prompts")
    project = load_project(root / "pipelines.yaml", tuned=False)
    assert engine.run(project.pipeline("index"), orchestrate=False).added == DOCS
    return project


@pytest.fixture(scope="module")
def adapted(project) -> ae.AdaptReport:
    report = engine.run(project.pipeline("adapt"), orchestrate=False)
    assert isinstance(report, ae.AdaptReport)
    return report


def pairs_of(project, n=PAIRS, seed=0):
    ctx = StepContext(pipeline="adapt", step_id="pairs")
    return pseudo_queries.fn(params=PairParams(n=n, seed=seed), ctx=ctx, state=project.resource("state"))


@pytest.mark.integration  # trains and re-embeds with the real model
def test_it_trains_and_saves_a_loadable_model_that_embeds_differently(project, adapted, minilm):
    from sentence_transformers import SentenceTransformer

    folder = Path(adapted.model_path)
    assert folder.is_absolute() and folder.parent == (project.base_dir / "idx" / "models").resolve()
    assert folder.name == f"all-MiniLM-L6-v2-adapted-{adapted.key}" and len(adapted.key) == 12
    assert not adapted.reused and adapted.steps == PAIRS // 8 and np.isfinite(adapted.loss)
    assert adapted.pairs == PAIRS and adapted.mined_negatives > 0 and adapted.chunks >= DOCS
    manifest = json.loads((folder / ae.MANIFEST).read_text())
    assert manifest["base_model"] == "all-MiniLM-L6-v2" and manifest["pairs"] == adapted.pairs
    assert manifest["params"] == {"epochs": 1.0, "batch_size": 8, "learning_rate": 2e-5, "warmup": 0.1,
                                  "hard_negatives": 1, "skip_top": 0, "seed": 0, "max_seq_length": 64}
    assert manifest["train_seconds"] > 0 and manifest["created"] == adapted.created and manifest["key"] == adapted.key
    assert adapted.overlay == {"resources": {"embedder": {"model": str(folder)}}}
    assert yaml.safe_load(adapted.overlay_yaml) == adapted.overlay

    model = SentenceTransformer(str(folder), device="cpu")
    ours = model.encode(TEXTS, normalize_embeddings=True)
    base = minilm.encode_documents(TEXTS)
    assert ours.shape == base.shape
    assert np.abs(ours - base).max() > 1e-3  # the weights moved
    assert (ours * base).sum(axis=1).min() > 0.5  # ... and the model is still the same model, adapted


@pytest.mark.integration  # trains and re-embeds with the real model
def test_same_pairs_and_seed_same_folder_and_weights(project, adapted, tmp_path):
    again = engine.run(project.pipeline("adapt"), orchestrate=False)
    assert again.reused and again.model_path == adapted.model_path and again.key == adapted.key
    assert again.overlay_path == adapted.overlay_path
    assert again.timings["training"] == 0.0

    # trained again into another folder: the same weights
    to_m = {"adapt": {"output": str(tmp_path / "m"), "write": False}}
    elsewhere = engine.run(project.pipeline("adapt").with_overrides(to_m), orchestrate=False)
    assert not elsewhere.reused and elsewhere.key == adapted.key and elsewhere.model_path == str(tmp_path / "m")
    assert elsewhere.overlay_path == ""  # write: false reports the entry only
    first = json.loads((Path(adapted.model_path) / ae.MANIFEST).read_text())
    second = json.loads((tmp_path / "m" / ae.MANIFEST).read_text())
    for volatile in ("created", "train_seconds"):
        first.pop(volatile), second.pop(volatile)
    assert first == second
    from safetensors.numpy import load_file

    a = load_file(str(Path(adapted.model_path) / "model.safetensors"))
    b = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    # another seed is another model in another folder (without training it: the key is known up front)
    state, sparse = project.resource("state"), project.resource("sparse")
    corpus = Corpus.from_state(state)
    pairs = pairs_of(project)
    rows = ae.training_rows(pairs, corpus, sparse.spec, 1)
    spec = project.resource("embedder").spec
    assert ae.model_key("all-MiniLM-L6-v2", spec, rows, ae.Params(**ADAPT)) == adapted.key
    assert ae.model_key("all-MiniLM-L6-v2", spec, rows, ae.Params(**{**ADAPT, "seed": 1})) != adapted.key
    assert ae.model_key("all-MiniLM-L6-v2", spec, ae.training_rows(pairs[1:], corpus, sparse.spec, 1),
                        ae.Params(**ADAPT)) != adapted.key


@pytest.mark.integration  # mines the index of 40 SciFact abstracts
def test_hard_negatives_are_bm25s_best_chunks_of_other_documents(project):
    state, spec = project.resource("state"), project.resource("sparse").spec
    corpus = Corpus.from_state(state)
    pairs = pairs_of(project, n=DOCS)
    rows = ae.training_rows(pairs, corpus, spec, negatives=3)
    assert len(rows.anchors) >= DOCS // 2 and rows.mined > 0

    retriever = in_memory(tokenize(corpus.texts, spec.stemmer, spec.stopwords), spec)
    queries = tokenize(rows.anchors, spec.stemmer, spec.stopwords)
    ranked, scores = retriever.retrieve(queries, k=len(corpus.ids), show_progress=False, n_threads=1)
    source_first = mined = 0
    two_or_more: list[int] = []  # pairs for which BM25 finds two other documents or more
    for i, pair in enumerate(rows.pairs):
        source = corpus.doc_index[pair.source_id]
        negatives = rows.negative_chunks[i]
        docs = [int(corpus.docs[c]) for c in negatives]
        assert len(negatives) == 3 and source not in docs and len(set(docs)) == 3
        assert rows.negatives[i] == [corpus.texts[c] for c in negatives]
        # the passage is the pair's own chunk without the text cut out of it
        assert int(corpus.docs[rows.positive_chunks[i]]) == source and pair.cut not in rows.positives[i]
        # BM25's order: the first negative is the best-ranked chunk not of the source document
        in_order = sorted(zip(ranked[i], scores[i]), key=lambda h: (-h[1], h[0]))  # equal scores: chunk order
        hits = [int(c) for c, s in in_order if s > 0]
        source_first += int(corpus.docs[hits[0]]) == source
        others = [c for c in hits if int(corpus.docs[c]) != source]
        if len({int(corpus.docs[c]) for c in others}) >= 2:
            two_or_more.append(i)
        if others:
            assert negatives[0] == others[0]
            mined += 1
        else:  # BM25 finds nothing else: random chunks of other documents
            assert not set(negatives) & set(hits)
    assert source_first >= len(rows.pairs) // 2  # the exclusion matters: the source usually ranks first
    assert mined >= len(rows.pairs) // 2

    assert len(two_or_more) >= len(rows.pairs) // 2
    skipped = ae.training_rows(pairs, corpus, spec, negatives=1, skip=1)
    assert [skipped.negative_chunks[i][0] for i in two_or_more] == [rows.negative_chunks[i][1] for i in two_or_more]
    # passed-over hits (they may be unlabelled positives) are never taken as random negatives either
    both = ae.training_rows(pairs, corpus, spec, negatives=1, skip=2)
    for i in two_or_more:
        assert {int(corpus.docs[c]) for c in rows.negative_chunks[i][:2]}.isdisjoint(
            {int(corpus.docs[both.negative_chunks[i][0]])})
    assert ae.training_rows(pairs, corpus, spec, negatives=0).negatives == [[] for _ in rows.anchors]


@pytest.mark.integration  # trains and re-embeds with the real model
def test_a_short_budget_stops_early_and_is_not_reused(project, tmp_path):
    pipeline = project.pipeline("adapt").with_overrides({"adapt": {"output": str(tmp_path / "short"),
                                                                   "max_seconds": 0.001, "write": False}})
    report = engine.run(pipeline, orchestrate=False)
    assert report.stopped_early and report.steps == 1
    assert json.loads((tmp_path / "short" / ae.MANIFEST).read_text())["stopped_early"] is True
    again = engine.run(pipeline, orchestrate=False)
    assert not again.reused and again.stopped_early  # an unfinished model is trained again


@pytest.mark.integration  # trains and re-embeds with the real model
def test_the_overlay_points_the_embedder_at_it_and_the_next_ingestion_re_embeds(project, adapted):
    from sentence_transformers import SentenceTransformer

    from ragline.flows.run.engine import StepFailed
    from ragline.flows.resources.stores.chroma import EmbedderMismatch

    index = project.pipeline("index")
    assert Path(adapted.overlay_path) == (project.base_dir / "pipelines.tuned.yaml").resolve()
    moved = load_project(project.path)  # with the overlay the adapt job wrote
    assert moved.spec.resources["embedder"].model == adapted.model_path
    assert moved.overlay.adapted["key"] == adapted.key
    assert moved.pipeline("index").fingerprint(moved.pipeline("index").steps) != index.fingerprint(index.steps)
    same = project.with_resource("embedder", model="all-MiniLM-L6-v2")
    assert same.pipeline("index").fingerprint(same.pipeline("index").steps) == index.fingerprint(index.steps)

    question = {"query": "white matter of preterm infants"}
    assert engine.run(project.pipeline("search"), question, orchestrate=False)  # the base model's own index
    with pytest.raises(StepFailed) as refused:  # adapted queries against base-model vectors: refused, not wrong
        engine.run(moved.pipeline("search"), question, orchestrate=False)
    assert isinstance(refused.value.__cause__, EmbedderMismatch) and "re-embed" in str(refused.value)

    def vectors(project) -> dict[str, np.ndarray]:  # by chunk text: chunk ids need not survive re-chunking
        rows = project.resource("state").chunk_rows()
        stored = project.resource("store").vectors([cid for cid, _, _ in rows])
        return {text: np.asarray(stored[cid]) for cid, text, _ in rows}

    before = vectors(project)
    report = engine.run(moved.pipeline("index"), orchestrate=False)  # this project's last test: it re-embeds
    assert report.updated == DOCS and report.added == 0
    after = vectors(moved)
    assert after.keys() == before.keys()
    assert all(np.abs(after[t] - before[t]).max() > 1e-3 for t in after)
    model = SentenceTransformer(adapted.model_path, device="cpu")
    assert model.max_seq_length == 256  # the base model's, not the training length
    model.max_seq_length = 128  # as the embedder resource sets it
    some = sorted(after)[:3]
    assert np.allclose(model.encode(some, normalize_embeddings=True), [after[t] for t in some], atol=1e-4)
    assert engine.run(moved.pipeline("index"), orchestrate=False).unchanged == DOCS
    assert engine.run(moved.pipeline("search"), question, orchestrate=False)  # re-embedded: answered
    with pytest.raises(StepFailed, match="all-MiniLM-L6-v2"):  # ... and now the base model is the stranger
        engine.run(project.pipeline("search"), question, orchestrate=False)
