"""bench/generation_techniques.py builds its variants of `ask` from the shipped pipelines.yaml: each
must compile against the stages as they are now, change only the steps it names, and keep the
evaluated questions out of the few-shot examples and the conversation (no leak into the measurement)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.bench import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("generation_techniques") as module:
        yield module


def _items(bench, n: int) -> list:
    return [bench.RgbItem(id=str(i), query=f"Who won prize number {i}?", answers=[f"Person {i}"], fake_answers=[],
                          passages={"positive": [f"Person {i} won prize {i}."], "negative": ["Unrelated."],
                                    "positive_wrong": []}) for i in range(n)]


def test_every_variant_compiles_and_changes_only_its_own_steps(bench, tmp_path, monkeypatch):
    from ragline.flows.spec.compile import load_project

    monkeypatch.setattr(bench, "WORK", tmp_path / "generation")
    project = load_project(bench.workspace(_items(bench, 12), timeout=900, workers=4), tuned=False)
    stages = {name: [(s.id, s.stage.name) for s in project.pipeline(name).steps] for name in bench.VARIANTS}
    ask = stages["ask"]
    expected = {"g_notes": ("notes", "refine_notes"), "g_abstractive": ("compress", "refine_abstractive"),
                "g_pairwise": ("rerank", "rerank_llm"), "g_examples": ("examples", "retrieve_examples"),
                "g_memory": ("memory", "recall_history")}
    for name, added in expected.items():
        assert added in stages[name] and [s for s in stages[name] if s != added] == ask, name
    for name, task in (("g_map_reduce", "generate_map_reduce"), ("g_flare_direct", "generate_flare"),
                       ("g_flare_instruct", "generate_flare")):
        assert [s if s[0] != "answer" else ("answer", "generate") for s in stages[name]] == ask
        assert ("answer", task) in stages[name]
    assert project.pipeline("g_flare_instruct").step("answer").params.mode == "instruct"
    assert project.pipeline("g_pairwise").step("rerank").params.method == "pairwise"
    assert project.pipeline("g_system").step("answer").params.system == bench.SYSTEM
    text = (tmp_path / "generation" / "pipelines.yaml").read_text()
    assert "timeout_seconds: 900" in text and "max_concurrency: 16" in text


def test_examples_and_conversation_come_only_from_items_not_evaluated(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "WORK", tmp_path / "generation")
    items = _items(bench, 30)
    evaluated, held_back = items[:10], items[10:]
    bench.workspace(held_back)
    lines = (tmp_path / "generation" / "examples.jsonl").read_text().splitlines()
    requests = {json.loads(line)["request"] for line in lines}
    assert requests == {i.query for i in held_back}
    history = bench.conversation_of(held_back, 10, seed=0)
    assert len(history) == 20 and [m["role"] for m in history[:2]] == ["user", "assistant"]
    asked = {m["content"] for m in history if m["role"] == "user"}
    assert asked <= {i.query for i in held_back} and not asked & {i.query for i in evaluated}
