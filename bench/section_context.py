"""Does the section path help when it opens the text the embedder sees? (chunk's `prepend_section`)

Usage: .venv/bin/python bench/section_context.py [--files N] [--queries N] [--size TOKENS] [FILE ...]
       (default: the first 10 files of 25-45 kB of Debian's Node.js API reference,
       /usr/share/doc/nodejs/api/*.md, and Debian's Python policy, /usr/share/doc/python3/python-policy.html:
       real documents with headings; `apt-get install nodejs-doc python3`. About 1,500 chunks per run:
       half an hour on two busy cores)

The documents go through the real load -> convert -> chunk stages twice, without and with
``prepend_section`` (everything else the same: all-MiniLM-L6-v2, chunks of ``--size`` tokens, the
title prepended as by default); every chunk is embedded and queries are answered by exact cosine
search over all chunks (what Chroma approximates), and by BM25 (bm25s, as the sparse retriever).

Queries with known answers, derived without hand labels, from sections large enough to have chunks
of their own (a section's chunks carry its path in their metadata, in both runs alike):

- heading: the section's own heading as the query (only headings that occur once in the corpus).
  It favours the prefix: with it, every chunk of the section contains the query's words.
- held-out sentence: one sentence of the section's body, removed from the indexed text, as the
  query: the section's remaining chunks are the answer. Nothing here repeats the heading.

Relevant: the chunks of that section. Reported: nDCG@10 and Recall@10 over the top 10 chunks, and
hit@1 (the first chunk is the section's).
"""
from __future__ import annotations

import argparse
import glob
import math
import random
import re
import statistics
import time
from pathlib import Path

import numpy as np
from common import save

from ragline.flows.context import StepContext
from ragline.flows.contracts import Document
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.chunk import Params as ChunkParams, _Sections, _headings, chunk
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params as LoadParams, load

DEFAULT_FILES = [f for f in sorted(glob.glob("/usr/share/doc/nodejs/api/*.md"))
                 if 25_000 <= Path(f).stat().st_size <= 45_000][:10] + ["/usr/share/doc/python3/python-policy.html"]
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`])")
MIN_SECTION_WORDS = 150  # a section this large is split on its own: its chunks carry its path
K = 10


def documents(files: list[str]) -> list[Document]:
    ctx = StepContext(pipeline="bench", step_id="load")
    loaded = load.fn(params=LoadParams(paths=files), ctx=ctx)
    return convert.fn(documents=loaded, params=ConvertParams(), ctx=ctx)


def clean_heading(title: str) -> str:
    return re.sub(r"[`*_\\]", "", title).strip()


def prose_sentences(body: str) -> list[str]:
    """Sentences of a section's prose (no code, lists, tables or headings), 8 to 40 words."""
    lines, fenced = [], False
    for line in body.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or not line.strip() or line.lstrip().startswith(("|", "*", "-", "<", ">", "#")) or line.startswith("  "):
            lines.append("\n")
            continue
        lines.append(line)
    found = []
    for paragraph in " ".join(lines).split("\n"):
        for sentence in SENTENCE.split(paragraph.strip()):
            words = sentence.split()
            if 8 <= len(words) <= 40 and sentence.endswith(".") and sum(c.isalpha() for c in sentence) > 0.7 * len(sentence):
                found.append(sentence.strip())
    return found


def sections(docs: list[Document]) -> list[dict]:
    """Large sections: (document, path, heading, body span)."""
    found = []
    for doc in docs:
        heads = _headings(doc.text)
        named = _Sections(doc.text)
        for n, (offset, _, title) in enumerate(heads):
            end = heads[n + 1][0] if n + 1 < len(heads) else len(doc.text)
            body = doc.text[offset:end].split("\n", 1)[1] if "\n" in doc.text[offset:end] else ""
            if len(body.split()) >= MIN_SECTION_WORDS:
                found.append({"source": doc.source_id, "path": named.at(offset), "heading": clean_heading(title),
                              "body": body})
    return found


def queries(docs: list[Document], limit: int, seed: int = 7) -> tuple[list[dict], list[dict], list[Document]]:
    """Heading queries, held-out sentence queries, and the documents without the held-out sentences."""
    found = sections(docs)
    counts: dict[str, int] = {}
    for doc in docs:
        for _, _, title in _headings(doc.text):
            counts[clean_heading(title)] = counts.get(clean_heading(title), 0) + 1
    rng = random.Random(seed)
    rng.shuffle(found)
    heading = [{"text": s["heading"], "source": s["source"], "path": s["path"]} for s in found
               if counts[s["heading"]] == 1 and len(s["heading"]) >= 4][:limit]
    held: list[dict] = []
    texts = {d.source_id: d.text for d in docs}
    for s in found:
        if len(held) >= limit:
            break
        candidates = [x for x in prose_sentences(s["body"]) if len(as_written(x).findall(texts[s["source"]])) == 1]
        if len(candidates) < 3:  # the section keeps text of its own without the held-out sentence
            continue
        sentence = candidates[len(candidates) // 2]
        texts[s["source"]] = as_written(sentence).sub("", texts[s["source"]], count=1)
        held.append({"text": sentence, "source": s["source"], "path": s["path"]})
    return heading, held, [d.model_copy(update={"text": texts[d.source_id]}) for d in docs]


def as_written(sentence: str) -> re.Pattern:
    """The sentence as it stands in the text (its words may be wrapped over lines)."""
    return re.compile(r"\s+".join(re.escape(word) for word in sentence.split()))


def ndcg(relevant: list[bool], total: int) -> float:
    dcg = sum(1 / math.log2(rank + 2) for rank, hit in enumerate(relevant[:K]) if hit)
    ideal = sum(1 / math.log2(rank + 2) for rank in range(min(total, K)))
    return dcg / ideal if ideal else 0.0


def evaluate(chunks, ranked: list[list[int]], asked: list[dict]) -> dict:
    keys = [(c.source_id, c.metadata.get("section", "")) for c in chunks]
    scores = {"ndcg@10": [], "recall@10": [], "hit@1": []}
    for query, order in zip(asked, ranked):
        want = (query["source"], query["path"])
        total = keys.count(want)
        hits = [keys[i] == want for i in order[:K]]
        scores["ndcg@10"].append(ndcg(hits, total))
        scores["recall@10"].append(sum(hits) / total if total else 0.0)
        scores["hit@1"].append(float(hits[0]))
    return {name: round(statistics.mean(values), 4) for name, values in scores.items()}


def bm25_rank(chunks, asked: list[dict]) -> list[list[int]]:
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([c.text for c in chunks], stopwords="en", show_progress=False), show_progress=False)
    found, _ = retriever.retrieve(bm25s.tokenize([q["text"] for q in asked], stopwords="en", show_progress=False),
                                  k=K, show_progress=False)
    return [list(row) for row in found]


def run(docs: list[Document], embedder: Embedder, size: int, prefix: bool, query_sets: dict[str, list[dict]]) -> dict:
    started = time.perf_counter()
    chunks = chunk.fn(documents=docs, params=ChunkParams(size=size, overlap=16, prepend_section=prefix),
                      ctx=StepContext(pipeline="bench", step_id="chunk"), embedder=embedder)
    vectors = embedder.encode_documents([c.text for c in chunks])
    row = {"prepend_section": prefix, "chunks": len(chunks), "index_seconds": round(time.perf_counter() - started, 1)}
    for name, asked in query_sets.items():
        similarity = embedder.encode_queries([q["text"] for q in asked]) @ np.asarray(vectors).T
        dense = [list(np.argsort(-row_)[:K]) for row_ in similarity]
        row[name] = {"dense": evaluate(chunks, dense, asked), "bm25": evaluate(chunks, bm25_rank(chunks, asked), asked)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--files", dest="max_files", type=int, default=0, help="use the first N files only (0: all)")
    parser.add_argument("--queries", type=int, default=200, help="queries per set at most")
    parser.add_argument("--size", type=int, default=128, help="chunk size in tokens")
    args = parser.parse_args()
    files = args.files[: args.max_files] if args.max_files else args.files
    docs = documents(files)
    heading, held, indexed = queries(docs, args.queries)
    print(f"{len(docs)} documents, {sum(len(d.text) for d in docs):,} characters; {len(heading)} heading queries, "
          f"{len(held)} held-out sentence queries; chunks of {args.size} tokens", flush=True)
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    rows = [run(indexed, embedder, args.size, prefix, {"heading": heading, "sentence": held}) for prefix in (False, True)]
    print("| queries | retriever | prepend_section | nDCG@10 | Recall@10 | hit@1 |")
    print("|---|---|---|---|---|---|")
    for name in ("heading", "sentence"):
        for retriever in ("dense", "bm25"):
            for row in rows:
                m = row[name][retriever]
                print(f"| {name} ({len(heading if name == 'heading' else held)}) | {retriever} | "
                      f"{'on' if row['prepend_section'] else 'off'} | {m['ndcg@10']:.4f} | {m['recall@10']:.4f} | "
                      f"{m['hit@1']:.4f} |")
    for row in rows:
        print(f"prepend_section {'on' if row['prepend_section'] else 'off'}: {row['chunks']} chunks, "
              f"chunked and embedded in {row['index_seconds']} s")
    save("section_context", {"files": files, "size": args.size, "queries": {"heading": heading, "sentence": held},
                             "rows": rows})


if __name__ == "__main__":
    main()
