"""Jobs and eval over named collections (issue 19 item 1): once pipelines.yaml declares collections the
template's own index is empty (nothing writes it), so `ragline tune` reads one collection's index
(--collection, or the only one; several and none named is a usage error naming them) and tunes that
collection's BM25; `ragline eval`'s default index pipeline is a collection's ingestion, not the
template that no longer exists."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ragline.flows import cli
from ragline.flows.errors import EX_USAGE
from ragline.flows.resources import clear_cache
from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.data import index_and_search_yaml, require_scifact, scifact_records, write_jsonl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
YAML = index_and_search_yaml().replace("paths: [docs]", "paths: [unused]").replace("\npipelines:\n", """
collections:
  alpha: {paths: [alpha/corpus.jsonl]}
  beta:  {paths: [beta/corpus.jsonl]}
pipelines:
""", 1) + """  tune:
    kind: job
    steps:
      - {id: pairs, task: pseudo_queries, with: {n: 20}}
      - {id: tune,  task: tune_retrieval, with: {depths: [10], rrf_k: [60], dense_weights: [0, 0.5, 1],
                                                 bm25_k1: [1.2, 1.5], bm25_b: [0.75], bm25_stemmer: [english]}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    require_scifact()
    root = tmp_path_factory.mktemp("jobs")
    write_jsonl(root / "alpha" / "corpus.jsonl", scifact_records(20))
    write_jsonl(root / "beta" / "corpus.jsonl", scifact_records(10, offset=20))
    (root / "pipelines.yaml").write_text(YAML)
    (root / "prompts").symlink_to(REPO / "prompts")
    loaded = load_project(root / "pipelines.yaml", tuned=False)
    for name in ("index@alpha", "index@beta"):
        engine.run(loaded.pipeline(name), orchestrate=False)
    yield root
    clear_cache()


def test_tune_reads_the_chosen_collections_index_and_tunes_its_bm25(project, capsys, monkeypatch):
    monkeypatch.setenv("RAGLINE_TUNED", "1")
    path = str(project / "pipelines.yaml")
    assert cli.main(["tune", "-f", path, "--no-prefect", "--dry-run"]) == EX_USAGE
    assert "alpha, beta" in capsys.readouterr().err
    assert cli.main(["tune", "-f", path, "--no-prefect", "--collection", "gamma"]) == EX_USAGE
    assert "'gamma'" in capsys.readouterr().err

    overlay = project / "pipelines.tuned.yaml"
    try:
        assert cli.main(["tune", "-f", path, "--no-prefect", "--json", "--collection", "alpha"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["pairs"] == 20 and report["chunks"] >= 20  # alpha's 20 documents, not beta's 10
        assert set(report["overrides"]["resources"]) == {"sparse@alpha"}
        tuned = load_project(project / "pipelines.yaml")
        assert tuned.spec.resources["sparse@alpha"].model_dump(include={"k1", "b", "stemmer"}) == \
            report["overrides"]["resources"]["sparse@alpha"]

        # tuning beta next keeps alpha's BM25 settings (its published index was rebuilt with them)
        assert cli.main(["tune", "-f", path, "--no-prefect", "--json", "--collection", "beta"]) == 0
        later = json.loads(capsys.readouterr().out)
        assert set(later["overrides"]["resources"]) == {"sparse@beta"}
        assert set(yaml.safe_load(overlay.read_text())["resources"]) == {"sparse@alpha", "sparse@beta"}
        both = load_project(project / "pipelines.yaml")
        assert both.spec.resources["sparse@alpha"].model_dump(include={"k1", "b", "stemmer"}) == \
            report["overrides"]["resources"]["sparse@alpha"]
        assert both.spec.resources["sparse@beta"].model_dump(include={"k1", "b", "stemmer"}) == \
            later["overrides"]["resources"]["sparse@beta"]
    finally:
        overlay.unlink(missing_ok=True)


def test_eval_indexes_the_corpus_into_a_collection_by_default(project, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGLINE_TUNED", "1")  # --no-tuned exports RAGLINE_TUNED=0: restored after the test
    dataset = tmp_path / "dataset"
    records = scifact_records(10)
    write_jsonl(dataset / "corpus.jsonl", records)
    write_jsonl(dataset / "queries.jsonl", [{"_id": str(i), "text": r["title"]} for i, r in enumerate(records)])
    (dataset / "qrels").mkdir()
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{i}\t{r['_id']}\t1\n" for i, r in enumerate(records)))
    args = ["eval", "--dataset", str(dataset), "-f", str(project / "pipelines.yaml"), "--no-tuned", "--json"]
    assert cli.main(args) == EX_USAGE
    assert "--collection" in capsys.readouterr().err
    assert cli.main(args + ["--collection", "beta"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["queries"] == 10 and result["ndcg@10"] > 0.5
    assert "added 10" in result["index_summary"] or "10" in result["index_summary"]


def test_answer_eval_indexes_each_corpus_into_a_collection(tmp_path, capsys):
    """`ragline eval --dataset rgb.json` indexed into the template `index`, which is no pipeline once
    collections exist; it takes --collection (or the only one) like the BEIR evaluation."""
    from tests.scripted_llm import ScriptedLLM

    rgb = tmp_path / "rgb.json"
    rgb.write_text(json.dumps({"id": 0, "query": "Where is the ferry pier?", "answer": ["north quay"],
                               "positive": ["The ferry pier is on the north quay."],
                               "negative": ["Cranes unload containers."]}) + "\n")
    with ScriptedLLM(lambda prompt: "The pier is on the north quay [1].") as llm:
        (tmp_path / "pipelines.yaml").write_text(YAML.replace("resources:\n", "resources:\n  llm: {type: "
                                                 f"openai_compatible, base_url: {json.dumps(llm.base_url)}, "
                                                 "max_retries: 0}\n", 1) + """  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 5}}
      - {id: fuse,   task: fuse, with: {top_k: 5}}
      - {id: insert, task: insert}
      - {id: answer, task: generate}
""")
        (tmp_path / "prompts").symlink_to(REPO / "prompts")
        args = ["eval", "--dataset", str(rgb), "-f", str(tmp_path / "pipelines.yaml"), "--no-start-llm", "--json"]
        assert cli.main(args) == EX_USAGE
        assert "alpha, beta" in capsys.readouterr().err
        assert cli.main(args + ["--collection", "alpha"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["questions"] == 1 and result["positive"]


def test_a_generated_test_set_samples_every_collection_in_proportion(project):
    """`ragline eval --generate-testset N` read the template's state (empty once collections exist); it
    samples each collection's index in proportion to its documents (alpha 20, beta 10)."""
    from ragline.flows.evaluation.judge import generate_testset

    rows, stats = generate_testset(load_project(project / "pipelines.yaml", tuned=False), 6,
                                   strategies=["inverse_cloze"])
    folders = [row.source_id.split("/")[0] for row in rows]
    assert (folders.count("alpha"), folders.count("beta")) == (4, 2) and stats["documents"] == 30
    assert len({row.id for row in rows}) == 6
