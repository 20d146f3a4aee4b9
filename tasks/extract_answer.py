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
- a number, date or version the question names must be in the sentence (or the one before it):
  when no sentence of the references mentions it, the answer is a refusal that names it
  ("no sentence in the references mentions 3.13"); a typed question whose references hold no value
  of its type is refused the same way;
- the best sentence must clear ``min_score``; its default was placed without labels, from
  pseudo-queries (a sentence's rare words asked against passages with and without that sentence,
  ``bench/answer_quality.py --calibrate``), as the answerability gate's floor is.
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
from ragline.flows.resources.bm25 import BM25Index
from ragline.flows.resources.embedder import Embedder
from ragline.flows.spec.registry import stage
from ragline.tasks.pseudo_queries import ABBREVIATION, SENTENCE

WORD = regex.compile(r"[\p{L}\p{N}][\p{L}\p{M}\p{N}]*(?:[.,:/'’-][\p{L}\p{N}]+)*")
HAS_DIGIT = re.compile(r"\d")
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
CAPITALISED_FUNCTION = frozenset(w.capitalize() for w in FUNCTION) | {"According", "After", "Before", "During",
                                                                      "Since", "Today", "Yesterday", "However"}

# words a question is asked with rather than about: never a reason to refuse when the index lacks them
ASKING_WORDS = frozenset("""long quickly soon often happened happen happens held hold holds take takes took place
need needs used mean means work works called named kind type exactly usually typically allowed possible required
require requires give gives given says said tell told know find found list describe explain name happening done
make makes doing going become became version versions date year time number amount""".split())

QUESTION_TYPES = (  # (type, pattern on the lower-cased question): the first that matches
    ("number", r"\bhow (?:many|much|long|old|far|often)\b|\b(?:which|what) (?:\w+ )?version\b|"
               r"\b(?:what|which) (?:is the )?(?:number|amount|price|cost|percentage|percent|rate|size|limit|"
               r"maximum|minimum|revenue)\b|\brevenue\b"),
    ("date", r"^\s*when\b|\b(?:what|which) (?:year|date|day|month|time)\b|\b(?:release|premiere|launch|start|end|"
             r"due) date\b|\bdate of\b|\bdeadline\b|\bwhen (?:was|is|did|does|will)\b"),
    ("place", r"^\s*where\b|\b(?:which|what) (?:city|country|place|state|venue|stadium|location)\b|\blocation\b"),
    ("name", r"^\s*(?:who|whom|whose)\b|\b(?:which|what) (?:person|company|team|player|actor|actress|director|"
             r"movie|film|country|club|firm|band|author)\b"),
)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_score: float = Field(0.45, ge=0, le=1, description="refuse when the best sentence scores below this "
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
    value: tuple[int, int] | None = None  # the answering value, offsets in the passage text
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
                   sparse: BM25Index | None = None) -> EvidenceAnswer:
    """The sentence of the references that answers the question, cited; or a refusal with its reason."""
    started = time.perf_counter()
    answer = evidence_answer(query.original or query.text, context, params, embedder, sparse)
    return answer.model_copy(update={"seconds": round(time.perf_counter() - started, 4)})


def evidence_answer(question: str, context: Context, params: Params, embedder: Embedder,
                    sparse: BM25Index | None = None) -> EvidenceAnswer:
    """The extractive answer to ``question`` from the context's passages (see the module doc)."""
    if not context.documents:
        return refusal(context.withheld or "no relevant documents were found", [])
    keys = key_terms(question)
    if missing := unmentioned(question, keys, context, sparse):
        return refusal(f"no sentence in the references mentions {', '.join(missing)}", keys)
    units = [u for d in context.documents for u in split_units(d)
             if len(u.scored) <= params.max_sentence_chars
             and (len(words(u.scored)) >= params.min_words or TABLE_ROW.match(u.text))]
    kind = question_type(question)
    typed = [u for u in units if set_value(u, kind, question)] if kind else units
    typed = naming(typed, [k for k in keys if HAS_DIGIT.search(k)])
    if not typed:
        return refusal(f"no sentence in the references gives {TYPE_WORDS[kind]} for the question" if kind and units
                       else "no sentence of the references speaks to the question", keys)
    typed = score_units(question, typed, kind, params, embedder, sparse)
    best = max(typed, key=lambda u: u.score)
    if best.score < params.min_score:
        return refusal(f"no sentence in the references answers it closely enough (best {best.score:.2f} < "
                       f"{params.min_score:.2f}: \"{clipped(best.text)}\" [{best.document.number}])", keys,
                       confidence=best.score)
    return answered(best, typed, keys, params)


def unmentioned(question: str, keys: list[str], context: Context, sparse: BM25Index | None) -> list[str]:
    """The question's key terms no reference holds: a number, date or version, a name (a capitalised
    word past the first), or a word the whole index never uses (by its own statistics). Such a
    question asks about something the references do not speak of ('Plover 3.13', 'SAML')."""
    texts = [d.passage.text for d in context.documents]
    held = {s for t in texts for s in stem_words(t)}
    first = (words(question) or [""])[0]
    names = [k for k in keys if HAS_DIGIT.search(k) or (k[:1].isupper() and k != first)]
    missing = [k for k in names if not any(mentions(t, k) for t in texts)
               and not (not HAS_DIGIT.search(k) and stem_words(k) and stem_words(k)[0] in held)]
    return missing + [k for k in unknown_words(keys, sparse) if k not in missing]


def unknown_words(keys: list[str], sparse: BM25Index | None) -> list[str]:
    """Lower-case key words the index holds in no passage at all (none without BM25 statistics); the
    words a question is asked with ('how long', 'what happened', 'where is it held') never count."""
    candidates = [k for k in keys if k.islower() and len(k) > 3 and not HAS_DIGIT.search(k)
                  and k not in ASKING_WORDS]
    if sparse is None or not candidates:
        return []
    try:
        terms = sparse.terms(candidates)
        frequencies, total = sparse.document_frequencies({t for ts in terms for t in ts})
    except Exception:  # noqa: BLE001 - the statistics are only a shortcut to a refusal
        return []
    return [k for k, ts in zip(candidates, terms) if total and ts and all(frequencies.get(t, 0) == 0 for t in ts)]


def naming(units: list[Unit], numbers: list[str]) -> list[Unit]:
    """The units that name every number of the question: in the sentence itself where some do, else
    with the sentence before it ('It was released on ...'), else anywhere in the passage."""
    if not numbers:
        return units
    for where in (lambda u: u.scored, lambda u: u.scored + " " + u.before, lambda u: u.document.passage.text):
        found = [u for u in units if all(mentions(where(u), n) for n in numbers)]
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
            for start, end in sentence_spans(text[block[0]:block[1]]):
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
            units.append(Unit(document, start, end, scored=row_text(header, line), before=previous))
            continue
        header = ""
        if not line.strip() or HEADING.match(line) or LIST_ITEM.match(line):
            flush()
            if HEADING.match(line):  # a heading is a unit of its own ('Quillstack 5.2 (released 14 March 2025)')
                start, end = stripped(text, line_start + len(HEADING.match(line).group()), line_start + len(line))
                units.append(Unit(document, start, end, scored=text[start:end], before=previous))
                previous = text[start:end]
            if not line.strip() or HEADING.match(line):
                continue
        block = (block[0] if block else line_start, line_start + len(line))
    flush()
    return units


def stripped(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def sentence_spans(line: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of one line, split as the pseudo-queries split them (not after
    e.g., et al. and the like)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for gap in [*SENTENCE.finditer(line), None]:
        end = gap.start() if gap is not None else len(line)
        start, stop = stripped(line, cursor, end)
        if stop > start:
            if spans and ABBREVIATION.search(line[spans[-1][0]:spans[-1][1]]):
                spans[-1] = (spans[-1][0], stop)
            else:
                spans.append((start, stop))
        cursor = gap.end() if gap is not None else len(line)
    return spans


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
        if HAS_DIGIT.search(token) or token.lower() not in FUNCTION and len(token) > 1:
            seen.setdefault(token.rstrip(".,:"), None)
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
def set_value(unit: Unit, kind: str, question: str) -> bool:
    """Find the first value of ``kind`` in the unit's own text that says something the question does
    not (a name is trimmed of the question's own words at its edges); record it (passage offsets)
    and say whether there was one."""
    asked = set(stem_words(question)) | {w.lower() for w in words(question)}
    for start, end in value_spans(unit.text, kind, unit.document.passage.text):
        if kind in ("name", "place"):
            start, end = trimmed(unit.text, start, end, asked)
        value_words = [w for w in words(unit.text[start:end]) if w.lower() not in FUNCTION]
        if not value_words:
            continue
        new = [w for w, s in zip(value_words, stem_words(" ".join(value_words))) if s not in asked]
        if kind in ("name", "place") and len(new) < len(value_words):
            continue  # 'NFL Commissioners and Presidents': part of what was asked, not its answer
        if new:
            unit.value = (unit.start + start, unit.start + end)
            return True
    return False


def trimmed(text: str, start: int, end: int, asked: set[str]) -> tuple[int, int]:
    """A name's span without the question's words (and function words) at either edge: 'CEO Niels
    B. Christiansen' -> 'Niels B. Christiansen'."""
    tokens = [(m.start() + start, m.end() + start) for m in WORD.finditer(text[start:end])]
    def known(span: tuple[int, int]) -> bool:
        word = text[span[0]:span[1]]
        return word.lower() in asked or word.lower() in FUNCTION or stem_words(word)[:1] == [] or \
            stem_words(word)[0] in asked
    while tokens and known(tokens[0]):
        tokens.pop(0)
    while tokens and known(tokens[-1]):
        tokens.pop()
    return (tokens[0][0], tokens[-1][1]) if tokens else (start, start)


def value_spans(text: str, kind: str, passage: str = "") -> list[tuple[int, int]]:
    """Where values of ``kind`` stand in ``text``: a date (or a time of day, or a period: 'within 30
    days'), a number (digits or a number word), else a name."""
    if kind == "date":
        return sorted([m.span() for m in DATE.finditer(text)] + [m.span() for m in CLOCK.finditer(text)]
                      + [m.span() for m in PERIOD.finditer(text)])
    if kind == "number":
        dates = [m.span() for m in DATE.finditer(text) if not re.fullmatch(r"\d{4}", m.group())]
        return sorted([m.span() for m in AMOUNT.finditer(text) if HAS_DIGIT.search(m.group())
                       and not any(a <= m.start() < b for a, b in dates)]  # the 9 of '9 December 2024' counts nothing
                      + [m.span() for m in NUMBER_WORD.finditer(text)])
    return name_spans(text, passage)


def name_spans(text: str, passage: str = "") -> list[tuple[int, int]]:
    """Capitalised runs, without a capitalised function word that opens a sentence ('The', 'In'), and
    without a single word that opens it and is written in lower case elsewhere in the passage
    ('Critical incidents are ...' where 'critical' occurs): an ordinary word, not a name."""
    lowered = {w for w in words(passage) if w.islower()}
    spans = []
    for match in NAME.finditer(text):
        start, value = match.start(), match.group()
        first = value.split()[0]
        if first in CAPITALISED_FUNCTION:
            rest = value[len(first):].lstrip()
            if not rest or not rest[0].isupper():
                continue
            start, value = match.end() - len(rest), rest
        if start == 0 and " " not in value.strip() and value.strip(".'’").lower() in lowered:
            continue
        spans.append((start, start + len(value.rstrip(".'’"))))
    return spans


def value_key(text: str) -> str:
    return " ".join(w.lower() for w in words(text))


# ----------------------------------------------------------------------------- scoring
def score_units(question: str, units: list[Unit], kind: str | None, params: Params, embedder: Embedder,
                sparse: BM25Index | None) -> list[Unit]:
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
    vectors = embedder.encode_documents([u.scored for u in kept])  # one batch
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


def term_weights(question: str, texts: list[str], sparse: BM25Index | None) -> dict[str, float]:
    """The question's content stems, each weighted by its IDF: from the index's own statistics when
    one is bound, else from the candidate sentences (a word every sentence holds weighs little)."""
    terms = list(dict.fromkeys(s for w, s in zip(words(question), stem_words(question))
                               if w.lower() not in FUNCTION and len(w) > 1))
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
    """The IDF-weighted share of the question's content stems in the unit (or the sentence before it)."""
    if not weights:
        return 0.0
    held = set(stem_words(unit.scored)) | {s for s in stem_words(unit.before)}
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
