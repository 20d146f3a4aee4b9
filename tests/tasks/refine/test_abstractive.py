"""Abstractive compression through the engine and the scripted LLM over real HTTP: each passage
becomes a summary within its token budget, keeps its identity so a citation still names the
original document, may be dropped when the LLM calls it irrelevant, and keeps its own text (with
the reason logged) when its summary fails."""
from __future__ import annotations

import logging
import re

from tests.helpers.llm_stages import chat_prompts, project_for, run
from tests.scripted_llm import ScriptedLLM

PARIS = ("Paris is the capital of France. It has been the seat of government for centuries. The city lies on "
         "the Seine and is known for its museums, its cafés and the Eiffel Tower, built in 1889.")
CATS = "Cats purr when they are content, and sometimes when they are in pain or frightened by loud noises."
EUROPE = ("France is a country in Western Europe. It borders Belgium, Luxembourg, Germany, Switzerland, Italy, "
          "Monaco, Spain and Andorra, and its overseas regions lie on several continents.")
SUMMARIES = {"Paris is the capital": "Paris is the capital of France.", "Western Europe": "France is in Europe."}
COMPRESS = "      - {id: compress, task: refine_abstractive, with: {max_tokens: 48}}\n"


def document(prompt: str) -> str:
    return re.search(r"<document>\n(.*?)\n</document>", prompt, re.DOTALL).group(1)


def summarise(prompt: str) -> str:
    """The scripted model: a summary per known passage, IRRELEVANT for the rest; answers cite [1] and [2]."""
    if "Summary:" not in prompt:
        return "Paris is the capital [1] of a European country [2]."
    text = document(prompt)
    return next((summary for key, summary in SUMMARIES.items() if key in text), "IRRELEVANT")


def test_summaries_replace_the_text_and_citations_still_name_the_original_documents(make_project):
    steps = COMPRESS + ("      - {id: insert, task: insert, with: {max_tokens: 1000}}\n"
                        "      - {id: answer, task: generate}\n")
    with ScriptedLLM(summarise) as llm:
        answer = run(project_for(make_project, llm.base_url, steps, [PARIS, CATS, EUROPE]))
        prompts = chat_prompts(llm)
        budgets = [r["max_tokens"] for r in llm.requests if "Summary:" in str(r.get("messages"))]
    generation = next(p for p in prompts if "Summary:" not in p)
    assert "Paris is the capital of France." in generation and "Eiffel Tower" not in generation  # the summary went in
    assert "Cats purr" not in generation  # the irrelevant passage was dropped
    assert [(s.number, s.source_id, s.chunk_id, s.path) for s in answer.sources] == \
        [(1, "doc1", "c1", "/data/doc1.md"), (2, "doc3", "c3", "/data/doc3.md")]
    assert budgets == [48, 48, 48]
    assert all("at most 36 words" in p for p in prompts if "Summary:" in p)  # the budget, told in words


def test_the_original_text_is_kept_beside_the_summary_and_irrelevant_passages_may_stay(make_project):
    keep = COMPRESS.replace("max_tokens: 48", "max_tokens: 48, drop_irrelevant: false")
    with ScriptedLLM(summarise) as llm:
        passages = run(project_for(make_project, llm.base_url, keep, [PARIS, CATS, EUROPE]))
    assert [(p.chunk_id, p.source_id, p.title, p.metadata["source"]) for p in passages] == \
        [(f"c{i}", f"doc{i}", f"Doc {i}", f"/data/doc{i}.md") for i in (1, 2, 3)]
    assert [p.text for p in passages] == ["Paris is the capital of France.", CATS, "France is in Europe."]
    assert [p.original_text for p in passages] == [PARIS, None, EUROPE]


def test_a_failed_summary_keeps_the_passage_with_the_reason_logged(make_project, caplog):
    def replies(prompt: str) -> str:
        text = document(prompt)
        if "Western Europe" in text:
            return ""  # nothing usable
        if "Cats" in text:
            return CATS + " " + CATS  # longer than the passage: no compression
        return "Paris is the capital of France."

    with ScriptedLLM(replies) as llm, caplog.at_level(logging.WARNING):
        passages = run(project_for(make_project, llm.base_url, COMPRESS, [PARIS, CATS, EUROPE]))
    assert [p.text for p in passages] == ["Paris is the capital of France.", CATS, EUROPE]
    assert "c3 (doc3) kept uncompressed: the summary was empty" in caplog.text
    assert "c2 (doc2) kept uncompressed: the summary was no shorter than the passage" in caplog.text


def test_an_endpoint_failure_keeps_every_passage_and_says_why(make_project, caplog):
    with ScriptedLLM(status=500) as llm, caplog.at_level(logging.WARNING):
        passages = run(project_for(make_project, llm.base_url, COMPRESS, [PARIS, EUROPE]))
    assert [p.text for p in passages] == [PARIS, EUROPE] and all(p.original_text is None for p in passages)
    assert caplog.text.count("kept uncompressed: the LLM failed") == 2


def test_a_summary_echoing_the_prompts_delimiters_loses_them(make_project):
    with ScriptedLLM(lambda p: "Paris is the capital.</document>\n<references>") as llm:
        [passage] = run(project_for(make_project, llm.base_url, COMPRESS, [PARIS]))
    assert passage.text == "Paris is the capital."


def test_a_summary_cut_by_its_budget_keeps_its_whole_sentences(make_project, caplog):
    """The server stops at max_tokens (16 words here): a cut sentence goes, one that ended at the cut
    stays; a summary whose first sentence was cut is no summary, so that passage keeps its own text."""
    def replies(prompt: str) -> str:
        if "Western Europe" in document(prompt):
            return ("France, a large country whose borders touch eight neighbours and whose overseas regions lie on "
                    "nearly every continent of the world")
        return "Paris is the capital of France. It lies on the Seine in the north of France. It has a tower."

    steps = COMPRESS.replace("max_tokens: 48", "max_tokens: 16")
    with ScriptedLLM(replies, cut_at_max_tokens=True) as llm, caplog.at_level(logging.WARNING):
        passages = run(project_for(make_project, llm.base_url, steps, [PARIS, EUROPE]))
    cut = "Paris is the capital of France. It lies on the Seine in the north of France."  # 16 words: both whole
    assert [p.text for p in passages] == [cut, EUROPE]
    assert "c2 (doc2) kept uncompressed: the summary was empty or cut off within its first sentence" in caplog.text
