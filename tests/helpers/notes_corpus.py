"""A corpus of same-length notes (and a JSONL file of records) with trusted change signals, and the
ingestion pipeline that indexes it with the hash-based stand-in embedder: the streaming, memory and
crash-safety tests' corpus."""
from __future__ import annotations

import json
import os
import time

from tests.helpers.data import BASE_RESOURCES


HASH_EMBED = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    batch_size: 16
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 64, overlap: 8}}
      - {id: embed,   task: tests.helpers.hash_embed.hash_embed, with: {dimension: 8}}
      - {id: write,   task: index, with: {gate_floor_pairs: 0}}
"""


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def note_text(i: int, words: int = 60) -> str:
    """A note of ``words`` words, each suffixed with ``i`` at a fixed width: every note of a corpus is
    the same length (with ``str(i)`` a note's words grew with its number, so the 4N corpus's batches
    held more text than the N corpus's: 7.5 chunks a document at 40 documents, 9.7 at 640)."""
    return f"# Note {i}\n\n" + " ".join(f"{WORDS[(i * 7 + k) % len(WORDS)]}{i:05d}" for k in range(words)) + ".\n"


def age(path, seconds: float = 3600) -> None:
    """Set a file's mtime in the past: a file written this instant has no trusted signal (racy)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def write_corpus(folder, n: int, words: int = 60) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = folder / f"{i // 100:03d}" / f"note{i:05d}.md"
        path.parent.mkdir(exist_ok=True)
        path.write_text(note_text(i, words))
        age(path)
    records = "".join(json.dumps({"_id": f"r{i}", "title": f"R{i}", "text": note_text(1000 + i)}) + "\n" for i in range(5))
    (folder / "records.jsonl").write_text(records)
    age(folder / "records.jsonl")
