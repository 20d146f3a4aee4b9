"""PDFs page by page on real documents: extraction speed, text against poppler's pdftotext, and how
many chunks name the right page.

Usage: .venv/bin/python bench/pdf_pages.py [PDF ...]   (default: Debian's documentation PDFs,
       /usr/share/doc/*/*.pdf; `apt-get install poppler-utils` for pdftotext)

For each PDF: pages/s of ragline's converter (pypdf, flows/formats/pdf.py), non-space characters it
extracts against `pdftotext` on the same file, and, after the real load -> convert -> chunk stages
(all-MiniLM-L6-v2, chunks of 128 tokens), the share of chunks whose words are on the pages the chunk
names (checked against `pdftotext -f N -l N` of those pages: a chunk counts as correct when 90 % of
its words occur there) and, as a control, on the page after.
"""
from __future__ import annotations

import argparse
import glob
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

from common import save

from ragline.flows.context import StepContext
from ragline.flows.formats import pdf
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec
from ragline.tasks.ingest.chunk import Params as ChunkParams, chunk
from ragline.tasks.ingest.convert import Params as ConvertParams, convert
from ragline.tasks.ingest.load import Params as LoadParams, load

WORD = re.compile(r"\w+")


def pdftotext(path: str, first: int | None = None, last: int | None = None) -> str:
    pages = ["-f", str(first), "-l", str(last)] if first else []
    return subprocess.run(["pdftotext", *pages, path, "-"], capture_output=True, text=True, check=True).stdout


def words(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text)]


def on_pages(chunk_words: list[str], page_words: Counter) -> bool:
    found = sum(1 for w in chunk_words if page_words[w])
    return bool(chunk_words) and found / len(chunk_words) >= 0.9


def measure(path: str, embedder: Embedder) -> dict:
    data = Path(path).read_bytes()
    start = time.perf_counter()
    converted = pdf.convert(data, Path(path).name)
    seconds = time.perf_counter() - start
    pages = len(converted.pages)
    poppler = pdftotext(path)
    ours_chars, poppler_chars = len(re.sub(r"\s", "", converted.text)), len(re.sub(r"\s", "", poppler))
    poppler_words, ours_words = Counter(words(poppler)), Counter(words(converted.text))
    shared = sum((poppler_words & ours_words).values()) / max(1, sum(poppler_words.values()))

    ctx = StepContext(pipeline="bench", step_id="load")
    documents = convert.fn(documents=load.fn(params=LoadParams(paths=[path]), ctx=ctx), params=ConvertParams(), ctx=ctx)
    chunks = chunk.fn(documents=documents, params=ChunkParams(size=128, overlap=16),
                      ctx=StepContext(pipeline="bench", step_id="chunk"), embedder=embedder)
    page_words = [Counter(words(pdftotext(path, n, n))) for n in range(1, pages + 1)]
    correct = control = spanning = 0
    for c in chunks:
        first, last = c.metadata["page_start"], c.metadata["page_end"]
        body = words(c.text.split("\n", 1)[1] if c.title and c.text.startswith(c.title + "\n") else c.text)
        correct += on_pages(body, sum((page_words[n - 1] for n in range(first, last + 1)), Counter()))
        control += last < pages and on_pages(body, page_words[last])
        spanning += first != last
    return {"file": path, "pages": pages, "seconds": round(seconds, 3), "pages_per_s": round(pages / seconds, 1),
            "chars": ours_chars, "pdftotext_chars": poppler_chars, "chars_ratio": round(ours_chars / poppler_chars, 3),
            "pdftotext_words_found": round(shared, 3), "chunks": len(chunks), "chunks_on_their_pages": correct,
            "chunks_on_the_next_page": control, "chunks_spanning_pages": spanning}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pdfs", nargs="*", default=sorted(glob.glob("/usr/share/doc/*/*.pdf")))
    args = parser.parse_args()
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    rows = [measure(path, embedder) for path in args.pdfs]
    print("| file | pages | pages/s | chars vs pdftotext | pdftotext words found | chunks | on their pages | "
          "on the next page (control) | spanning 2 pages |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['file']).name} | {r['pages']} | {r['pages_per_s']} | {r['chars']:,} / {r['pdftotext_chars']:,} "
              f"({r['chars_ratio']:.1%}) | {r['pdftotext_words_found']:.1%} | {r['chunks']} | "
              f"{r['chunks_on_their_pages']} ({r['chunks_on_their_pages'] / r['chunks']:.1%}) | "
              f"{r['chunks_on_the_next_page']} | {r['chunks_spanning_pages']} |")
    save("pdf_pages", {"rows": rows})


if __name__ == "__main__":
    main()
