"""Extractive evidence answer: the sentence (or table row) of the inserted passages that answers the
question, cited, with its exact offsets, or a refusal that says why. No LLM.

The retrieved passages usually hold the answering sentence; a small model on a CPU often fails to
repeat it (issue 34). This stage picks it, as a search engine's featured snippet does, in well under
a second (the sentences of the inserted passages are embedded in one batch):

- each sentence (a Markdown table row: the row, read with its header) is scored by the embedder's
  cosine with the question, plus the share of the question's key terms it covers (weighted by the
  index's own BM25 statistics when a ``sparse`` index is bound: a rare word counts more), plus
  whether it holds a value of the type the question asks for (who: a name, when: a date, how many:
  a number, where: a place) that the question does not already hold, plus agreement (that value
  stated by another passage too);
- a number, date or version the question names must be in the references (in digits or, up to
  twelve, in words): when none mentions it, the answer is a refusal that names it ("no sentence in
  the references mentions 3.13"); the sentences that name it themselves are preferred, then those
  whose previous sentence does, then the rest of its passage. A name or word the whole index never
  uses (its BM25 statistics) is refused the same way ('SAML'); a typed question whose references
  hold no value of its type is refused too;
- the best sentence must clear ``min_score``; its default was placed without labels, from
  pseudo-questions made from passages alone (a sentence loses its value, keeps its rarest words and
  is asked with the matching wh-word; the score 95 % of them clear with their own sentence:
  ``bench/answer_quality.py --calibrate``), as the answerability gate's floor is. Only the 12
  sentences covering most key terms are embedded (one batch): the embedding is the cost.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import regex
from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import Context, ContextDocument, EvidenceAnswer, EvidenceSpan, Query, Source
from ragline.flows.resources.models.embedder import Embedder
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.flows.spec.registry import stage
from ragline.tasks.ingest.pseudo_queries import ABBREVIATION, SENTENCE

WORD = regex.compile(r"[\p{L}\p{N}][\p{L}\p{M}\p{N}]*(?:[.,:/'’-][\p{L}\p{N}]+)*")
HAS_DIGIT = re.compile(r"\d")
INITIAL = regex.compile(r"(?:^|[\s.])\p{Lu}\.$")  # 'Niels B.' ends no sentence
INSIDE_CAPITAL = regex.compile(r"(?<=[\p{Ll}\p{N},;:]\s+)\p{Lu}[\p{L}\p{M}'’.-]*")
TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
TABLE_RULE = re.compile(r"^\s*\|?[\s:|-]*-[\s:|-]*\|?\s*$")
HEADING = re.compile(r"^\s*#{1,6}\s")
LIST_ITEM = re.compile(r"^\s*(?:[-*+•]|\d{1,3}[.)])\s")
MONTHS = ("january february march april may june july august september october november december "
          "jan feb mar apr jun jul aug sep sept oct nov dec").split()
MONTH = r"(?:" + "|".join(sorted(MONTHS, key=len, reverse=True)) + r")\.?"
DATE = re.compile(rf"\b(?:{MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}|\d{{1,2}}(?:st|nd|rd|th)?\s+{MONTH},?\s+\d{{4}}|"
                  rf"{MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?|\d{{1,2}}(?:st|nd|rd|th)?\s+{MONTH}|{MONTH},?\s+\d{{4}}|\d{{4}}-\d{{2}}-\d{{2}}|"
                  rf"\d{{1,2}}/\d{{1,2}}/\d{{2,4}}|(?:1[0-9]|20)\d{{2}})\b", re.I)
AMOUNT = re.compile(r"(?<![\w.])(?:[$€£¥]\s?)?\d[\d,]*(?:\.\d+)?(?:\s?(?:%|percent|billion|million|thousand|bn|m|k)\b)?",
                    re.I)
CLOCK = re.compile(r"\b(?:[01]?\d|2[0-3])[:.][0-5]\d\b|\b\d{1,2}\s?(?:am|pm)\b", re.I)
NUMERAL_WORDS = ("one two three four five six seven eight nine ten eleven twelve fifteen twenty thirty forty fifty "
                 "sixty hundred thousand half dozen").split()
NUMBER_WORD = re.compile(r"\b(?:" + "|".join(NUMERAL_WORDS) + r")\b", re.I)
PERIOD = re.compile(r"\b(?:within|after|before|by|in|for|every)\s+(?:\d+|" + "|".join(NUMERAL_WORDS) +
                    r")(?:\s+working)?\s+(?:minutes?|hours?|days?|weeks?|months?|years?)\b", re.I)
# a run of capitalised words (particles and initials inside it): a name, a place, a title
NAME = regex.compile(r"\p{Lu}[\p{L}\p{M}'’.-]*(?:\s+(?:(?:de|da|del|van|von|der|di|la|le|of|the|and|&)\s+)?"
                     r"\p{Lu}[\p{L}\p{M}'’.-]*|\s+\d+\b)*")
FUNCTION = frozenset("""a an the of in on at to for from by with about into over under and or but if as is was were
are be been being do does did has have had will would can could should shall may might must it its this that these
those there here what which who whom whose when where why how i you he she we they me him her us them my your his our
their not no yes so than then also just only very more most much many some any all each every both either other""".split())
CALENDAR = frozenset(MONTHS) | frozenset("monday tuesday wednesday thursday friday saturday sunday spring summer "
                                         "autumn fall winter".split())
CAPITALISED_FUNCTION = frozenset(w.capitalize() for w in FUNCTION) | {
    "According", "After", "Before", "During", "Since", "Today", "Yesterday", "However", "While", "Although", "Though",
    "Because", "Unless", "Until", "Whereas", "Meanwhile", "Here", "Now", "Also", "Still", "Yet"}
# words a headline or a snippet capitalises that name a role, a kind of thing or a part of a page, not
# who or where: a value made only of them ('Chairman', 'Crew List', 'Four Finalists') is no name
DESCRIPTIVE = frozenset("""chairman chairwoman chair director directors president vice ceo cfo coo cto founder
co-founder owner winner winners champion champions finalist finalists semifinalist semifinalists nominee nominees
nomination nominations list lists crew cast council member members feature features film films movie movies musical
edition award awards prize prizes season seasons episode episodes release re-release anniversary cut update updates
trailer news results result rankings ranking standings official officials staff board committee executive chief
manager head leader captain coach player players star stars actor actress host review reviews guide watch view meet
see read find learn check join click download live full complete new latest top best official page home year month
week day championship championships tournament tournaments final finals game games match event ceremony show series
usd eur gbp am pm pst est gmt utc cet""".split())

# words a question is asked with rather than about: never a reason to refuse when the index lacks them
ASKING_WORDS = frozenset("""long quickly soon often happened happen happens held hold holds take takes took place
need needs used mean means work works called named kind type exactly usually typically allowed possible required
require requires give gives given says said tell told know find found list describe explain name happening done
make makes doing going become became version versions date year time number amount""".split())

ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
            "fourteenth fifteenth twentieth hundredth").split()
DETERMINERS = frozenset("the its his her their our your this that".split())
# qualifiers that pick one of several events, editions or groups: the answering passage must name them
# ('the women's final', 'the first season'), each by any of its forms. The men's event is left out: it is
# the one references often leave unmarked ('the ATP year-end No. 1', 'Wimbledon champion').
QUALIFIERS = {**{o: (o,) for o in ORDINALS},
              **{w: ("women", "woman", "women's", "female", "ladies", "ladies'", "girls", "girls'")
                 for w in ("women", "women's", "woman", "female", "ladies", "girls")}}
MONEY_QUESTION = re.compile(r"\b(?:revenue|revenues|price|cost|costs|salary|budget|worth|fee|fees|income|profit|"
                            r"earnings|sales|valuation|net worth)\b", re.I)
MONEY = re.compile(r"[$€£¥]|\b(?:usd|eur|gbp|chf|jpy|dollars?|euros?|pounds?|yen|billion|million|thousand|bn|trillion)\b",
                   re.I)
YEAR_ONLY = re.compile(r"(?:1[0-9]|20)\d{2}")
CALENDAR_DATE = re.compile(rf"\b(?:{MONTH}|\d{{4}}-\d{{2}}-\d{{2}}|\d{{1,2}}/\d{{1,2}}/\d{{2,4}})", re.I)
ASKS_YEAR = re.compile(r"\b(?:year|decade|century)\b", re.I)
ASKS_DAY = re.compile(r"\b(?:date|day)\b", re.I)
URL = re.compile(r"\bhttps?://[^\s<>\"')\]]+|\b(?:localhost|\d{1,3}(?:\.\d{1,3}){3}):\d+\b[^\s<>\"')\]]*")
PATH = re.compile(r"(?<![\w/])(?:~|\.{1,2})?/(?:[\w.-]+/)*[\w.-]+/?|\b[\w.-]+/(?:[\w.-]+/)+[\w.-]*")

QUESTION_TYPES = (  # (type, pattern on the lower-cased question): the first that matches
    ("number", r"\bhow (?:many|much|long|old|far|often)\b|\b(?:which|what) (?:\w+ )?version\b|"
               r"\b(?:what|which) (?:is the )?(?:number|amount|price|cost|percentage|percent|rate|size|limit|"
               r"maximum|minimum|revenue)\b|\brevenue\b"),
    ("date", r"^\s*when\b|\b(?:what|which) (?:year|date|day|month|time)\b|\b(?:release|premiere|launch|start|end|"
             r"due) date\b|\bdate of\b|\bdeadline\b|\bwhen (?:was|is|did|does|will)\b"),
    ("place", r"^\s*where\b|\b(?:which|what) (?:city|country|place|state|venue|stadium|location)\b|\blocation\b"),
    ("name", r"^\s*(?:who|whom|whose)\b|\bname of\b|\b(?:which|what) (?:person|company|team|player|actor|actress|director|"
             r"movie|film|country|club|firm|band|author)\b"),
)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_score: float = Field(0.54, ge=0, le=1, description="refuse when the best sentence scores below this "
                                                            "(placed without labels, from pseudo-queries)")
    max_sentences: int = Field(1, ge=1, le=5, description="sentences in the answer: the best, then those of "
                                                          "other passages that state the same value")
    similarity_weight: float = Field(0.5, ge=0, le=1, description="weight of the embedder's cosine")
    coverage_weight: float = Field(0.3, ge=0, le=1, description="weight of the question's key terms covered")
    type_weight: float = Field(0.1, ge=0, le=1, description="weight of holding a value of the asked type")
    agreement_weight: float = Field(0.1, ge=0, le=1, description="weight of another passage stating that value")
    max_sentence_chars: int = Field(600, ge=50, description="longer sentences are left out as answers")
    max_candidates: int = Field(12, ge=1, le=500, description="sentences embedded per question: those covering "
                                                                "most of its key terms (the embedding is the cost)")
    min_words: int = Field(5, ge=1, le=50, description="shorter sentences (a heading, a caption) are left out as "
                                                       "answers; a table row is always a candidate")


@dataclass
class Unit:
    """A candidate sentence or table row of one inserted passage, by its offsets in the passage."""

    document: ContextDocument
    start: int
    end: int
    scored: str  # what is embedded and matched: the sentence, or the row with its table's header
    before: str = ""  # the sentence before it in its passage (its subject is often named there)
    title: str = ""  # the heading it stands under, or the passage's title line ('Watching runs')
    header: str = ""  # a table row's header row
    value: tuple[int, int] | None = None  # the answering value, offsets in the passage text
    heading: bool = False
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.document.passage.text[self.start:self.end]

    @property
    def score(self) -> float:
        return self.parts.get("score", 0.0)


@stage("extract_answer", params=Params, produces="evidence", kind="query",
       uses={"embedder": ("sentence_transformer",), "sparse": ("bm25", "milvus")})
def extract_answer(query: Query, context: Context, params: Params, ctx: StepContext, embedder: Embedder,
                   sparse: SparseIndex | None = None) -> EvidenceAnswer:
    """The sentence of the references that answers the question, cited; or a refusal with its reason."""
    started = time.perf_counter()
    answer = evidence_answer(query.original or query.text, context, params, embedder, sparse)
    return answer.model_copy(update={"seconds": round(time.perf_counter() - started, 4)})


def evidence_answer(question: str, context: Context, params: Params, embedder: Embedder,
                    sparse: SparseIndex | None = None) -> EvidenceAnswer:
    """The extractive answer to ``question`` from the context's passages (see the module doc)."""
    if not context.documents:
        return refusal(context.withheld or "no relevant documents were found", [])
    keys = key_terms(question)
    if missing := unmentioned(question, keys, context, sparse):
        return refusal(f"no sentence in the references mentions {', '.join(missing)}", keys)
    units = [u for d in context.documents for u in split_units(d)
             if len(u.scored) <= params.max_sentence_chars and not u.scored.rstrip().endswith("?")  # asks, not answers
             and (len(words(u.scored)) >= params.min_words or TABLE_ROW.match(u.text))]
    kind = question_type(question)
    references = "\n".join(d.passage.text for d in context.documents)  # what counts as an ordinary word
    typed = [u for u in units if set_value(u, kind, question, references) or not kind]  # a row: its asked cell
    constraints = [k for k in keys if HAS_DIGIT.search(k)] + qualifiers(question)
    if not (named := naming(typed, constraints, question)):
        return refusal(f"no sentence in the references gives {TYPE_WORDS[kind]} for the question" if kind and not typed
                       else "no sentence of the references speaks to the question" if not typed
                       else f"no sentence in the references gives {TYPE_WORDS.get(kind, 'an answer')} together with "
                            f"{', '.join(constraints)}", keys)
    others = {id(u): elsewhere(u.scored, question) if kind in ("date", "name", "place") else None for u in named}
    if not (typed := [u for u in named if not others[id(u)]]):
        return refusal(f"the references speak of {', '.join(dict.fromkeys(o for o in others.values() if o))}, not of "
                       f"what the question names", keys)
    typed = score_units(question, typed, kind, params, embedder, sparse)
    best = max(typed, key=lambda u: u.score)
    if best.score < params.min_score:
        return refusal(f"no sentence in the references answers it closely enough (best {best.score:.2f} < "
                       f"{params.min_score:.2f}: \"{clipped(best.text)}\" [{best.document.number}])", keys,
                       confidence=best.score)
    return answered(best, typed, keys, params)


def elsewhere(text: str, question: str) -> str | None:
    """The other edition a sentence speaks of where it names the question's subject only with a number
    the question does not hold: 'Zelda BotW 2', 'Season 5', 'Wimbledon 2019' for a question on 'Zelda',
    'season 4', 'Wimbledon in 2021'. A name of the question is a capitalised word of it or a word before
    its number ('season 4'); the sentence names it, at each of its mentions, followed by such a number.
    None: the sentence speaks of what the question names (or does not name it)."""
    tokens = words(question)
    numbers = {t for t in tokens if HAS_DIGIT.search(t)}
    subject = {t for i, t in enumerate(tokens) if not HAS_DIGIT.search(t) and t.lower() not in FUNCTION and (
        i > 0 and t[:1].isupper() or i + 1 < len(tokens) and HAS_DIGIT.search(tokens[i + 1]))}
    for name in subject:
        mentions_of = [m for m in regex.finditer(rf"(?<![\p{{L}}\p{{N}}]){regex.escape(name)}(?:['’]s)?(?![\p{{L}}\p{{N}}])",
                                                text, regex.I)]
        extended = []
        for m in mentions_of:
            after = regex.match(r"[™®]?[ \t]+([\p{L}\p{N}][\p{L}\p{M}\p{N}]*(?:[.'’-][\p{L}\p{N}]+)*)", text[m.end():])
            word = after.group(1) if after else ""
            if word and HAS_DIGIT.search(word) and word not in numbers and not CLOCK.fullmatch(word):
                extended.append(text[m.start():m.end() + after.end()])
            else:
                break
        else:
            if extended:
                return extended[0]
    return None


def numbered_names(question: str) -> dict[str, list[str]]:
    """The question's whole numbers that belong to a name, with that name's word: {'6': ['Pixel']}."""
    found: dict[str, list[str]] = {}
    for match in regex.finditer(r"(?<![\p{L}\p{N}])(\p{Lu}[\p{L}\p{M}]+)[™®]?\s+(\d{1,3})(?![\p{L}\p{N}.,])", question):
        if match.group(1) not in CAPITALISED_FUNCTION:
            found.setdefault(match.group(2), []).append(match.group(1))
    return found


def unmentioned(question: str, keys: list[str], context: Context, sparse: SparseIndex | None) -> list[str]:
    """The question's key terms no reference holds: a number, date or version (in digits or, up to
    twelve, in words: 'season 4' is the 'fourth season'), and, by the index's own statistics, a name
    or word no passage of the index uses at all. Such a question asks about something the references
    do not speak of ('Plover 3.13', 'SAML'). A name the index knows but these references lack is
    not refused here: the references may call it otherwise ('the third quarter' for 'Q3')."""
    texts = [d.passage.text for d in context.documents]
    constraints = [k for k in keys if HAS_DIGIT.search(k)] + qualifiers(question)
    missing = [k for k in constraints if not any(names(t, k) for t in texts)]
    return missing + [k for k in unknown_words(keys, sparse) if k not in missing]


def qualifiers(question: str) -> list[str]:
    """The question's words that pick one of several editions, events or groups: an ordinal after a
    determiner ('the first season': not 'first released') and a gender ('women's singles'), as written."""
    tokens = words(question)
    found = [t for i, t in enumerate(tokens) if t.lower() in QUALIFIERS and (
        t.lower() not in ORDINALS or i > 0 and (tokens[i - 1].lower() in DETERMINERS or tokens[i - 1].endswith("'s")))]
    return list(dict.fromkeys(found))


SPELLED = {str(n): (cardinal, ordinal) for n, (cardinal, ordinal) in enumerate(zip(
    "zero one two three four five six seven eight nine ten eleven twelve".split(),
    "zeroth first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth".split()))}


def spelled(text: str, number: str) -> bool:
    """Whether ``text`` writes a small number in words ('four', 'fourth'), or a quarter ('Q3') as
    'third quarter'."""
    if quarter := re.fullmatch(r"[qQ]([1-4])", number):
        return re.search(rf"\b{SPELLED[quarter.group(1)][1]}[ -]quarter\b", text, re.I) is not None
    return number in SPELLED and any(re.search(rf"\b{w}\b", text, re.I) for w in SPELLED[number])


def names(text: str, term: str) -> bool:
    """Whether ``text`` names a number (in digits or words) or a qualifier (in any of its forms)."""
    if forms := QUALIFIERS.get(term.lower()):
        return any(mentions(text, form) for form in forms)
    return mentions(text, term) or spelled(text, term)


def unknown_words(keys: list[str], sparse: SparseIndex | None) -> list[str]:
    """Key words (names too) the index holds in no passage at all (none without BM25 statistics); the
    words a question is asked with ('how long', 'what happened', 'where is it held') never count."""
    candidates = [k for k in keys if len(k) > 3 and not HAS_DIGIT.search(k) and k.lower() not in ASKING_WORDS]
    if sparse is None or not candidates:
        return []
    try:
        terms = sparse.terms(candidates)
        frequencies, total = sparse.document_frequencies({t for ts in terms for t in ts})
    except Exception:  # noqa: BLE001 - the statistics are only a shortcut to a refusal
        return []
    return [k for k, ts in zip(candidates, terms) if total and ts and all(frequencies.get(t, 0) == 0 for t in ts)]


def naming(units: list[Unit], numbers: list[str], question: str = "") -> list[Unit]:
    """The units that name every number and qualifier of the question: in the sentence itself where
    some do, else with the sentence before it ('It was released on ...') or its title; not elsewhere in
    the passage (a snippet on the 2019 final mentions 2021 in passing). The number of a name ('Pixel
    6', 'Chronicles 2') may be named by that name alone ('the Pixel Fall Launch event'), once some reference names the number: a passage on the other
    edition names its own number, and ``elsewhere`` leaves its sentences out."""
    if not numbers:
        return units
    alternatives = {n: [n, *numbered_names(question).get(n, [])] for n in numbers}
    for where in (lambda u: u.scored, lambda u: u.scored + " " + u.before + " " + u.title):
        found = [u for u in units if all(any(names(where(u), a) for a in alternatives[n]) for n in numbers)]
        if found:
            return found
    return []


TYPE_WORDS = {"number": "a number", "date": "a date", "place": "a place", "name": "a name"}


def refusal(reason: str, keys: list[str], confidence: float = 0.0) -> EvidenceAnswer:
    return EvidenceAnswer(refused=True, reason=reason, key_terms=keys, confidence=round(min(max(confidence, 0), 1), 4))


def clipped(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ----------------------------------------------------------------------------- candidates
def split_units(document: ContextDocument) -> list[Unit]:
    """The passage's sentences and table rows, each by its exact offsets. A paragraph's lines are read
    together (hard-wrapped text); a list item starts a new one; headings and table rules are left out
    (they answer nothing); each sentence keeps the one before it."""
    text, units, header, previous = document.passage.text, [], "", ""
    block: tuple[int, int] | None = None  # the paragraph being read: (start, end) in the passage

    def flush() -> None:
        nonlocal block, previous
        if block is not None:
            for start, end in labelled(text[block[0]:block[1]], sentence_spans(text[block[0]:block[1]])):
                units.append(Unit(document, block[0] + start, block[0] + end,
                                  scored=" ".join(text[block[0] + start:block[0] + end].split()), before=previous))
                previous = units[-1].scored
        block = None

    position = 0
    for line in text.split("\n"):
        line_start, position = position, position + len(line) + 1
        if TABLE_ROW.match(line):
            flush()
            if TABLE_RULE.match(line):
                continue
            if not header:
                header = line
                continue
            start, end = stripped(text, line_start, line_start + len(line))
            units.append(Unit(document, start, end, scored=row_text(header, line), before=previous, header=header))
            continue
        header = ""
        if not line.strip() or HEADING.match(line) or LIST_ITEM.match(line):
            flush()
            if HEADING.match(line):  # a heading is a unit of its own ('Quillstack 5.2 (released 14 March 2025)')
                start, end = stripped(text, line_start + len(HEADING.match(line).group()), line_start + len(line))
                units.append(Unit(document, start, end, scored=text[start:end], before=previous, heading=True))
                previous = text[start:end]
            if not line.strip() or HEADING.match(line):
                continue
        block = (block[0] if block else line_start, line_start + len(line))
    flush()
    return titled(units)


def titled(units: list[Unit]) -> list[Unit]:
    """Each unit with the heading above it: a Markdown heading, or a first line that reads as a title
    (a few words, no sentence's end: 'Watching runs')."""
    title = ""
    for i, unit in enumerate(units):
        if unit.heading or i == 0 and len(words(unit.scored)) <= 8 and not unit.scored.rstrip().endswith((".", "!", "?")) \
                and not TABLE_ROW.match(unit.text):
            title = unit.scored
            continue
        unit.title = title
    return units


LABEL_WORDS = 3


def labelled(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sentences with a label of a few words before them joined to it: 'Release date. December 1, 2017'
    (a field of a search snippet or a data sheet). A date alone before a sentence is not joined: that is
    the date of the page ('Oct 19, 2021 ... Google announced ...'), not of what the sentence tells."""
    joined: list[tuple[int, int]] = []
    pending: int | None = None
    for start, end in spans:
        if pending is not None:
            start, pending = pending, None
        if len(words(text[start:end])) <= LABEL_WORDS and not HAS_DIGIT.search(text[start:end]):
            pending = start
            continue
        joined.append((start, end))
    if pending is not None:
        joined.append((pending, spans[-1][1]))
    return joined


def stripped(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def sentence_spans(line: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of one line, split as the pseudo-queries split them (not after
    e.g., et al. and the like), nor after a name's initial ('CEO Niels B. Christiansen')."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for gap in [*SENTENCE.finditer(line), None]:
        end = gap.start() if gap is not None else len(line)
        start, stop = stripped(line, cursor, end)
        if stop > start:
            if spans and (ABBREVIATION.search(line[spans[-1][0]:spans[-1][1]])
                          or INITIAL.search(line[spans[-1][0]:spans[-1][1]])):
                spans[-1] = (spans[-1][0], stop)
            else:
                spans.append((start, stop))
        cursor = gap.end() if gap is not None else len(line)
    return spans


def cell_spans(row: str) -> list[tuple[int, int]]:
    """(start, end) of each cell's text inside a Markdown table row, trimmed of spaces."""
    bars = [i for i, c in enumerate(row) if c == "|"]
    return [stripped(row, a + 1, b) for a, b in zip(bars, bars[1:])]


def column_cell(unit: Unit, asked: set[str]) -> tuple[int, int] | None:
    """The cell (offsets in the row) under the header that shares most words with the question, its
    value not one the question already holds; None where no header is named."""
    names, spans = cells(unit.header), cell_spans(unit.text)
    best, chosen = 0, None
    for name, (start, end) in zip(names, spans):
        named = {w for w in stem_words(name) if w not in FUNCTION} & asked
        value = unit.text[start:end]
        if len(named) > best and value and not set(stem_words(value)) <= asked:
            best, chosen = len(named), (start, end)
    return chosen


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def row_text(header: str, row: str) -> str:
    """A table row as a reader takes it: 'Plan: Basic; Days: 20'."""
    names, values = cells(header), cells(row)
    return "; ".join(f"{n}: {v}" if n else v for n, v in zip(names + [""] * len(values), values) if v)


# ----------------------------------------------------------------------------- the question
def words(text: str) -> list[str]:
    return WORD.findall(text)


def key_terms(question: str) -> list[str]:
    """The question's terms an answer must speak to, as written: its numbers, dates and versions
    (any token with a digit) and its other content words, names first."""
    seen: dict[str, None] = {}
    tokens = words(question)
    for i, token in enumerate(tokens):
        token = re.sub(r"['’]s$", "", token.rstrip(".,:"))  # "Tesla's" is about Tesla
        if HAS_DIGIT.search(token) or token.lower() not in FUNCTION and len(token) > 1:
            seen.setdefault(token, None)
    return sorted(seen, key=lambda t: (not HAS_DIGIT.search(t), not t[:1].isupper()))


def question_type(question: str) -> str | None:
    """number, date, place or name: the kind of value the answer must hold (English questions);
    None: any sentence may answer."""
    lowered = question.lower()
    return next((kind for kind, pattern in QUESTION_TYPES if re.search(pattern, lowered)), None)


def mentions(text: str, term: str) -> bool:
    """Whether ``text`` holds ``term`` as a whole token (case-insensitive): '3.13' is not in '3.130'."""
    return re.search(rf"(?<!\w)(?<!\d[.,]){re.escape(term)}(?!\w|[.,]\d)", text, re.I) is not None


# ----------------------------------------------------------------------------- values of the asked type
def set_value(unit: Unit, kind: str | None, question: str, references: str = "") -> bool:
    """Find the first value of ``kind`` in the unit's own text that says something the question does
    not (a name is trimmed of the question's own words at its edges) and fits what the question asks
    (see ``fits``); record it (passage offsets) and say whether there was one. A table row answers
    with the cell of the column the question names ('vans' -> the Vans column), where it names one."""
    asked = asked_words(question)
    if unit.header and (cell := column_cell(unit, asked)) is not None:
        value = unit.text[cell[0]:cell[1]]
        if kind is None or kind == "name" or (kind == "number" and HAS_DIGIT.search(value)) \
                or value_spans(value, kind):
            unit.value = (unit.start + cell[0], unit.start + cell[1])
            return True
    if kind is None:
        return False
    for start, end in value_spans(unit.text, kind, references or unit.document.passage.text):
        if kind in ("name", "place"):
            start, end = trimmed(unit.text, start, end, asked)
        value_words = [w for w in words(unit.text[start:end]) if w.lower() not in FUNCTION or acronym(w)]
        if not value_words:
            continue
        new = [w for w, s in zip(value_words, stem_words(" ".join(value_words)))
               if s not in asked and plain(w) not in asked]
        if kind in ("name", "place") and (len(new) < len(value_words) or initials(value_words) in asked
                                          or all(descriptive(w) for w in value_words)
                                          or len("".join(value_words)) < 2):
            continue  # 'NFL Commissioners', 'United States' for 'US', 'Crew List': what was asked, or no name
        if new and fits(unit.text[start:end], kind, question):
            unit.value = (unit.start + start, unit.start + end)
            return True
    return False


def asked_words(question: str) -> set[str]:
    """The question's words as the value test compares them: stems, lower-cased words, and words
    without their dots ('U.S.' is 'us')."""
    return set(stem_words(question)) | {w.lower() for w in words(question)} | {plain(w) for w in words(question)}


def plain(word: str) -> str:
    return word.replace(".", "").lower()


def initials(value_words: list[str]) -> str:
    """'United States' -> 'us': a name the question wrote as its initials."""
    capitals = [w for w in value_words if w[:1].isupper()]
    return "".join(w[0] for w in capitals).lower() if len(capitals) > 1 else ""


def descriptive(word: str) -> bool:
    """A word that says what someone or something is, not who or where: a role, a kind, a number word
    ('Chairman', 'Finalists', 'Four')."""
    return word.lower() in DESCRIPTIVE or word.lower() in NUMERAL_WORDS or word.isdigit() or \
        stem_words(word)[:1] in ([s] for s in descriptive_stems())


@lru_cache(maxsize=1)
def descriptive_stems() -> frozenset[str]:
    return frozenset(stemmer().stemWords(sorted(DESCRIPTIVE)))


def fits(value: str, kind: str, question: str) -> bool:
    """Whether a value of ``kind`` answers what this question asks: an amount of money where it asks a
    revenue, price or cost; a date finer than a year where it asks when (a year only where it asks the
    year) and a calendar date where it asks the date or day (not a time of day or a period)."""
    if kind == "number" and MONEY_QUESTION.search(question):
        return MONEY.search(value) is not None
    if kind == "date":
        if YEAR_ONLY.fullmatch(value.strip()):
            return ASKS_YEAR.search(question) is not None
        if ASKS_DAY.search(question):
            return CALENDAR_DATE.search(value) is not None
    return True


def trimmed(text: str, start: int, end: int, asked: set[str]) -> tuple[int, int]:
    """A name's span without the question's words (and function words) at either edge: 'CEO Niels
    B. Christiansen' -> 'Niels B. Christiansen'."""
    tokens = [(m.start() + start, m.end() + start) for m in WORD.finditer(text[start:end])]
    def known(span: tuple[int, int]) -> bool:
        word = text[span[0]:span[1]]
        return word.lower() in asked or word.lower() in FUNCTION and not acronym(word) or stem_words(word)[:1] == [] or \
            stem_words(word)[0] in asked or plain(word) in asked
    while tokens and known(tokens[0]):
        tokens.pop(0)
    while tokens and known(tokens[-1]):
        tokens.pop()
    return (tokens[0][0], tokens[-1][1]) if tokens else (start, start)


def value_spans(text: str, kind: str, passage: str = "") -> list[tuple[int, int]]:
    """Where values of ``kind`` stand in ``text``: a date (or a time of day, or a period: 'within 30
    days'), a number (digits or a number word), a place (a name, or a web address or a path: where
    software is reached), else a name."""
    if kind == "date":
        return sorted([m.span() for m in DATE.finditer(text)] + [m.span() for m in CLOCK.finditer(text)]
                      + [m.span() for m in PERIOD.finditer(text)])
    if kind == "number":
        dates = [m.span() for m in DATE.finditer(text) if not re.fullmatch(r"\d{4}", m.group())]
        return sorted([m.span() for m in AMOUNT.finditer(text) if HAS_DIGIT.search(m.group())
                       and not any(a <= m.start() < b for a, b in dates)]  # the 9 of '9 December 2024' counts nothing
                      + [m.span() for m in NUMBER_WORD.finditer(text)])
    if kind == "place":
        addresses = [m.span() for m in URL.finditer(text)]
        addresses += [m.span() for m in PATH.finditer(text) if not any(a <= m.start() < b for a, b in addresses)]
        return sorted(name_spans(text, passage) + addresses)
    return name_spans(text, passage)


def name_spans(text: str, passage: str = "") -> list[tuple[int, int]]:
    """Capitalised runs, trimmed of the words at their edges that are not names: a capitalised
    function word ('The', 'In'), a weekday, month or season, an ordinary word the passage also writes
    in lower case ('Critical incidents' where 'critical' occurs, 'Meet the new CEO', 'Films based on
    ...'); a run with nothing left, one letter or no capital letter ('December 31' less the month), a
    lone word that only a sentence's start capitalises ('View maps ...', where the references never
    write 'View' inside a sentence) and a dateline ('COPENHAGEN, Denmark —') are no names."""
    lowered = {w for w in words(passage) if w.islower()}
    inside = capitalised_inside(passage)
    spans = []
    for match in NAME.finditer(text):
        tokens = [(m.start() + match.start(), m.end() + match.start()) for m in WORD.finditer(match.group())]
        ends = [i for i, (a, b) in enumerate(tokens[:-1]) if text[b:b + 1] == "." and b - a > 3]
        tokens = tokens[:ends[0] + 1] if ends else tokens  # 'Forbes. Retrieved': a word and its full stop end it
        ordinary = lambda span: not acronym(text[span[0]:span[1]]) and (  # noqa: E731
            text[span[0]:span[1]] in CAPITALISED_FUNCTION or text[span[0]:span[1]].lower() in lowered
            or text[span[0]:span[1]].lower() in CALENDAR)
        while tokens and ordinary(tokens[0]):
            tokens.pop(0)
        while tokens and ordinary(tokens[-1]):
            tokens.pop()
        if not tokens or tokens[-1][1] - tokens[0][0] <= 1 or not any(text[a].isupper() for a, _ in tokens):
            continue
        first = text[tokens[0][0]:tokens[0][1]]
        at_start = not text[:tokens[0][0]].strip(" \t\"'“‘([*#-")
        if at_start and len(tokens) == 1 and first not in inside and not acronym(first) \
                and not re.match(r"\s*(?:,|['’]s\b|\()", text[tokens[0][1]:]):  # 'Musk, the founder': a name
            continue
        if at_start and acronym(first) and len(first) > 3 and text[tokens[0][1]:tokens[0][1] + 1] == ",":
            continue  # a dateline
        spans.append((tokens[0][0], tokens[-1][1]))
    return spans


@lru_cache(maxsize=256)
def capitalised_inside(passage: str) -> frozenset[str]:
    """Words the passage capitalises inside a sentence (after a lower-case word or a comma): names."""
    return frozenset(m.group().rstrip(".'’-") for m in INSIDE_CAPITAL.finditer(passage))


def acronym(word: str) -> bool:
    """'IT', 'NFL': a name even where the same letters are a word in lower case ('it')."""
    return len(word) > 1 and word.isupper()


def value_key(text: str) -> str:
    return " ".join(w.lower() for w in words(text))


# ----------------------------------------------------------------------------- scoring
def score_units(question: str, units: list[Unit], kind: str | None, params: Params, embedder: Embedder,
                sparse: SparseIndex | None) -> list[Unit]:
    """The units worth embedding (the ``max_candidates`` that cover most of the question's key terms),
    each scored: cosine, key-term coverage, asked type, agreement across passages."""
    weights = term_weights(question, [u.scored for u in units], sparse)
    values = [value_key(u.document.passage.text[slice(*u.value)]) if u.value else "" for u in units]
    for unit, value in zip(units, values):
        stated_by = {v.document.number for v, other in zip(units, values) if other and other == value}
        unit.parts = {"coverage": coverage(unit, weights), "type": 1.0 if unit.value or not kind else 0.0,
                      "agreement": min(1.0, (len(stated_by) - 1) / 2) if value else 0.0}
    order = sorted(range(len(units)), key=lambda i: -(units[i].parts["coverage"] + units[i].parts["agreement"]))
    kept = [units[i] for i in sorted(order[:params.max_candidates])]
    vectors = embedder.encode_passages([u.scored for u in kept])  # one batch
    asked = embedder.encode_queries([question])[0]
    cosines = vectors @ asked / np.maximum(np.linalg.norm(vectors, axis=1) * np.linalg.norm(asked), 1e-12)
    for unit, cosine in zip(kept, cosines):
        parts = unit.parts
        parts["similarity"] = float(cosine)
        parts["score"] = (params.similarity_weight * parts["similarity"] + params.coverage_weight * parts["coverage"]
                          + params.type_weight * parts["type"] + params.agreement_weight * parts["agreement"])
    return kept


@lru_cache(maxsize=1)
def stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


@lru_cache(maxsize=4096)
def _stems(text: str) -> tuple[str, ...]:
    return tuple(stemmer().stemWords([w.lower() for w in words(text)]))


def stem_words(text: str) -> list[str]:
    """English Snowball stems of the text's words (cached: a passage's sentences are stemmed once)."""
    return list(_stems(text))


@lru_cache(maxsize=1)
def function_words() -> frozenset[str]:
    """Function words of the languages bm25s lists (English's own list above): 'wie', 'ist', 'le'."""
    import bm25s.stopwords as lists

    return FUNCTION | frozenset(w for name in dir(lists) if name.startswith("STOPWORDS_")
                                for w in getattr(lists, name) if isinstance(w, str))


def term_weights(question: str, texts: list[str], sparse: SparseIndex | None) -> dict[str, float]:
    """The question's content stems (function words of any listed language left out), each weighted by
    its IDF: from the index's own statistics when one is bound, else from the candidate sentences (a
    word every sentence holds weighs little)."""
    terms = list(dict.fromkeys(s for w, s in zip(words(question), stem_words(question))
                               if w.lower() not in function_words() and len(w) > 1))
    numbers = [w.lower() for w in words(question) if HAS_DIGIT.search(w)]
    if not terms:
        return {}
    frequencies, total = ({}, 0)
    if sparse is not None:
        try:
            frequencies, total = sparse.document_frequencies(terms)
        except Exception:  # noqa: BLE001 - the statistics only weigh terms: fall back to the sentences
            frequencies, total = {}, 0
    if not total:
        held = [set(stem_words(t)) for t in texts]
        frequencies, total = {t: sum(t in h for h in held) for t in terms}, len(held)
    weights = {t: math.log(1 + (total - frequencies.get(t, 0) + 0.5) / (frequencies.get(t, 0) + 0.5)) for t in terms}
    rarest = max(weights.values())
    return {t: rarest if t in numbers else w for t, w in weights.items()}  # a number the question names counts most


def coverage(unit: Unit, weights: dict[str, float]) -> float:
    """The IDF-weighted share of the question's content stems in the unit (or the sentence before it,
    or its title)."""
    if not weights:
        return 0.0
    held = set(stem_words(unit.scored)) | set(stem_words(unit.before)) | set(stem_words(unit.title))
    total = sum(weights.values())
    return sum(w for t, w in weights.items() if t in held) / total if total else 0.0


# ----------------------------------------------------------------------------- the answer
def answered(best: Unit, units: list[Unit], keys: list[str], params: Params) -> EvidenceAnswer:
    """The best unit, then (up to ``max_sentences``) other passages' units stating the same value."""
    chosen = [best]
    value = value_key(best.document.passage.text[slice(*best.value)]) if best.value else ""
    for unit in sorted(units, key=lambda u: -u.score):
        if len(chosen) >= params.max_sentences:
            break
        if unit is not best and value and unit.value and unit.document.number != best.document.number \
                and value_key(unit.document.passage.text[slice(*unit.value)]) == value:
            chosen.append(unit)
    spans = [span_of(u) for u in chosen]
    numbers = list(dict.fromkeys(u.document.number for u in chosen))
    sources = [Source.of(n, next(u.document.passage for u in chosen if u.document.number == n)) for n in numbers]
    text = " ".join(f"{shown(u)} [{u.document.number}]" for u in chosen)
    return EvidenceAnswer(text=text, confidence=round(min(max(best.score, 0.0), 1.0), 4),
                          value=best.document.passage.text[slice(*best.value)] if best.value else "",
                          citations=numbers, spans=spans, sources=sources, key_terms=keys)


def shown(unit: Unit) -> str:
    """A sentence as it is; a table row as 'Header: cell; ...'."""
    return unit.scored if TABLE_ROW.match(unit.text) else " ".join(unit.text.split())


def span_of(unit: Unit) -> EvidenceSpan:
    value_start, value_end = unit.value if unit.value else (None, None)
    return EvidenceSpan(number=unit.document.number, chunk_id=unit.document.passage.chunk_id,
                        source_id=unit.document.passage.source_id, start=unit.start, end=unit.end, text=unit.text,
                        value_start=value_start, value_end=value_end, score=round(unit.score, 4))
