"""Chunking time per MB of one document: a single-line text file against a normal document (issue 39.6).

Usage: .venv/bin/python bench/chunk_long_line.py [--sizes 0.25 1 10]

For each size, three documents of that many characters go through the real ``chunk`` stage alone
(all-MiniLM-L6-v2, its default 254-token chunks), each timed once in this process:

- ``normal``: Markdown of paragraphs (sentences of 6-14 words) under a heading every ~20 paragraphs,
  the baseline;
- ``line``: the same words on one line (no newline, no heading);
- ``word``: one line without a space (a base-36 run), which WordPiece reads as one unknown token.

It prints seconds per MB for each and the largest chunk in characters: linear chunking keeps s/MB
flat from 0.25 to 10 MB and a line no slower per MB than the baseline; bounded chunks keep the
largest chunk near the baseline's (a ``word`` line was one chunk of the whole line).
"""
from __future__ import annotations

import argparse
import random
import time

from common import save

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.chunk import Params, chunk

WORDS = ("protein cell membrane receptor binding pathway expression signal tumour growth factor analysis "
         "cohort patients treatment response mitochondria inflammation antibody vaccine").split()


def sentences(rng: random.Random, chars: int) -> list[str]:
    out, size = [], 0
    while size < chars:
        words = rng.choices(WORDS, k=rng.randint(6, 14))
        out.append(words[0].capitalize() + " " + " ".join(words[1:]) + ".")
        size += len(out[-1]) + 1
    return out


def normal(chars: int) -> str:
    rng = random.Random(1)
    parts, size, section = [], 0, 0
    while size < chars:
        if len(parts) % 20 == 0:
            section += 1
            parts.append(f"## Section {section}")
        parts.append(" ".join(sentences(rng, 400)))
        size += len(parts[-1]) + 2
    return "\n\n".join(parts)[:chars]


def documents(chars: int) -> dict[str, Document]:
    line = " ".join(sentences(random.Random(2), chars))[:chars]
    word = "".join(random.Random(3).choices("abcdefghijklmnopqrstuvwxyz0123456789", k=chars))
    return {"normal": Document(source_id="normal.md", text=normal(chars), format="markdown"),
            "line": Document(source_id="line.txt", text=line, format="text"),
            "word": Document(source_id="word.txt", text=word, format="text")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1.0, 10.0], help="MB per document")
    args = parser.parse_args()
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    embedder.tokenizer  # loaded before timing
    rows = []
    print(f"{'MB':>6} {'document':>8} {'seconds':>8} {'s/MB':>6} {'chunks':>7} {'largest chunk':>14}")
    for mb in args.sizes:
        for name, doc in documents(int(mb * 1_000_000)).items():
            ctx = StepContext(pipeline="bench", step_id="chunk", fingerprint="fp")
            started = time.perf_counter()
            chunks = chunk.fn(documents=[doc], params=Params(), ctx=ctx, embedder=embedder)
            seconds = time.perf_counter() - started
            largest = max(len(c.text) for c in chunks)
            rows.append({"mb": mb, "document": name, "seconds": round(seconds, 3),
                         "seconds_per_mb": round(seconds / mb, 3), "chunks": len(chunks), "largest_chunk": largest})
            print(f"{mb:>6} {name:>8} {seconds:>8.2f} {seconds / mb:>6.2f} {len(chunks):>7} {largest:>14}",
                  flush=True)
    print(f"saved {save('chunk_long_line', {'rows': rows})}")


if __name__ == "__main__":
    main()
