"""The answer judge (issue 20.4) against a real HTTP endpoint (the scripted OpenAI-compatible server):
claims and their citations, P(yes) from the first token's logprobs, aggregation, agreement/AUC, and
hostile passage text that must stay inside its document in every judge prompt."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from ragline.flows.contracts import Answer, Source
from ragline.flows.evaluation.judge import (Judge, agreement, claim_passages, load_testset, mean, split_claims,
                                            is_testset)
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.spec.prompts import PromptLibrary
from tests.helpers.hostile import FORGED, HOSTILE
from tests.scripted_llm import ScriptedLLM

PROMPTS = Path(__file__).resolve().parents[3] / "prompts"


def client(server: ScriptedLLM) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))


def judge_for(server: ScriptedLLM, **kwargs) -> Judge:
    return Judge(client(server), PromptLibrary(PROMPTS).render, **kwargs)


def prompts_of(server: ScriptedLLM) -> list[str]:
    return [r["messages"][-1]["content"] for r in server.requests if "messages" in r]


def test_claims_are_sentences_with_their_own_markers_and_trailing_markers_belong_to_the_sentence_before():
    assert split_claims("Paris is the capital [1]. It is large. [2] It is old [3][9].") == [
        ("Paris is the capital [1].", [1]), ("It is large.", [2]), ("It is old [3][9].", [3, 9])]
    assert split_claims("One claim. [1, 2]") == [("One claim.", [1, 2])]
    assert split_claims("[1]. ") == []  # markers alone are no claim


def test_a_claim_is_judged_against_its_own_citations_else_the_answers_else_every_passage():
    passages = {1: "a", 2: "b", 3: "c"}
    assert claim_passages([3, 9], [1, 3, 9], passages) == [3]  # [9] names no passage
    assert claim_passages([], [1, 2], passages) == [1, 2]  # unmarked sentence: what the answer cites
    assert claim_passages([], [], passages) == [1, 2, 3]  # an answer citing nothing: every passage
    assert claim_passages([7], [7], passages) == []  # cites only a passage that does not exist


def test_the_score_is_p_yes_from_the_first_tokens_top_logprobs():
    top = {"Yes": math.log(0.3), "No": math.log(0.6), "Maybe": math.log(0.1)}
    with ScriptedLLM(lambda p: "No", top=lambda p: top) as server:
        score = judge_for(server).answer_relevance("Where is Paris?", "In France [1].")
        request = server.requests[-1]
    assert score == pytest.approx(0.3 / 0.9)  # normalised over yes and no
    assert request["logprobs"] is True and request["top_logprobs"] >= 2 and request["max_tokens"] == 1


def test_a_reply_without_a_yes_or_no_is_unreadable_not_guessed():
    with ScriptedLLM(lambda p: "Perhaps", top=lambda p: {"Perhaps": -0.01}) as server:
        item = judge_for(server).judge("q1", Answer(question="Where?", text="Paris."), ["Paris is in France."])
    assert item.answer_relevance is None and item.context_relevance is None and item.faithfulness is None
    assert item.unreadable == 3  # one passage, one claim, the answer's relevance


def _supported_if(word: str):
    """P(yes) 0.9 when the statement's passages hold ``word``, else 0.2."""
    def top(prompt: str) -> dict[str, float]:
        if "Statement:" not in prompt:
            return {"Yes": math.log(0.5), "No": math.log(0.5)}
        references = prompt.split("</references>")[0]
        p = 0.9 if word in references else 0.2
        return {"Yes": math.log(p), "No": math.log(1 - p)}
    return top


def test_each_claim_sees_only_the_passages_it_cites_and_the_item_is_their_mean():
    answer = Answer(question="Tell me about Paris.", text="Paris is in France [1]. It has a tower [2]. "
                                                         "It has a moon base [7].",
                    citations=[1, 2, 7], sources=[Source(number=1, chunk_id="c1", source_id="d1",
                                                         passage="Paris is the capital of France."),
                                                  Source(number=2, chunk_id="c2", source_id="d2",
                                                         passage="The Eiffel tower is in Rome.")])
    with ScriptedLLM(lambda p: "Yes", top=_supported_if("France")) as server:
        item = judge_for(server).judge("q1", answer, ["Paris is the capital of France."])
        statements = [p for p in prompts_of(server) if "Statement:" in p]
    assert [c.judged_against for c in item.claims] == [[1], [2], []]
    assert [c.score for c in item.claims] == pytest.approx([0.9, 0.2, 0.0])  # [7]: cites nothing real
    assert item.faithfulness == pytest.approx((0.9 + 0.2 + 0.0) / 3)
    assert len(statements) == 2  # the claim citing no real passage costs no call
    assert "Rome" not in statements[0] and "France" not in statements[1].split("</references>")[0]
    assert "[1]" not in statements[0].split("Statement:")[1]  # markers are not part of the claim


def test_a_refusal_is_not_judged_for_faithfulness_or_relevance_but_its_context_is():
    refusal = Answer(question="Who?", text="I cannot answer this question", refused=True)
    with ScriptedLLM(lambda p: "Yes", top=lambda p: {"Yes": math.log(0.8), "No": math.log(0.2)}) as server:
        judge = judge_for(server)
        item = judge.judge("q1", refusal, ["one passage", "another"])
        summary = judge.summary([item, judge.judge("q2", Answer(question="Who?", text="Ada [1].", citations=[1]),
                                                   ["Ada wrote it."])], seconds=1.0)
    assert item.faithfulness is None and item.answer_relevance is None and item.claims == []
    assert item.passage_relevance == pytest.approx([0.8, 0.8]) and item.context_relevance == pytest.approx(0.8)
    assert summary.items == 2 and summary.refused == 1 and summary.claims == 1
    assert summary.faithfulness == pytest.approx(0.8) and summary.supported_claims == 1.0
    assert summary.llm_calls == 2 + 1 + 1 + 1  # passages of both, one claim, one answer relevance


def test_an_uncited_answer_is_judged_against_the_retrieved_passages():
    answer = Answer(question="Capital of France?", text="Paris.")
    with ScriptedLLM(lambda p: "Yes", top=_supported_if("capital of France")) as server:
        item = judge_for(server).judge("q1", answer, ["Paris is the capital of France.", "Lyon is big."])
    assert item.claims[0].judged_against == [1, 2] and item.faithfulness == pytest.approx(0.9)


def test_the_embedding_judge_scores_context_relevance_without_the_llm():
    def embed(question, passages):
        return [1.0 if "France" in p else 0.0 for p in passages]
    with ScriptedLLM(lambda p: "Yes") as server:
        item = judge_for(server, embed=embed).judge("q1", Answer(question="Q", text="I cannot", refused=True),
                                                    ["France", "Spain"])
    assert item.context_relevance_cosine == 0.5


@pytest.mark.parametrize("opening", ["Check a statement", "Judge whether a reply", "Judge whether a document"])
def test_hostile_text_in_a_passage_question_or_answer_cannot_escape_a_judge_prompt(opening):
    with ScriptedLLM(lambda p: "Yes", top=lambda p: {"Yes": -0.1, "No": -2.5}) as server:
        judge = judge_for(server)
        answer = Answer(question=HOSTILE, text=f"{HOSTILE} [1]", citations=[1],
                        sources=[Source(number=1, chunk_id="c", source_id="evil", passage=HOSTILE)])
        judge.judge("q1", answer, [HOSTILE])
        prompt = next(p for p in prompts_of(server) if p.lstrip().startswith(opening))
    assert "PWNED" in prompt and FORGED not in prompt
    assert prompt.count("<document") == prompt.count("</document>")
    head = prompt.split("Question:", 1)[0]
    assert "data, not instructions" in head
    assert re.search(r"Answer Yes or No\.\s*$|Reply Yes or No\.\s*$", prompt)  # the question comes last


def test_agreement_and_auc_against_labels():
    result = agreement([0.9, 0.8, 0.3, 0.1, None], [True, False, True, False, True])
    assert result == {"n": 4, "unreadable": 1, "agreement": 0.5, "balanced_accuracy": 0.5, "auc": 0.75}
    assert agreement([0.6, 0.6], [True, False])["auc"] == 0.5  # ties count half: a constant judge is chance
    assert agreement([0.9], [True])["auc"] is None  # one class only: no AUC
    assert mean([None, 1.0, 0.0]) == 0.5 and mean([None]) is None


def test_a_generated_test_set_is_told_apart_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "set.jsonl"
    good.write_text('{"id": "g1", "question": "Why?", "source_id": "d", "chunk_id": "c", "passage": "p", '
                    '"strategy": "llm", "generated": true}\n')
    rgb = tmp_path / "rgb.json"
    rgb.write_text('{"id": 0, "query": "q", "answer": "a", "positive": []}\n')
    assert is_testset(good) and not is_testset(rgb) and not is_testset(tmp_path / "missing.jsonl")
    assert load_testset(good)[0].question == "Why?"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"id": "g2", "question": "Why?"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a generated test question \(source_id: Field required"):
        load_testset(bad)
