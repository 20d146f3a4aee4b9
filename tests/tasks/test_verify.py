"""The grounding check of ``verify`` (the shipped `ask` refuses below 0.6): an answer's own words,
those not in the question, must occur in the references; a fabricated name or number does not."""
from __future__ import annotations

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, ContextDocument, Passage, Query
from ragline.tasks.verify import Params, grounding, verify

REFERENCES = ["Super Bowl LV was played on February 7, 2021, at Raymond James Stadium in Tampa, Florida.",
              "The Buccaneers beat the Chiefs 31-9."]


def context(texts=REFERENCES) -> Context:
    return Context(documents=[ContextDocument(number=i, passage=Passage(chunk_id=f"c{i}", source_id=f"s{i}", text=t))
                              for i, t in enumerate(texts, start=1)], tokens=50)


def checked(question: str, text: str) -> Answer:
    answer = Answer(question=question, text=text)
    return verify.fn(query=Query(text=question), answer=answer, context=context(),
                     params=Params(fact_check=False, min_grounding=0.6), ctx=StepContext(pipeline="t", step_id="check"),
                     llm=None)


@pytest.mark.parametrize("question, text, found, total", [
    ("Where was Super Bowl 2021 played?", "In Tampa, Florida [1].", 2, 2),
    ("Where was Super Bowl 2021 played?", "In Glendale, Arizona [1].", 0, 2),  # fabricated: not in the references
    ("Who won Super Bowl LV?", "The Buccaneers beat the Chiefs 31-9 [2].", 4, 4),
    ("Was Super Bowl LV played in Tampa?", "Yes [1].", 0, 0),  # a verdict, not a fact to find
    ("Was Super Bowl LV played in Tampa?", "No, it was played in Miami [1].", 0, 1),
])
def test_grounding_counts_the_answers_own_words_found_in_the_references(question, text, found, total):
    assert grounding(text, question, context()) == (found, total)


def test_a_fabricated_answer_is_refused_with_the_reason_and_a_grounded_one_kept():
    refused = checked("Where was Super Bowl 2021 played?", "In Glendale, Arizona [1].")
    assert refused.refused and refused.text == "I cannot answer this question" and refused.draft.startswith("In Glendale")
    assert refused.reason == "not grounded in the references: 0 of 2 answer words found"
    assert not checked("Where was Super Bowl 2021 played?", "In Tampa, Florida [1].").refused
    assert not checked("Was Super Bowl LV played in Tampa?", "Yes [1].").refused  # was refused: 'yes' is not in them


def test_a_refusal_the_model_writes_itself_is_one_refusal_with_no_withdrawn_draft():
    """Issue 15 item 5: the model's own refusal is not a draft that verification withdrew."""
    from ragline.flows.resources.llm import Completion
    from ragline.tasks.generate import answer_from

    query = Query(text="Who won?")
    answer = answer_from(query, Completion("I cannot answer this question. </document>"), context(),
                         "I cannot answer this question", min_overlap=0.6)
    assert answer.refused and answer.text == "I cannot answer this question" and answer.draft == ""
    kept = verify.fn(query=query, answer=answer, context=context(), params=Params(fact_check=False, min_grounding=0.6),
                     ctx=StepContext(pipeline="t", step_id="check"), llm=None)
    assert kept == answer  # verify leaves a refusal as it is: no second one, no draft
