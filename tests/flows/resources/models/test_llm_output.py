"""Parsers of LLM replies: every malformed shape yields something usable."""
from __future__ import annotations

import logging
import re

import pytest

from ragline.flows.resources.models.llm_output import clip, option_probabilities, parse_citations, parse_json, parse_lines, \
    parse_permutation, sentences
from ragline.flows.resources.models.llm import Completion, TokenLogprob


def test_parse_lines_strips_markers_and_duplicates():
    assert parse_lines("1. alpha\n2) beta\n- Alpha\n* \"gamma\"\n\n(4) delta", 3) == ["alpha", "beta", "gamma"]


def test_permutation_valid_partial_and_garbage(caplog):
    assert parse_permutation("[2] > [3] > [1]", 3) == [1, 2, 0]
    with caplog.at_level(logging.WARNING):
        assert parse_permutation("[3] > [3] > [7]", 3) == [2, 0, 1]
        assert parse_permutation("no idea", 2) == [0, 1]
    assert caplog.text.count("not a permutation") == 2


def test_citations():
    assert parse_citations("A [2], B [1, 3] and [2][4]; not [x] nor (5).") == [2, 1, 3, 4]


def test_option_probabilities_from_logprobs_and_text(caplog):
    tokens = [TokenLogprob(" Yes", -0.2, {" Yes": -0.2, "No": -1.8, "Maybe": -3.0})]
    probs = option_probabilities(Completion("Yes", tokens), {"yes": ("yes",), "no": ("no",)})
    assert probs["yes"] > 0.8 and abs(sum(probs.values()) - 1) < 1e-9
    assert option_probabilities(Completion("CONTRADICTED."), {"s": ("supported",), "c": ("contradicted",)}) == \
        {"s": 0.0, "c": 1.0}
    with caplog.at_level(logging.WARNING):
        assert option_probabilities(Completion("banana"), {"yes": ("yes",)}) == {}
    assert "could not read an option" in caplog.text


def test_parse_json_with_fallback(caplog):
    assert parse_json('Sure! {"a": [1, 2]} trailing', None) == {"a": [1, 2]}
    with caplog.at_level(logging.WARNING):
        assert parse_json("{broken", ["fallback"]) == ["fallback"]
    assert "not JSON" in caplog.text


def test_clip_and_sentences():
    assert clip("short", 10) == "short" and clip("x" * 20, 10) == "x" * 10 + " …"
    assert sentences("One. Two! Three?\n\nFour") == ["One.", "Two!", "Three?", "Four"]


# --- issue 15 item 5: the prompt's delimiters never reach an answer ---------------------------------
import random  # noqa: E402

from ragline.flows.resources.models.llm_output import MarkupFilter, strip_markup  # noqa: E402

LEAKED = ["Cache misses are skipped [1]. </document> [1]", "<document id=\"2\" title=\"x\">Paris [2].</document>",
          "Paris [1].\n</references>", "Yes [1]. &lt;/document> ok", "A </Document\t> b < /references >.",
          "cut at the end </docu", "a < b and <div> stay", "</document"]


def test_strip_markup_removes_delimiters_and_keeps_everything_else():
    assert strip_markup(LEAKED[0]) == "Cache misses are skipped [1]. [1]"
    assert strip_markup(LEAKED[1]) == "Paris [2]."
    assert strip_markup(LEAKED[2]) == "Paris [1]."
    assert strip_markup(LEAKED[3]) == "Yes [1]. ok"
    assert strip_markup(LEAKED[4]) == "A b."
    assert strip_markup(LEAKED[5]) == "cut at the end"
    assert strip_markup(LEAKED[6]) == "a < b and <div> stay"


@pytest.mark.parametrize("text", LEAKED)
def test_streamed_tokens_never_show_a_delimiter_however_they_are_split(text):
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        shown: list[str] = []
        stream = MarkupFilter(shown.append)
        for piece in pieces:
            stream.feed(piece)
            assert not re.search(r"</?\s*(document|references)", "".join(shown), re.I), (pieces, shown)
        stream.flush()
        assert "".join(shown).strip() == strip_markup(text), pieces
