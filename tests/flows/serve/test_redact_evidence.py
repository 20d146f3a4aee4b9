"""The evidence answer a surface shows (issue 34 item 3) is redacted as an answer's sources are: no
server path in its reason, its sources' ids, titles and paths or its spans' ids; its passages and
sentences untouched, so the spans' offsets still point at their text."""
from __future__ import annotations

import json

from ragline.flows.contracts import Answer, EvidenceAnswer, EvidenceSpan, Source
from ragline.flows.serve.query_service import Outcome
from ragline.flows.serve.redact import Redactor

PASSAGE = "Setup. Copy /etc/ragline/keys to the host; the limit is 30 days."
SENTENCE = "the limit is 30 days."


def redactor() -> Redactor:
    redact = Redactor.__new__(Redactor)
    redact.roots, redact.hidden = ["/data/docs"], [("/srv/ragline/data", "<data dir>")]
    return redact


def evidence() -> EvidenceAnswer:
    start = PASSAGE.index(SENTENCE)
    source = Source(number=1, chunk_id="/srv/ragline/data/uploads/k.md:0", source_id="/srv/ragline/data/uploads/k.md",
                    title="/home/ops/k.md", path="/data/docs/k.md", passage=PASSAGE)
    span = EvidenceSpan(number=1, chunk_id=source.chunk_id, source_id=source.source_id, start=start,
                        end=start + len(SENTENCE), text=SENTENCE)
    return EvidenceAnswer(text=SENTENCE + " [1]", citations=[1], spans=[span], sources=[source], confidence=0.8,
                          reason="read /srv/ragline/data/idx/bm25 for term weights")


def test_the_evidence_shows_no_server_path_and_its_offsets_still_hold():
    shown = Outcome("ask", Answer(question="q", text="", evidence=evidence(), answered_by="evidence",
                                  sources=evidence().sources), {}, 1.0, redact=redactor()).to_json()["answer"]
    assert "/srv/ragline" not in json.dumps(shown) and "/home/ops" not in json.dumps(shown)
    for part in (shown["evidence"], shown):
        source = part["sources"][0]
        assert source["source_id"].startswith("<data dir>") and source["chunk_id"].startswith("<data dir>")
        assert source["title"] == "<path>" and source["path"] == "/data/docs/k.md"  # a source root stays readable
        assert source["passage"] == PASSAGE  # document text is never rewritten
    span = shown["evidence"]["spans"][0]
    assert span["source_id"] == shown["evidence"]["sources"][0]["source_id"]
    assert span["chunk_id"] == shown["evidence"]["sources"][0]["chunk_id"]
    assert PASSAGE[span["start"]:span["end"]] == span["text"] == SENTENCE
    assert shown["evidence"]["reason"].startswith("read <data dir>")
