"""Parsing what an LLM returns, with a logged fallback instead of a crash when it is malformed.

Small models often ignore the requested format; every parser here returns something usable
and says, in the log, when it had to fall back.
"""
from __future__ import annotations

import json
import logging
import math
import re
import string
from typing import Any, Callable

from ragline.flows.resources.models.llm import Completion

log = logging.getLogger("ragline.llm_output")

_LIST_MARKER = re.compile(r"^\s*(?:[-*•]|\d+[.):]|\(\d+\)|q\d+[.:])\s*", re.I)
_CITATION = re.compile(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]")


def parse_lines(text: str, limit: int) -> list[str]:
    """Items of a one-per-line reply, without numbering, bullets, quotes or duplicates."""
    items: list[str] = []
    for line in text.splitlines():
        item = _LIST_MARKER.sub("", line).strip().strip('"').strip("'").strip()
        if item and item.lower() not in (i.lower() for i in items):
            items.append(item)
    return items[:limit]


def parse_permutation(text: str, n: int, what: str = "ranking") -> list[int]:
    """0-based order from a reply like '[2] > [1] > [3]'. Out-of-range or repeated numbers are
    ignored and missing ones keep their original order after the ranked ones (logged)."""
    seen: list[int] = []
    for match in re.findall(r"\d+", text):
        number = int(match)
        if 1 <= number <= n and number - 1 not in seen:
            seen.append(number - 1)
    if len(seen) != n:
        log.warning("the LLM's %s is not a permutation of 1..%d (%r); keeping the original order for the rest",
                    what, n, text[:200])
        seen += [i for i in range(n) if i not in seen]
    return seen


def parse_citations(text: str) -> list[int]:
    """[n] markers in order of first appearance; [1, 2] and [1][2] both count."""
    found: list[int] = []
    for group in _CITATION.findall(text):
        for number in re.split(r"\s*[,;]\s*", group):
            if int(number) not in found:
                found.append(int(number))
    return found


def strip_citations(text: str) -> str:
    """The text without its [n] / [1, 2] markers."""
    return _CITATION.sub("", text).strip()


_PUNCTUATION = frozenset(string.punctuation)


def normalize_text(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def option_probabilities(completion: Completion, options: dict[str, tuple[str, ...]],
                         min_mass: float = 0.1) -> dict[str, float]:
    """Probability of each option from the first answer token's top logprobs (normalised over the
    options); falls back to the text when the server sent no logprobs or the options together got
    less than ``min_mass`` (the model was answering something else: a sliver is no verdict)."""
    mass = {name: 0.0 for name in options}
    if completion.tokens:
        first = next((t for t in completion.tokens if t.token.strip()), completion.tokens[0])
        candidates = dict(first.top) or {first.token: first.logprob}
        for token, logprob in candidates.items():
            word = token.strip().lower()
            for name, prefixes in options.items():
                if word and any(p.startswith(word) or word.startswith(p) for p in prefixes):
                    mass[name] += math.exp(logprob)
                    break
    total = sum(mass.values())
    if total >= min_mass:
        return {name: value / total for name, value in mass.items()}
    reply = completion.text.strip().lower()
    for name, prefixes in options.items():
        if any(reply.startswith(p) for p in prefixes):
            return {other: float(other == name) for other in options}
    log.warning("could not read an option %s from the LLM's reply %r", list(options), completion.text[:120])
    return {}


def parse_json(text: str, default: Any) -> Any:
    """The first JSON value in the reply, or ``default`` (logged) when there is none."""
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start >= 0:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            pass
    log.warning("the LLM's reply is not JSON (%r); using the fallback", text[:200])
    return default


def clip(text: str, max_chars: int) -> str:
    """Bound user text that goes into a prompt, so a huge request cannot overflow the context."""
    if len(text) <= max_chars:
        return text
    log.warning("request of %d characters clipped to %d for the prompt", len(text), max_chars)
    return text[:max_chars].rstrip() + " …"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[^\s])|\n{2,}")


def sentences(text: str) -> list[str]:
    """Sentences (and paragraphs) of a passage, stripped, none empty."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


# The prompts' own delimiters as a model may echo them (any case, blanks inside, or the escaped
# ``&lt;`` that ``fence`` writes), with the blanks before them; and one cut off at the very end.
_MARKUP = re.compile(r"[ \t]*(?:<|&lt;|\uff1c)\s*/?\s*(?:document|references)(?![a-z])[^<>]*>", re.I)
_PREFIXES = "|".join(name[:n] for name in ("document", "references") for n in range(len(name) - 1, 0, -1))
_MARKUP_TAIL = re.compile(r"[ \t]*(?:<|&lt;|\uff1c)\s*(?:/\s*(?:(?:document|references)(?![a-z])[^<>]*|"
                          rf"(?:{_PREFIXES})?)|(?:document|references)(?![a-z])[^<>]*|"
                          rf"(?:{'|'.join(p for p in _PREFIXES.split('|') if len(p) >= 3)})(?![a-z]))$", re.I)
# a piece that may still become one (held back while streaming until it is decided)
_MARKUP_START = re.compile(r"[ \t]*(?:(?:<|&lt;|\uff1c)\s*/?\s*([a-z]*)([^<>]*)|&(?:l(?:t)?)?)$", re.I)
_NAMES = ("document", "references")


def strip_markup(text: str) -> str:
    """Generated text without the prompt's <document>/<references> tags: they are prompt
    structure, never part of an answer."""
    return _MARKUP_TAIL.sub("", _MARKUP.sub("", text)).strip()


class MarkupFilter:
    """``strip_markup`` for a stream: passes tokens on, holding back only what may still turn out
    to be a delimiter split across tokens (``</docu`` + ``ment>``), so none ever reaches a client."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit, self.pending = emit, ""

    def feed(self, token: str) -> None:
        text = _MARKUP.sub("", self.pending + token)
        hold = self._undecided(text)
        self.pending = text[hold:]
        if text[:hold]:
            self.emit(text[:hold])

    def flush(self) -> None:
        rest, self.pending = _MARKUP_TAIL.sub("", self.pending), ""
        if rest:
            self.emit(rest)

    @staticmethod
    def _undecided(text: str) -> int:
        """Where the tail that may still become a delimiter starts (len(text) when none does);
        trailing blanks wait too, since a delimiter takes the blanks before it along."""
        for start in (m.start() for m in re.finditer(r"[ \t]*[<&\uff1c]", text)):
            match = _MARKUP_START.match(text, start)
            if match is None:
                continue
            name, rest = (match.group(1) or "").lower(), match.group(2) or ""
            if (not rest and any(n.startswith(name) for n in _NAMES)) or \
                    (name in _NAMES and not rest[:1].isalpha()):
                return start
        return len(text.rstrip(" \t"))
