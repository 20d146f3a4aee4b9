"""Fact check of the answer against its references, and a confidence threshold on token logprobs.

An answer the references contradict or do not support, one generated with low confidence, or one
a reader would not take for an answer (repeated, the question restated, stopwords, a bare number the
cited passages do not give for what was asked) becomes the refusal text ("I cannot answer this
question"), with the reason kept in the result. Grounding reads only the passages the answer cites.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Answer, Context, EvidenceAnswer, Query, Source
from ragline.flows.errors import MissingResource
from ragline.flows.resources.models.llm_output import clip, option_probabilities, sentences, strip_citations
from ragline.flows.spec.registry import stage
from ragline.flows.resources.models.llm import LLMClient
from ragline.tasks.generate.extract_answer import question_type
from ragline.tasks.generate.generate import REFUSAL

Verdict = Literal["supported", "contradicted", "not_enough_information"]
OPTIONS = {"supported": ("supported",), "contradicted": ("contradicted",),
           "not_enough_information": ("insufficient", "not enough")}


YES_NO = {"yes": ("yes",), "no": ("no",)}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fact_check: bool = Field(True, description="ask the LLM whether the references support the answer")
    method: Literal["binary", "three_way"] = Field(
        "binary", description="binary: 'supported?' then 'contradicted?' as yes/no questions (robust with small "
                              "models); three_way: one SUPPORTED/CONTRADICTED/INSUFFICIENT question")
    support_threshold: float = Field(0.5, ge=0, le=1, description="binary: P(yes) at which the answer is supported")
    reject: list[Verdict] = Field(["contradicted", "not_enough_information"],
                                  description="verdicts that turn the answer into the refusal")
    min_verdict_probability: float = Field(0.5, ge=0, le=1, description="a verdict counts above this probability")
    min_confidence: float = Field(0.0, ge=0, le=1, description="refuse below this geometric-mean token probability")
    min_grounding: float = Field(0.0, ge=0, le=1, description="refuse when fewer of the answer's own content words "
                                                              "(those not in the question) occur in the passages "
                                                              "it cites; an answer citing none is refused")
    refuse_degenerate: bool = Field(True, description="refuse an empty or repeated answer, one that only restates "
                                                      "the question or holds no content words, and a bare number the "
                                                      "cited passages do not give for what the question asks")
    max_repetition: float = Field(0.5, gt=0, le=1, description="degenerate above this share of repeated word "
                                                               "3-grams (in 64-word windows of the samples and 5000 "
                                                               "SciFact abstracts: 0.22 at the 99.9th percentile, "
                                                               "0.34 at most; a looping answer 0.8 or more)")
    refusal: str = Field(REFUSAL)


def reads_roles(params: Params) -> dict[str, tuple[str, str]]:
    """The LLM only for the fact check; grounding and the evidence need none (``ask_extractive``)."""
    return {"llm": ("fact_check", "fact_check: true asks the LLM whether the references support the answer")} \
        if params.fact_check else {}


@stage("verify", params=Params, produces="answer", kind="query", uses={"llm": ("openai_compatible",)},
       reads_roles=reads_roles,
       prompt=lambda p: "fact_check_support" if p.method == "binary" else "fact_check",
       prompt_variables=("question", "answer", "documents"),
       other_prompts=lambda p: ({"fact_check_contradict": ("question", "answer", "documents")}
                                if p.method == "binary" else {}))
def verify(query: Query, context: Context, params: Params, ctx: StepContext, answer: Answer | None = None,
           evidence: EvidenceAnswer | None = None, llm: LLMClient | None = None) -> Answer:
    """Judge the answer; keep it, or replace it by the refusal and say why. After an evidence step
    (``extract_answer``) the evidence comes first: the generated answer is kept only where it is
    grounded in the evidence's sentences, else the evidence answer is shown, labelled as such;
    without a generated answer (``ask_extractive``) the evidence answer is the answer."""
    if answer is None:
        if evidence is None:
            raise ValueError("verify needs an answer (a generate step) or an evidence answer (an extract_answer "
                             "step) upstream")
        return from_evidence(query, evidence, params)
    checked = checked_answer(query, answer, context, params, ctx, llm)
    return checked if evidence is None else evidence_first(query, checked, evidence, params)


def checked_answer(query: Query, answer: Answer, context: Context, params: Params, ctx: StepContext,
                   llm: LLMClient | None) -> Answer:
    """The generated answer's own checks: confidence, degeneracy, grounding, the LLM's fact check."""
    if answer.refused:
        return answer
    if answer.confidence is not None and answer.confidence < params.min_confidence:
        return _refuse(answer, params, f"low confidence: {answer.confidence:.2f} < {params.min_confidence:.2f}")
    if not answer.citations and params.min_grounding > 0:
        answer = attributed(answer, query.text, context)
    cited = cited_passages(answer, context)
    if params.refuse_degenerate and (problem := degenerate(answer.text, query.text, cited, params)):
        return _refuse(answer, params, f"degenerate answer: {problem}")
    if params.min_grounding > 0:
        if not cited:
            return _refuse(answer, params, "the answer cites no reference")
        if (reason := ungrounded(answer.text, query.text, cited, params.min_grounding)):
            return _refuse(answer, params, reason)
    if not params.fact_check:
        return answer
    if llm is None:
        raise MissingResource("fact_check: true needs an openai_compatible resource (or set fact_check: false)")
    variables = {"question": clip(query.text, 1000), "answer": clip(answer.text, 2000),
                 "documents": context.documents}
    probabilities = (_binary(variables, params, ctx, llm) if params.method == "binary"
                     else _ask(ctx.prompt(**variables), OPTIONS, llm))
    if not probabilities:
        ctx.logger.warning("fact check unreadable; the answer is kept unverified")
        return answer
    verdict = max(probabilities, key=probabilities.get)
    checked = answer.model_copy(update={"verdict": verdict})
    if verdict in params.reject and probabilities[verdict] >= params.min_verdict_probability:
        return _refuse(checked, params, f"fact check: {verdict.replace('_', ' ')} "
                                        f"(p={probabilities[verdict]:.2f})")
    return checked


# ----------------------------------------------------------------------------- evidence first
def from_evidence(query: Query, evidence: EvidenceAnswer, params: Params, reason: str = "",
                  draft: str = "") -> Answer:
    """The evidence answer as the pipeline's answer (or its refusal, with the evidence's reason)."""
    if evidence.refused:
        return Answer(question=query.original or query.text, text=params.refusal, refused=True,
                      reason=evidence.reason, draft=draft, evidence=evidence)
    return Answer(question=query.original or query.text, text=evidence.text, sources=evidence.sources,
                  citations=evidence.citations, confidence=evidence.confidence, reason=reason, draft=draft,
                  evidence=evidence, answered_by="evidence")


def evidence_first(query: Query, checked: Answer, evidence: EvidenceAnswer, params: Params) -> Answer:
    """The generated answer where the evidence grounds it; else the evidence answer (or its refusal):
    a failed, degenerate or refused generation never hides an answer the evidence gives, and a
    generated answer never stands where the evidence refuses."""
    if evidence.refused:
        if checked.refused:
            return checked.model_copy(update={"evidence": evidence})
        return from_evidence(query, evidence, params, draft=checked.text)
    if checked.refused:
        return from_evidence(query, evidence, params, reason=f"the generated answer was replaced by the evidence "
                                                             f"answer: {checked.reason}",
                             draft=checked.draft or checked.text)
    if problem := against_evidence(checked.text, query.text, evidence, params.min_grounding):
        return from_evidence(query, evidence, params, reason=f"the generated answer was replaced by the evidence "
                                                             f"answer: {problem}", draft=checked.text)
    return checked.model_copy(update={"evidence": evidence, "answered_by": "llm"})


def against_evidence(answer: str, question: str, evidence: EvidenceAnswer, min_grounding: float) -> str | None:
    """Why a generated answer is not grounded in the evidence's sentences, or None: it drops the
    evidence's value, states a number they do not hold, or too few of its own words are in them."""
    said = " ".join(span.text for span in evidence.spans)
    known = set(tokens(said)) | set(stems(tokens(said)))
    written = set(tokens(answer)) | set(stems(tokens(answer)))
    value = [w for w in tokens(evidence.value) if len(w) > 1 and w not in STOPWORDS]
    if value and not all(w in written for w in value):
        return f"it does not give the evidence's value '{evidence.value}'"
    asked = set(tokens(question))
    if stray := [w for w in tokens(answer) if NUMBER.fullmatch(w) and w not in known and w not in asked]:
        return f"its number {stray[0]} is not in the evidence"
    if question_type(question) not in ("name", "place") and evidence.spans:
        stated = [w for w in tokens(evidence.spans[0].text) if NUMBER.fullmatch(w) and w not in asked]
        if dropped := [w for w in stated if w not in written]:  # "30 seconds" where it changed "from 30 to 90"
            return f"it leaves out the evidence's {dropped[0]}"
    found, total = grounding(answer, question, [said])
    if total and found / total < min_grounding:
        return f"not grounded in the evidence: {found} of {total} answer words found"
    return None


# Words that carry no claim of their own: function words, the prompt's and a chatty model's filler
# ("the answer is", "according to the documents"). A yes/no is judged through the question (``verdict_words``).
STOPWORDS = frozenset("""a an the of in on at to for from by with without about into onto over under between
through during before after above below up down out off than then so such as and or but nor if because while
until unless although though is was were are be been being am do does did doing done have has had having can
could will would shall should might must it its it's this that these those there here what which who whom whose
when where why how i me my mine you your yours he him his she her hers we us our ours they them their theirs
ones some any all each every both either neither not no yes only just also very too more most much many
other another same own get gets got getting make makes made go goes went say says said s t d ll re ve m
answer answers question questions document documents reference references according text passage passages
context given based following provided information true false correct incorrect""".split())
AUXILIARIES = frozenset("is are was were am do does did can could has have had will would shall should may might "
                        "must".split())
TOKEN = re.compile(r"[^\W_]+(?:[.,:/-]\d+)*")
NUMBER = re.compile(r"\d+(?:[.,:/-]\d+)*")
UNIT_WINDOW = 3  # "how many X": the number must stand within this many words of X in a cited passage
NGRAM = 3
MIN_REPETITION_WORDS = 8  # shorter answers are not judged for repetition


def tokens(text: str) -> list[str]:
    """Lower-case words and numbers (a number keeps its inner . , : / -: "4.1", "10:00", "31-9"; "q2" is one)."""
    return TOKEN.findall(strip_citations(text).lower())


def stems(words: list[str]) -> list[str]:
    """Snowball (english) stems of words, numbers as they are: 'days' matches 'day', 'played' 'playing'."""
    import Stemmer

    return Stemmer.Stemmer("english").stemWords(words)


def content(words: list[str]) -> list[str]:
    return [w for w in words if w not in STOPWORDS]


def repetition(text: str) -> float:
    """The share of the text's word 3-grams that repeat an earlier one (0: none; a looping answer ~1)."""
    words = tokens(text)
    grams = [tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)]
    if len(words) < MIN_REPETITION_WORDS or not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def cited_passages(answer: Answer, context: Context) -> list[str]:
    """The texts of the inserted passages the answer cites (its valid [n] markers)."""
    documents = context.by_number()
    return [documents[n].passage.text for n in answer.citations if n in documents]


def attributed(answer: Answer, question: str, context: Context) -> Answer:
    """An answer that cites nothing, cited (as inferred) to the one inserted passage holding most of
    its own words, which grounding then reads: never the words of several passages together."""
    scored = [(grounding(answer.text, question, [d.passage.text])[0], -d.number, d) for d in context.documents]
    found, _, best = max(scored, key=lambda s: s[:2], default=(0, 0, None))
    if best is None or not found:
        return answer
    source = Source.of(best.number, best.passage)
    return answer.model_copy(update={"citations": [best.number], "inferred_citations": [best.number],
                                     "sources": [source]})


def own_words(answer: str, question: str) -> list[str]:
    """The answer's content words (stems) that the question does not already contain."""
    asked = set(stems(tokens(question)))
    return [w for w in stems(content(tokens(answer))) if w not in asked]


def degenerate(answer: str, question: str, cited: list[str], params: Params) -> str | None:
    """Why a reader would not take this for an answer at all, or None."""
    words = tokens(answer)
    if not words:
        return "it is empty"
    if (ratio := repetition(answer)) > params.max_repetition:
        return f"it repeats itself ({ratio:.0%} of its word 3-grams are repeats)"
    if verdict_words(answer, question) is not None:
        return None
    if not content(words):
        return "it holds no content words"
    own = own_words(answer, question)
    if not own:
        return "it only restates the question"
    if all(NUMBER.fullmatch(w) for w in own) and (number := untied_number(own, question, cited)):
        unit = asked_unit(question)
        return f"a bare number ({number}) the cited passages do not give for " + (f"'{unit}'" if unit else
                                                                                   "what the question asks")
    return None


def untied_number(words: list[str], question: str, cited: list[str], bare: bool = True) -> str | None:
    """The first number among ``words`` that the cited passages do not give for what was asked: not
    next to the noun of "how many X"; else not in a sentence (or line, with the one before it) that
    holds half the question's content words. A bare number needs such a sentence; a number inside a
    longer answer is refused only when the passages have such sentences and it is in none of them
    ("Plover 4.2" for the version that added single sign-on, where 4.1's sentence says so)."""
    unit = asked_unit(question)
    asked = set(stems(content(tokens(question))))
    about = [before | said for text in cited for before, said in _sentence_pairs(text)
             if len(asked & (before | said)) * 2 >= len(asked)]
    for number in (w for w in words if NUMBER.fullmatch(w)):
        if unit is not None:
            if not any(_near(number, unit, stems(tokens(text))) for text in cited):
                return number
        elif not any(number in said for said in about) and (bare or about):
            return number
    return None


def _sentence_pairs(text: str) -> list[tuple[set[str], set[str]]]:
    """(the previous sentence's stems, the sentence's stems) for each sentence or line of ``text``:
    "It was released on July 21, 2017" names its subject in the sentence before."""
    said = [set(stems(tokens(s))) for line in text.splitlines() for s in sentences(line)]
    return list(zip([set()] + said[:-1], said))


NUMBER_QUESTION = re.compile(r"\b(?:how (?:many|much|long|old|far)|when|what (?:year|date|time)|version|number|"
                             r"percent|percentage|price|cost|rate|score)\b", re.I)


def asks_for_number(question: str) -> bool:
    """Whether the answer to ``question`` is a number (a count, a version, a date): then a number in
    a longer answer is its answer, and must be the one the cited passages give for it."""
    return bool(NUMBER_QUESTION.search(question))


def asked_unit(question: str) -> str | None:
    """The noun a "how many" question counts ("days" in "How many days of leave ..."), or None."""
    words = tokens(question)
    for i, (first, second) in enumerate(zip(words, words[1:])):
        if first == "how" and second == "many":
            return next((w for w in words[i + 2:] if w not in STOPWORDS and not NUMBER.fullmatch(w)), None)
    return None


def _near(number: str, unit: str, words: list[str]) -> bool:
    target = stems([unit])[0]
    return any(w == number and target in words[max(0, i - UNIT_WINDOW):i + UNIT_WINDOW + 1]
               for i, w in enumerate(words))


def verdict_words(answer: str, question: str) -> list[str] | None:
    """For a bare yes/no to a yes/no question, the claim it affirms or denies: the question's content
    words (stems); None for any other answer."""
    words, asked = tokens(answer), tokens(question)
    if not words or words[0] not in ("yes", "no") or not asked or asked[0] not in AUXILIARIES:
        return None
    if own_words(answer, question):
        return None  # "No, it was Miami": its own words are checked
    return stems(content(asked))


def grounding(answer: str, question: str, passages: list[str]) -> tuple[int, int]:
    """(found, total): the answer's own content words (not in the question) and how many of them
    occur in the passages (those it cites). A fabricated name or number is rarely in them. For a
    bare yes/no, the question's content words: what the yes or no is about."""
    words = verdict_words(answer, question) or own_words(answer, question)
    known = set(stems(tokens(" ".join(passages))))
    return sum(w in known for w in words), len(words)


def ungrounded(answer: str, question: str, cited: list[str], min_grounding: float) -> str | None:
    found, total = grounding(answer, question, cited)
    if verdict_words(answer, question) is not None:
        if found < total:  # a yes affirms every part of the question
            return f"a yes or no the cited references cannot back: {found} of {total} of the question's words found"
        return None
    if total and found / total < min_grounding:
        return f"not grounded in the cited references: {found} of {total} answer words found"
    if asks_for_number(question) and (number := untied_number(own_words(answer, question), question, cited,
                                                               bare=False)):
        return f"not grounded in the cited references: {number} is not given there for what the question asks"
    return None


def _ask(prompt: str, options: dict[str, tuple[str, ...]], llm: LLMClient) -> dict[str, float]:
    return option_probabilities(llm.chat(prompt, max_tokens=2, logprobs=True, top_logprobs=10), options)


def _binary(variables: dict, params: Params, ctx: StepContext, llm: LLMClient) -> dict[str, float]:
    """Two yes/no questions; the verdict's probability is the answer to the deciding one."""
    support = _ask(ctx.prompt(**variables), YES_NO, llm)
    if not support:
        return {}
    p_support = support["yes"]
    if p_support >= params.support_threshold:
        return {"supported": p_support}
    contradict = _ask(ctx.prompt_for("fact_check_contradict", **variables), YES_NO, llm)
    p_contradict = contradict.get("yes", 0.0)
    return {"contradicted": p_contradict} if p_contradict >= 0.5 else {"not_enough_information": 1 - p_contradict}


def _refuse(answer: Answer, params: Params, reason: str) -> Answer:
    return answer.model_copy(update={"refused": True, "reason": reason, "draft": answer.text,
                                     "text": params.refusal})
