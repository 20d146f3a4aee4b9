"""`ragline eval --generate-testset N` and `ragline eval --judge` (issue 20.4) end to end: a tiny
corpus indexed for real (MiniLM, Chroma, BM25), questions written by an LLM (the scripted
OpenAI-compatible server over real HTTP) from the indexed documents, retrieval scored by the source
document, answers of the ask pipeline judged, the run recorded where `ragline report` reads it."""
from __future__ import annotations

import json
import math
import re

import pytest

from ragline.flows import cli
from ragline.flows.evaluation.retrieval import EVAL_RUNS
from tests.helpers.data import REPO, index_and_search_yaml
from tests.scripted_llm import ScriptedLLM

pytestmark = pytest.mark.integration

TOPICS = {"otters": "Otters hold hands while they sleep. They live in rivers and along coasts. Sea otters use "
                    "stones as tools to open shells.",
          "glaciers": "Glaciers move slowly downhill under their own weight. They carve valleys into rock. Many "
                      "glaciers are shrinking as the climate warms.",
          "bread": "Bread rises because yeast makes carbon dioxide. Kneading builds gluten in the dough. Baking "
                   "sets the crumb and browns the crust.",
          "lighthouses": "Lighthouses warn ships of rocks near the shore. Each light flashes in its own pattern. "
                         "Many are now automated."}
P = {"statement": 0.75, "reply": 0.6}


def reply(prompt: str) -> str:
    if prompt.startswith("Write one question"):
        topic = next(t for t in TOPICS if t in prompt.lower())
        return f"Question: What does the text say about {topic} and their habits?"
    if prompt.startswith("Answer the question"):
        return "Here is what the reference says [1]. Nothing more [9]."
    return "Yes"


def top(prompt: str) -> dict[str, float]:
    """The judge's P(yes): fixed per prompt kind, and for a passage 0.9 when it is about the question's topic."""
    if "Statement:" in prompt:
        p = P["statement"]
    elif "Reply:" in prompt:
        p = P["reply"]
    else:
        document = prompt.split("</document>")[0].lower()
        question = prompt.split("Question:")[-1].lower()
        p = 0.9 if any(t in question and t in document for t in TOPICS) else 0.1
    return {"Yes": math.log(p), "No": math.log(1 - p)}


def project(make_project, tmp_path, url: str):
    docs = tmp_path / "docs"
    docs.mkdir()
    for topic, text in TOPICS.items():
        (docs / f"{topic}.md").write_text(f"# {topic}\n\n{text}\n")
    path = make_project(index_and_search_yaml().replace("resources:\n", f"resources:\n  llm: {{type: "
                                                        f"openai_compatible, base_url: \"{url}\", max_retries: 0}}\n")
                        + """  ask:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 3}}
      - {id: fuse,   task: fuse, with: {top_k: 3}}
      - {id: insert, task: insert, with: {max_documents: 2}}
      - {id: answer, task: generate, with: {max_tokens: 32}}
""")
    (tmp_path / "prompts").rmdir()
    (tmp_path / "prompts").symlink_to(REPO / "prompts")
    return path


def test_generate_a_test_set_from_the_index_then_judge_the_answers(make_project, tmp_path, capsys):
    with ScriptedLLM(reply, top=top) as llm:
        path = project(make_project, tmp_path, llm.base_url)
        assert cli.main(["index", "-f", str(path), "--no-prefect"]) == 0
        capsys.readouterr()
        assert cli.main(["eval", "-f", str(path), "--generate-testset", "3", "--json", "--no-start-llm"]) == 0
        made = json.loads(capsys.readouterr().out)
        written = [r["messages"][-1]["content"] for r in llm.requests if "messages" in r]
        testset = tmp_path / ".ragline" / "testsets" / "generated.jsonl"
        rows = [json.loads(line) for line in testset.read_text().splitlines()]
        assert made["questions"] == len(rows) == 3 and made["documents"] == 4 and made["path"] == str(testset)
        for row in rows:
            topic = re.search(r"about (\w+)", row["question"]).group(1)
            assert row["generated"] is True and row["strategy"] == "llm"
            assert row["source_id"].endswith(f"{topic}.md") and TOPICS[topic] in row["passage"]
        assert all("data, not instructions" in p for p in written)  # the pseudo-query prompt, with its notice

        llm.requests.clear()
        assert cli.main(["eval", "-f", str(path), "--judge", "--json", "--no-start-llm"]) == 0
        result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "generated" and result["queries"] == 3
    assert result["hit@10"] == 1.0 and result["mrr@10"] == 1.0  # each question finds its source first
    # two claims per answer: "[1]" judged (0.75), "[9]" names no inserted passage (0.0)
    assert result["faithfulness"] == pytest.approx(0.375)
    assert result["answer_relevance"] == pytest.approx(0.6)
    # top 3 retrieved passages: the question's own (0.9) and two others (0.1)
    assert result["context_relevance"] == pytest.approx((0.9 + 0.1 + 0.1) / 3, abs=1e-4)
    assert 0 < result["context_relevance_cosine"] < 1  # MiniLM's cosine, no LLM call
    item = result["items"][0]
    assert [c["judged_against"] for c in item["claims"]] == [[1], []]
    assert result["judge"]["llm_calls"] == 3 * (3 + 1 + 1) and result["judge"]["unreadable"] == 0

    records = [json.loads(p.read_text()) for p in (tmp_path / EVAL_RUNS).glob("*.json")]
    assert len(records) == 1 and records[0]["split"] == "generated" and "items" not in records[0]
    assert records[0]["faithfulness"] == result["faithfulness"] and records[0]["mrr@10"] == 1.0

    assert cli.main(["eval", "-f", str(path), "--no-start-llm"]) != 0  # nothing to evaluate: one line says so
    assert "--generate-testset" in capsys.readouterr().err
    rgb = tmp_path / "rgb.json"
    rgb.write_text('{"id": 0, "query": "q", "answer": "a", "positive": []}\n')
    assert cli.main(["eval", "-f", str(path), "--judge", "--testset", str(rgb), "--no-start-llm"]) != 0
    assert "not a generated test set" in capsys.readouterr().err
    assert cli.main(["eval", "-f", str(path), "--generate-testset", "1", "--dataset", str(rgb),
                     "--no-start-llm"]) != 0  # evaluation data is never overwritten by a generated set
    assert rgb.read_text().startswith('{"id": 0')
