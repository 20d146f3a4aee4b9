"""The checks of ``verify`` that need no LLM (the shipped `ask` runs them, with ``min_grounding: 0.6``):

- grounding: an answer's own words (those not in the question) must occur in the passages it
  *cites*, not merely somewhere in the context; a fabricated name or number does not;
- degenerate output is refused with its reason, as a reader would: a repeated phrase, an answer
  that only restates the question or says nothing but stopwords, a bare number the cited passages
  do not give for what the question asks (issue 24's "paid annual leave?" -> ``1 [3]``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, ContextDocument, Passage, Query
from ragline.tasks.generate.verify import Params, degenerate, grounding, repetition, verify

REFERENCES = ["Super Bowl LV was played on February 7, 2021, at Raymond James Stadium in Tampa, Florida.",
              "The Buccaneers beat the Chiefs 31-9."]
LEAVE = ("Every full-time employee of Kestrel Labs receives 27 days of paid annual leave per calendar year. "
         "Up to five unused days can be carried over; core hours are from 10:00 to 15:00. "
         "The office has 15 meeting rooms.")
BENEFITS = "The company pension scheme is run by Meridian Pensions. Kestrel Labs contributes 6 percent of the salary."
COMPANY = Path(__file__).resolve().parents[2] / "fixtures" / "company"
SAMPLES = Path(__file__).resolve().parents[3] / "samples" / "docs"


def context(texts=REFERENCES) -> Context:
    return Context(documents=[ContextDocument(number=i, passage=Passage(chunk_id=f"c{i}", source_id=f"s{i}", text=t))
                              for i, t in enumerate(texts, start=1)], tokens=50)


def checked(question: str, text: str, texts=REFERENCES, **params) -> Answer:
    from ragline.flows.resources.models.llm_output import parse_citations

    answer = Answer(question=question, text=text, citations=parse_citations(text))
    return verify.fn(query=Query(text=question), answer=answer, context=context(texts),
                     params=Params(**{"fact_check": False, "min_grounding": 0.6, **params}),
                     ctx=StepContext(pipeline="t", step_id="check"), llm=None)


@pytest.mark.parametrize("question, text, cited, found, total", [
    ("Where was Super Bowl 2021 played?", "In Tampa, Florida [1].", [1], 2, 2),
    ("Where was Super Bowl 2021 played?", "In Glendale, Arizona [1].", [1], 0, 2),  # fabricated
    ("Who won Super Bowl LV?", "The Buccaneers beat the Chiefs 31-9 [2].", [2], 4, 4),
    ("Who won Super Bowl LV?", "The Buccaneers beat the Chiefs 31-9 [1].", [1], 0, 4),  # the wrong passage cited
    ("Was Super Bowl LV played in Tampa?", "No, it was played in Miami [1].", [1], 0, 1),
    ("Who won Super Bowl LV?", "The Buccaneers won it [2].", [2], 1, 1),  # won/beat: 'buccaneers' is checked
    ("How were the Buccaneers playing?", "They played well [2].", [2], 0, 1),  # stems: played ~ playing is asked
])
def test_grounding_counts_the_answers_own_words_found_in_the_passages_it_cites(question, text, cited, found,
                                                                               total):
    passages = [REFERENCES[n - 1] for n in cited]
    assert grounding(text, question, passages) == (found, total)


def test_a_fabricated_answer_is_refused_with_the_reason_and_a_grounded_one_kept():
    refused = checked("Where was Super Bowl 2021 played?", "In Glendale, Arizona [1].")
    assert refused.refused and refused.text == "I cannot answer this question" and refused.draft.startswith("In Glendale")
    assert refused.reason == "not grounded in the cited references: 0 of 2 answer words found"
    assert not checked("Where was Super Bowl 2021 played?", "In Tampa, Florida [1].").refused


def test_grounding_reads_only_the_cited_passages_not_the_whole_context():
    """Issue 24: 'Which dental insurance provider?' answered with a name from another passage than the
    one cited passed, because every inserted passage counted."""
    texts = [LEAVE, BENEFITS]
    answer = checked("Which dental insurance provider does Kestrel Labs use?", "Meridian Pensions [1].", texts)
    assert answer.refused and answer.reason.startswith("not grounded in the cited references: 0 of 2")
    assert not checked("Who runs the company pension scheme?", "Meridian Pensions [2].", texts).refused


def test_an_answer_that_cites_nothing_is_read_against_the_one_passage_that_holds_most_of_it():
    """The packaged model rarely writes [n]: such an answer is cited (as inferred) to the single passage
    holding most of its own words and grounded in that one, never in several passages together."""
    kept = checked("Who won Super Bowl LV, and where?", "The Buccaneers beat the Chiefs in Tampa.")
    assert not kept.refused and kept.citations == kept.inferred_citations == [2]
    assert [s.number for s in kept.sources] == [2] and kept.sources[0].passage == REFERENCES[1]
    # 'buccaneers' in passage 2, 'tampa' in passage 1: 1 of 2 in the best single passage
    refused = checked("Who won Super Bowl LV, and where?", "The Buccaneers won, in Tampa.")
    assert refused.refused and refused.reason == "not grounded in the cited references: 1 of 2 answer words found"
    nothing = checked("Where was Super Bowl 2021 played?", "In Glendale, Arizona.")
    assert nothing.refused and nothing.reason == "the answer cites no reference"


def test_a_yes_or_no_is_checked_by_what_the_question_asks_about():
    assert not checked("Was Super Bowl LV played in Tampa?", "Yes [1].").refused
    answer = checked("Was Super Bowl LV played in Glendale, Arizona?", "Yes [1].")  # a yes affirms every part
    assert answer.refused and answer.reason == ("a yes or no the cited references cannot back: 4 of 6 of the "
                                                "question's words found")


@pytest.mark.parametrize("question, text, reason", [
    ("Which Plover version added support for Python 3.13?", "The answer is: " * 32,
     "degenerate answer: it repeats itself (97% of its word 3-grams are repeats)"),
    ("Which Plover version added support for Python 3.13?", "1 1 1 1 1 1 1 1 1 [1]",
     "degenerate answer: it repeats itself (86% of its word 3-grams are repeats)"),
    ("How many days of paid annual leave do employees get?", "Employees get paid annual leave days [1].",
     "degenerate answer: it only restates the question"),
    ("How many days of paid annual leave do employees get?", "It is what it is [1].",
     "degenerate answer: it holds no content words"),
    ("How many days of paid annual leave do employees get?", "The answer is: [1]",
     "degenerate answer: it holds no content words"),
    ("How many days of paid annual leave do employees get?", "", "degenerate answer: it is empty"),
    ("How many days of paid annual leave do employees get?", "1 [1]",
     "degenerate answer: a bare number (1) the cited passages do not give for 'days'"),
    ("How many days of paid annual leave do employees get?", "15 [1]",  # 15 is in the passage, not as days
     "degenerate answer: a bare number (15) the cited passages do not give for 'days'"),
    ("Which version added Python 3.13?", "10:00 [1]",  # in the passage, but not with what is asked
     "degenerate answer: a bare number (10:00) the cited passages do not give for what the question asks"),
])
def test_degenerate_answers_are_refused_with_their_reason(question, text, reason):
    answer = checked(question, text, [LEAVE])
    assert answer.refused and answer.reason == reason and answer.text == "I cannot answer this question"


@pytest.mark.parametrize("question, text", [
    ("How many days of paid annual leave do employees get?", "27 [1]"),
    ("How many days of paid annual leave do employees get?", "27 days [1]."),
    ("How many days of paid annual leave do employees get?", "Employees get 27 days of paid annual leave [1]."),
    ("When do core hours end?", "15:00 [1]"),
])
def test_a_number_the_cited_passage_gives_for_what_is_asked_is_kept(question, text):
    answer = checked(question, text, [LEAVE])
    assert not answer.refused, answer.reason


RELEASES = ("Plover release notes\n\n## Plover 4.2\n\nReleased on 3 March 2026. Plover 4.2 adds an export to Parquet "
            "files.\n\n## Plover 4.1\n\nReleased on 12 November 2025. Plover 4.1 introduces single sign-on with SAML "
            "and drops support for Windows Server 2016.")


def test_a_number_in_a_longer_answer_must_be_given_for_what_is_asked():
    """Issue 24 measured: 'Which Plover version introduced single sign-on?' -> 'The Plover 4.2 version introduced
    single sign-on with SAML ...', every word of it in the cited release notes, the version from the wrong line."""
    question = "Which Plover version introduced single sign-on?"
    wrong = checked(question, "The Plover 4.2 version introduced single sign-on with SAML and drops support for "
                              "Windows Server 2016 [1].", [RELEASES])
    assert wrong.refused and wrong.reason == ("not grounded in the cited references: 4.2 is not given there for what "
                                              "the question asks")
    right = checked(question, "Plover 4.1 introduced single sign-on with SAML, and dropped Windows Server 2016 [1].",
                    [RELEASES])
    assert not right.refused, right.reason


def test_degenerate_output_is_refused_even_with_grounding_off():
    answer = checked("Which Plover version added support for Python 3.13?", "The answer is: " * 32, [LEAVE],
                     min_grounding=0.0)
    assert answer.refused and answer.reason.startswith("degenerate answer: it repeats itself")
    assert not checked("Which version?", "The answer is: " * 32, [LEAVE], min_grounding=0.0,
                       refuse_degenerate=False).refused


def test_the_repetition_threshold_sits_above_every_stretch_of_natural_text():
    """Label-free calibration of ``max_repetition``: no window of the bundled documents (and SciFact's
    first 2000 abstracts, when the data is there) of an answer's length repeats itself that much."""
    import json
    import os

    texts = [p.read_text(encoding="utf-8") for folder in (SAMPLES, COMPANY) for p in sorted(folder.iterdir())]
    corpus = Path(os.environ.get("RAGLINE_DATA_DIR", "/nonexistent")) / "scifact" / "corpus.jsonl"
    if corpus.is_file():
        with corpus.open(encoding="utf-8") as handle:
            texts += [json.loads(line)["text"] for _, line in zip(range(2000), handle)]
    windows = [" ".join(words[i:i + 64]) for words in (t.split() for t in texts) for i in range(0, len(words), 32)]
    worst = max(repetition(w) for w in windows)
    assert worst + 0.1 < Params().max_repetition, worst  # here: 0.34 (SciFact's most repetitive abstract)


def test_degenerate_is_none_for_a_plain_answer():
    assert degenerate("Employees get 27 days of paid annual leave.",
                      "How many days of paid annual leave do employees get?", [LEAVE], Params()) is None


def test_a_refusal_the_model_writes_itself_is_one_refusal_with_no_withdrawn_draft():
    """Issue 15 item 5: the model's own refusal is not a draft that verification withdrew."""
    from ragline.flows.resources.models.llm import Completion
    from ragline.tasks.generate.generate import answer_from

    query = Query(text="Who won?")
    answer = answer_from(query, Completion("I cannot answer this question. </document>"), context(),
                         "I cannot answer this question", min_overlap=0.6)
    assert answer.refused and answer.text == "I cannot answer this question" and answer.draft == ""
    kept = verify.fn(query=query, answer=answer, context=context(), params=Params(fact_check=False, min_grounding=0.6),
                     ctx=StepContext(pipeline="t", step_id="check"), llm=None)
    assert kept == answer  # verify leaves a refusal as it is: no second one, no draft
